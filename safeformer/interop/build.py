"""The build of a conversion for ``from_x_transformers`` (``convert``): a checked ``_Plan`` into the model.

``_build_wrapper`` constructs the safeformer ``TransformerWrapper`` a plan (``plan``) describes, checks its layer
pattern, and copies the x-transformers weights in, one phase per part (the wrapper's tables, the stack's
positions, each layer's norms, attention or feed-forward, the residual routing), through a ``_Copier`` that
records which parameters were read: the ones left unread are problems. Query heads keep their order
(``_Layout``; see ``convert``'s module docstring for how the numbers are matched).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..nn.modules import AdaptiveNorm, Derf, DynamicTanh, LayerNorm, RMSNorm
from ..nn.xt_modules import ScaleNorm as XtScaleNorm
from ..nn.xt_modules import SimpleRMSNorm as XtSimpleRMSNorm
from ..stack.wrappers import XT_OPTION_PARAMETERS, TransformerWrapper
from .checks import _RMS_EPS, _AttnOptions, _norm_weights, _parse_ff, _Problems, _unwrap
from .plan import _Plan


@dataclass(frozen=True)
class _Layout:
    """The converted model's query head order (the identity: both tile grouped-query heads), width and reference."""

    heads: int
    kv_heads: int
    dim_head: int
    dim: int
    ref: Tensor  # the token embedding: the device and dtype of the model
    perm: Tensor  # (h,): query head n of safeformer is x-transformers' perm[n]
    rows: Tensor  # (h * d,): the query features in that order

    @classmethod
    def of(cls, plan: _Plan) -> _Layout:
        """The layout of a plan's model."""
        ref = plan.model.token_emb.emb.weight
        heads, dim_head = plan.heads, plan.dim_head
        perm = torch.arange(heads, device=ref.device)  # both order grouped-query heads as x-transformers (tiled)
        rows = (perm[:, None] * dim_head + torch.arange(dim_head, device=ref.device)[None, :]).reshape(-1)
        return cls(heads=heads, kv_heads=plan.kv_heads, dim_head=dim_head, dim=plan.model.attn_layers.dim, ref=ref,
                   perm=perm, rows=rows)


class _Copier:
    """Copies x-transformers parameters into safeformer's, recording which were read (``used``, by id)."""

    def __init__(self, xt) -> None:
        self.xt = xt
        self.used: set[int] = set()

    def take(self, t: Tensor) -> Tensor:
        """``t`` detached, recorded as read."""
        self.used.add(id(t))
        return t.detach()

    @staticmethod
    def put(dst: Tensor, src: Tensor) -> None:
        """Copies ``src`` into ``dst`` of the same shape."""
        if dst.shape != src.shape:
            raise AssertionError(f"shape mismatch converting weights: {tuple(dst.shape)} vs {tuple(src.shape)}")
        dst.copy_(src)

    def copy_same(self, dst: nn.Module, src: nn.Module) -> None:
        """Every parameter of ``src`` into ``dst``'s parameter of the same name."""
        mine = dict(dst.named_parameters())
        if set(mine) != {n for n, _ in src.named_parameters()}:
            raise AssertionError(f"parameters differ: {sorted(mine)} vs {[n for n, _ in src.named_parameters()]}")
        for n, p in src.named_parameters():
            self.put(mine[n], self.take(p))

    def copy_norm(self, dst: nn.Module, src) -> None:
        """An x-transformers norm into safeformer's, its unit offsets folded in."""
        put, take = self.put, self.take
        weight, _, names = _norm_weights(src, self.xt)
        for n in names:
            self.used.add(id(getattr(src, n)))
        if isinstance(dst, AdaptiveNorm):  # norm(x) * (1 + W c): x-transformers' has no shift (to_beta stays 0)
            put(dst.to_gamma.weight, take(src.to_gamma.weight))
            if dst.to_beta is not None:
                dst.to_beta.weight.zero_()
            if dst.rms and dst.eps != _RMS_EPS:
                raise AssertionError(f"converted adaptive RMSNorm has eps {dst.eps}, expected {_RMS_EPS}")
            return
        if isinstance(dst, DynamicTanh):  # x-transformers' unit offsets (norm_add_unit_offset) moved to ours
            put(dst.pre_tanh_scale, src.pre_tanh_scale.detach() + float(src.pre_tanh_scale_offset)
                - dst.pre_tanh_scale_offset)
            put(dst.gamma, src.gamma.detach() + float(src.gamma_offset) - dst.gamma_offset)
            put(dst.beta, src.beta.detach())
            return
        if isinstance(dst, XtScaleNorm):  # one scalar gain, x-transformers' unit offset folded in
            put(dst.g, src.g.detach() + float(src.unit_offset) - float(dst.unit_offset))
            return
        if isinstance(dst, XtSimpleRMSNorm):  # no parameter
            return
        if isinstance(dst, Derf):  # erf(alpha * x + s) * gamma + beta, x-transformers' unit offsets folded in
            offset = float(src.scale_offset) - dst.scale_offset
            put(dst.alpha, src.alpha.detach() + offset)
            put(dst.s, src.s.detach())
            put(dst.gamma, src.gamma.detach() + offset)
            put(dst.beta, src.beta.detach())
            return
        gain = dst.gamma if isinstance(dst, LayerNorm) else dst.g  # stored minus our unit offset
        put(gain, weight.to(gain.dtype) - float(dst.unit_offset))
        if isinstance(dst, LayerNorm):
            if dst.bias is not None:
                dst.bias.zero_()
        elif isinstance(dst, RMSNorm):
            if dst.eps != _RMS_EPS:
                raise AssertionError(f"converted RMSNorm has eps {dst.eps}, expected {_RMS_EPS}")
        else:
            raise AssertionError(f"unexpected norm {type(dst).__name__}")


def _build_wrapper(plan: _Plan, xt) -> TransformerWrapper:
    """The safeformer model of a checked plan, with the x-transformers weights copied in. Parameters
    left unused are recorded as problems (the caller raises)."""
    model = plan.model
    layers = model.attn_layers
    sf = _construct(plan)
    c = _Copier(xt)
    lay = _Layout.of(plan)
    with torch.no_grad():
        _copy_wrapper_weights(c, plan, sf)
        _copy_stack_positions(c, plan, sf, lay)
        _copy_wrapper_extras(c, plan, sf)
        for k in range(len(layers.layers)):
            _copy_layer(c, plan, sf, k, lay)
        _copy_stack_tail(c, plan, sf)

    unused = [n for n, p in model.named_parameters() if id(p) not in c.used]
    if unused:
        plan.problems.add(f"parameters with no safeformer counterpart: {', '.join(unused)}")
    sf.train(model.training)
    return sf


def _construct(plan: _Plan) -> TransformerWrapper:
    """The plan's safeformer model (no weights yet), its layer pattern checked, on the model's device and dtype."""
    layers = plan.model.attn_layers
    try:
        sf = TransformerWrapper(attn_layers=plan.layers_cls(**plan.stack_kwargs), **plan.wrapper_kwargs)
    except (TypeError, ValueError) as err:  # options each convertible, but not together in safeformer
        plan.problems.add(f"no safeformer model takes this combination of options: {err}")
        plan.problems.raise_if_any()
    built = (tuple(sf.attn_layers.layer_types), tuple(sf.attn_layers.layers_execute_order))
    if built != (tuple(layers.layer_types), tuple(layers.layers_execute_order)):
        plan.problems.add(f"a layer pattern / execution order safeformer builds otherwise: {built} for "
                          f"{(tuple(layers.layer_types), tuple(layers.layers_execute_order))}")
        plan.problems.raise_if_any()
    ref = plan.model.token_emb.emb.weight
    return sf.to(device=ref.device, dtype=ref.dtype)  # before copying: no precision is lost on the way


def _copy_wrapper_weights(c: _Copier, plan: _Plan, sf: TransformerWrapper) -> None:
    """The wrapper's embeddings, memory and cls tokens, output heads and its options' parameters."""
    model, put, take = plan.model, c.put, c.take
    put(sf.token_emb.weight, take(model.token_emb.emb.weight))
    if plan.wrapper_kwargs.get("scaled_sinu_pos_emb"):
        put(sf.pos_emb.scale, take(model.pos_emb.scale))
    elif plan.wrapper_kwargs.get("use_abs_pos_emb"):
        put(sf.pos_emb.emb.weight, take(model.pos_emb.emb.weight))
    if plan.wrapper_kwargs.get("num_memory_tokens"):
        put(sf.memory_tokens, take(model.memory_tokens))
    if plan.wrapper_kwargs.get("use_cls_token"):
        put(sf.cls_token, take(model.cls_token))
    if not plan.tied and model.to_logits is not None:
        if isinstance(model.to_logits, nn.ModuleList):  # num_output_heads
            for mine, theirs in zip(sf.to_logits, model.to_logits, strict=True):
                c.copy_same(mine, theirs)
        else:
            put(sf.to_logits.weight, take(model.to_logits.weight))
    if plan.wrapper_kwargs.get("emb_dim") is not None:
        c.copy_same(sf.project_emb, model.project_emb)
    if plan.wrapper_kwargs.get("embed_num_tokens"):
        c.copy_same(sf.embeds, model.embeds)
    if plan.wrapper_kwargs.get("looped"):
        c.copy_same(sf.exit_gate, model.exit_gate)
    theirs = dict(model.named_parameters())
    for key in XT_OPTION_PARAMETERS:  # the wrapper options' parameters, same names in both
        if key in theirs:
            put(sf.get_parameter(key), take(theirs[key]))


def _copy_stack_positions(c: _Copier, plan: _Plan, sf: TransformerWrapper, lay: _Layout) -> None:
    """The stack's relative position parameters (T5 bias, dynamic bias, PoPE), per query head, and the rotary and
    PoPE frequencies (their ``inv_freq`` buffers, which the angles read) as they are."""
    layers, put, take, perm = plan.model.attn_layers, c.put, c.take, lay.perm
    if plan.stack_kwargs.get("rotary_pos_emb"):
        put(sf.attn_layers.rotary_pos_emb.inv_freq, layers.rotary_pos_emb.inv_freq.detach())
    if plan.stack_kwargs.get("rel_pos_bias"):  # Embedding(num_buckets, h): per query head
        put(sf.attn_layers.rel_pos.relative_attention_bias.weight,
            take(layers.rel_pos.relative_attention_bias.weight)[:, perm])
    if plan.stack_kwargs.get("dynamic_pos_bias"):  # the MLP as it is, its last layer's rows per query head
        src, dst = layers.rel_pos, sf.attn_layers.rel_pos
        for (name, p_dst), (_, p_src) in zip(dst.named_parameters(), src.named_parameters()):
            last = name.startswith(f"mlp.{len(dst.mlp) - 1}.")
            put(p_dst, take(p_src)[perm] if last else take(p_src))
    if plan.stack_kwargs.get("polar_pos_emb"):  # (h, 1, d): per query head; the frequencies (a buffer) as they are
        put(sf.attn_layers.polar_pos_emb.learned_bias, take(layers.polar_pos_emb.learned_bias)[perm])
        put(sf.attn_layers.polar_pos_emb.inv_freq, layers.polar_pos_emb.inv_freq.detach())


def _copy_wrapper_extras(c: _Copier, plan: _Plan, sf: TransformerWrapper) -> None:
    """The wrapper's deep embedding (``ff_deep_embed``) and attention pool."""
    model = plan.model
    if plan.wrapper_kwargs.get("post_emb_norm"):
        c.copy_norm(sf.post_emb_norm, model.post_emb_norm)
    if plan.wrapper_kwargs.get("ff_deep_embed"):
        c.put(sf.ff_deep_embed, c.take(model.ff_deep_embed))
    if plan.wrapper_kwargs.get("attn_pool"):  # the pool's heads are its own: nothing to permute
        src = dict(model.attn_pool.named_parameters())
        for name, dst_p in sf.attn_pool.named_parameters():
            c.put(dst_p, c.take(src[name]))


def _copy_layer(c: _Copier, plan: _Plan, sf: TransformerWrapper, k: int, lay: _Layout) -> None:
    """Layer ``k``: its norms, its layer scale, then its attention or feed-forward."""
    (pre, post_branch, _), wrapped, _ = plan.model.attn_layers.layers[k]
    block = sf.attn_layers.layers[k]
    norm, dst = block.norm, block.mixer
    w = _unwrap(wrapped, c.xt)
    blk = w.inner
    if pre is not None:
        c.copy_norm(norm, pre)
    if post_branch is not None:  # sandwich_norm: the block's norm at index 3
        c.copy_norm(block[0][1], post_branch)
    if isinstance(w.layerscale, c.xt.LayerScale):  # x-transformers' unit offset moved to ours
        c.put(block.gate.gamma, c.take(w.layerscale.gamma) + float(w.layerscale.unit_offset)
              - float(block.gate.unit_offset))
    elif w.layerscale is not None:  # use_adaptive_layerscale: sigmoid(W c + b)
        c.copy_same(block.gate.to_gamma, w.layerscale.to_gamma)
    if plan.types[k] in ("a", "c"):
        _copy_attention(c, dst, blk, plan.attn_opts[k], lay)
    else:
        _copy_feed_forward(c, dst, blk, k)


def _copy_attention(c: _Copier, dst, blk, opts: _AttnOptions, lay: _Layout) -> None:
    """One attention: its projections, its options' parameters, its per-head parameters and its gates."""
    _copy_attention_projections(c, dst, blk, lay)
    _copy_attention_options(c, dst, blk, opts, lay)
    _copy_attention_heads(c, dst, blk, opts, lay)
    _copy_gates(c, dst, blk, lay)


def _copy_attention_projections(c: _Copier, dst, blk, lay: _Layout) -> None:
    """The query (heads permuted), key, value and output projections (the identity where x-transformers has none)."""
    put, take, rows, heads, dim_head = c.put, c.take, lay.rows, lay.heads, lay.dim_head
    put(dst.to_q.weight, take(blk.to_q.weight)[rows])
    put(dst.to_k.weight, take(blk.to_k.weight))
    put(dst.to_v.weight, take(blk.to_v.weight))
    src_out = blk.to_out[0] if isinstance(blk.to_out, nn.Sequential) else blk.to_out  # attn_on_attn: its Linear
    dst_out = dst.to_out[0] if isinstance(dst.to_out, nn.Sequential) else dst.to_out
    if isinstance(src_out, nn.Linear) and dst.dim_value != dim_head:  # attn_value_dim_head: heads in x-transformers'
        put(dst_out.weight, take(src_out.weight))  # order (both libraries, tiled)
    elif isinstance(src_out, nn.Linear):  # orthog_projected_values: one copy of rows per part
        parts = src_out.in_features // (heads * dim_head)
        cols = torch.cat([rows + p * heads * dim_head for p in range(parts)])
        put(dst_out.weight, take(src_out.weight)[:, cols])
    elif isinstance(dst.to_out, nn.Identity):  # one head of width dim: no projection in either library
        if not torch.equal(rows, torch.arange(len(rows), device=rows.device)):
            raise ValueError("an attention without output projection cannot take a permutation of its heads")
    else:
        put(dst.to_out.weight, torch.eye(lay.dim, dtype=lay.ref.dtype, device=lay.ref.device)[:, rows])


def _copy_attention_options(c: _Copier, dst, blk, opts: _AttnOptions, lay: _Layout) -> None:
    """Data-dependent ALiBi, the value mix and norm, qk scales, latents, CoPE and the relative projection bias."""
    put, take, perm, heads = c.put, c.take, lay.perm, lay.heads
    if opts.dd_alibi:  # Linear(dim, heads * (1|2)): the query heads permuted within each direction
        lin, dst_lin = blk.data_dependent_alibi.to_forget_gates[0], dst.data_dependent_alibi.to_forget_gates[0]
        if lin.bias is None:  # per row: Linear(dim, 2 * heads * d), heads permuted within q and k
            d = lin.out_features // (2 * heads)
            rows = (perm[:, None] * d + torch.arange(d, device=perm.device)[None, :]).reshape(-1)
            put(dst_lin.weight, take(lin.weight)[torch.cat([rows, rows + heads * d])])
        else:
            idx = torch.cat([perm + part * heads for part in range(lin.out_features // heads)])
            put(dst_lin.weight, take(lin.weight)[idx])
            put(dst_lin.bias, take(lin.bias)[idx])
    if opts.value_mix:  # Linear(dim, heads) + sigmoid; heads == kv_heads (checked)
        lin = blk.to_value_residual_mix[0]
        put(dst.to_value_residual_mix[0].weight, take(lin.weight)[perm])
        put(dst.to_value_residual_mix[0].bias, take(lin.bias)[perm])
    if opts.value_rmsnorm:  # gamma (h, 1, d), h == h_kv (checked): kv heads are not permuted
        put(dst.value_rmsnorm.gamma, take(blk.value_rmsnorm.gamma).reshape(lay.kv_heads, 1, lay.dim_head))
    if opts.qk_rmsnorm:  # gamma (h, 1, d) per query head (permuted)
        put(dst.q_rmsnorm.gamma, take(blk.q_rmsnorm.gamma)[perm])
    if opts.qk_rmsnorm or opts.k_rmsnorm:  # gamma (h_kv, 1, d) per key head
        put(dst.k_rmsnorm.gamma, take(blk.k_rmsnorm.gamma))
    if opts.qk_dim_scale:  # (h, 1, d) per query head (permuted), (h_kv, 1, d) per key head
        put(dst.qk_norm_q_scale, take(blk.qk_norm_q_scale)[perm])
        put(dst.qk_norm_k_scale, take(blk.qk_norm_k_scale))
    for attr in ("to_latent_q", "to_latent_kv", "to_rotateable_k"):  # multi-latent attention
        if getattr(blk, attr, None) is not None:  # (latent features and key heads are not permuted)
            put(getattr(dst, attr).weight, take(getattr(blk, attr).weight))
    if getattr(blk.attend, "cope", None) is not None:  # one table shared by every head
        put(dst.cope.pos_emb, take(blk.attend.cope.pos_emb))
    if getattr(blk, "rel_proj_pos_bias", None) is not None:  # Linear(dim, heads * basis): heads permuted
        src_rel, dst_rel = blk.rel_proj_pos_bias, dst.rel_proj_pos_bias
        lin = src_rel.to_distance_weights[0]
        basis = src_rel.distance_bank.shape[0]
        idx = (perm[:, None] * basis + torch.arange(basis, device=perm.device)[None, :]).reshape(-1)
        put(dst_rel.to_distance_weights[0].weight, take(lin.weight)[idx])
        put(dst_rel.to_distance_weights[0].bias, take(lin.bias)[idx])
        put(dst_rel.distance_bank, take(src_rel.distance_bank))


def _copy_attention_heads(c: _Copier, dst, blk, opts: _AttnOptions, lay: _Layout) -> None:
    """The hybrid module, memory keys/values, the sink, talking heads and head scales (query heads permuted)."""
    put, take, perm = c.put, c.take, lay.perm
    if opts.hybrid:  # the module's parameters by name; its norms and mix per query head (not permuted:
        src_h, dst_h = blk, dst.hybrid  # grouped-query heads are refused)
        c.copy_same(dst_h.hybrid_module, src_h.hybrid_module)
        for j in range(2):
            put(dst_h.hybrid_norms[j].gamma, take(src_h.hybrid_norms[j].gamma).reshape(lay.heads, 1, lay.dim_head))
        if dst_h.hybrid_mix is not None:
            put(dst_h.hybrid_mix.weight, take(src_h.hybrid_mix.weight))
    if opts.mem_kv:  # key/value heads are not permuted
        put(dst.mem_k, take(blk.mem_k))
        put(dst.mem_v, take(blk.mem_v))
    if opts.sink:
        put(dst.head_attn_sink, take(blk.attend.head_attn_sink)[perm])
    for conv in opts.talking_heads:  # (h, h, 1, 1): rows and columns permuted with the query heads
        put(getattr(dst, conv).weight, take(getattr(blk.attend, conv).weight)[perm][:, perm])
    if opts.head_scale:  # (1, h, 1, 1), permuted with the query heads
        put(dst.head_scale_params, take(blk.head_scale_params)[:, perm])


def _copy_gates(c: _Copier, dst, blk, lay: _Layout) -> None:
    """Gate projections with the query heads permuted: per-feature outputs by ``rows``, per-head outputs by
    ``perm``, and the output gate's input (the attention output) by ``rows``."""
    put, take, perm, rows, heads, dim_head = c.put, c.take, lay.perm, lay.rows, lay.heads, lay.dim_head
    if dst.dim_value != dim_head:  # value_dim_head: the gates act on the output, heads * dim_value wide (same order)
        rows = torch.arange(heads * dst.dim_value, device=rows.device)
    for attr in ("to_v_gate", "to_output_gate"):
        src_gate, dst_gate = getattr(blk, attr, None), getattr(dst, attr)
        if src_gate is None:
            continue
        last_src = src_gate if isinstance(src_gate, nn.Linear) else src_gate.up
        last_dst = dst_gate if isinstance(dst_gate, nn.Linear) else dst_gate.up
        out_idx = perm if last_src.out_features == heads and last_src.out_features != heads * dim_head else rows
        first_src = src_gate if isinstance(src_gate, nn.Linear) else src_gate.down
        first_dst = dst_gate if isinstance(dst_gate, nn.Linear) else dst_gate.down
        if isinstance(src_gate, nn.Linear):
            w = take(src_gate.weight)[out_idx]
            put(dst_gate.weight, w[:, rows] if attr == "to_output_gate" else w)
        else:
            w_in = take(first_src.weight)
            put(first_dst.weight, w_in[:, rows] if attr == "to_output_gate" else w_in)
            put(last_dst.weight, take(last_src.weight)[out_idx])


def _copy_feed_forward(c: _Copier, dst, blk, k: int) -> None:
    """One feed-forward (layer ``k``): its projections, GLU gain and norm gains (unit offsets folded in)."""
    put, take = c.put, c.take
    info = _parse_ff(f"attn_layers.layers.{k}", blk, c.xt, _Problems(), [])
    put(dst.proj_in.weight, take(info["in"].weight))
    if dst.proj_in.bias is not None:
        put(dst.proj_in.bias, take(info["in"].bias))
    put(dst.proj_out.weight, take(info["out"].weight))
    if dst.proj_out.bias is not None:
        put(dst.proj_out.bias, take(info["out"].bias))
    if info["mult_bias"] is not None:  # ff_glu_mult_bias: the learned gain itself
        put(dst.mult_bias, take(info["mult_bias"]))
    for gain, norm in ((dst.solu_norm, info["solu"]), (dst.post_act_norm, info["post_act_ln"])):
        if norm is not None:  # a bias-free LayerNorm: its gain, the unit offset folded in
            put(gain, take(norm.gamma) + float(norm.unit_offset))


def _copy_stack_tail(c: _Copier, plan: _Plan, sf: TransformerWrapper) -> None:
    """The stack's final norm, residual routing and adaptive condition MLP."""
    layers = plan.model.attn_layers
    if type(layers.final_norm).__name__ != "Identity":
        c.copy_norm(sf.attn_layers.final_norm, layers.final_norm)
    if sf.attn_layers.routing is not None:
        _copy_routing(c, plan, sf, sf.attn_layers.routing)
    if getattr(sf.attn_layers, "adaptive_mlp", None) is not None:  # adaptive_condition_mlp
        c.copy_same(sf.attn_layers.adaptive_mlp, layers.adaptive_mlp)


def _copy_routing(c: _Copier, plan: _Plan, sf: TransformerWrapper, routing) -> None:
    """x-transformers' residual routing parameters (LIMe, U-Net skips, input reinjection, post-norms, the
    mean/variance split updates) into ``block.ResidualRouting``, layer by layer."""
    layers, put, take = plan.model.attn_layers, c.put, c.take
    stack = sf.attn_layers
    for i, ((_, _, post_main), _, residual) in enumerate(layers.layers):
        mine = stack.layers[i]
        if mine[0][2] is not None:
            c.copy_norm(mine[0][2], post_main)
        if routing.mv_split:
            c.copy_same(mine[2], residual)
        if getattr(mine[2], "residual_scale", None) is not None:  # scale_residual
            put(mine[2].residual_scale, take(residual.residual_scale))
        if getattr(mine[2], "gru", None) is not None:  # gate_residual
            c.copy_same(mine[2].gru, residual.gru)
        if routing.integrators is not None:
            lime_norm, lime_linear = layers.layer_integrators[i].to_weights[:2]
            weight, _, names = _norm_weights(lime_norm, c.xt)
            c.used.update(id(getattr(lime_norm, n)) for n in names)
            dst_norm = stack.layer_integrators[i].to_weights[0]
            put(dst_norm.g, weight - float(dst_norm.unit_offset))
            c.copy_same(stack.layer_integrators[i].to_weights[1], lime_linear)
        src_skip = layers.skip_combines[i]
        dst_skip = stack.skip_combines[i]
        if (src_skip is None) != (dst_skip is None) or (
                dst_skip is not None and dst_skip.prev_layer_ind != src_skip.prev_layer_ind):
            plan.problems.add(f"unet_skips paired differently at layer {i}")
        elif dst_skip is not None:
            c.copy_same(dst_skip.combine, src_skip.combine)
    for attr in ("reinject_input_proj", "learned_reinject_input_gate"):
        if getattr(stack, attr) is not None:
            c.copy_same(getattr(stack, attr), getattr(layers, attr))
