"""x-transformers' residual options ``attn_aggregated_residuals`` (``AttentionResidual``: each block's input attends,
per token, over the inputs of every block so far) and ``gated_multi_residual`` (``GatedMultiResidual``: S residual
streams read through an elementwise gate, written through a per-stream gate) on ``AttentionLayers``.

The math is checked against x-transformers itself on copied (perturbed) weights, strict state-dict loads both ways,
outputs at the real positions of a right-padded batch and gradients (float32); safety by a padded sample equal to
the sample alone with NaN planted at every padded position, the KV cache and greedy generation equal to the full
forward, and clear refusals of what x-transformers asserts against, ignores or fails on.

Shape legend: b batch, n positions, c model width, S residual streams, L hiddens so far, V input views.
"""

from __future__ import annotations

import pytest
import torch
import x_transformers as xt
import x_transformers.x_transformers as xt_mod
from einops import rearrange
from helpers import check_padded_equals_alone, perturb_params

import safeformer as sf
from safeformer.decoding.static import static_reason
from safeformer.nn import block as sf_block

DIM, HEADS, DIM_HEAD, VOCAB = 16, 2, 8, 30
pytestmark = pytest.mark.usefixtures("one_thread")

AGG = dict(attn_aggregated_residuals=True, attn_aggregated_residual_kwargs=dict(lora_rank=4))
GATED = dict(gated_multi_residual=True, num_residual_streams=2, residual_fn_kwargs=dict(read_gate_rank=4))

CASES = [
    dict(depth=2, **AGG),
    dict(depth=2, attn_aggregated_residuals=True, qkv_receive_diff_residuals=True,
         attn_aggregated_residual_kwargs=dict(lora_rank=5, lora_activation=torch.nn.SiLU())),
    dict(depth=3, attn_aggregated_residuals=True, attn_aggregated_residual_kwargs=dict(lora_rank=3),
         scale_residual=True, scale_residual_constant=0.8, unet_skips=True),
    dict(depth=2, layers_execute_order=(0, 1, 0, 1, 2, 3), **AGG),
    dict(depth=2, cross_attend=True, causal=False, **AGG),
    dict(depth=2, **GATED),
    dict(depth=2, gated_multi_residual=True, residual_fn_kwargs=dict(read_gate_rank=3)),  # one stream
    dict(depth=2, gated_multi_residual=True, num_residual_streams=3, qkv_receive_diff_residuals=True,
         residual_fn_kwargs=dict(read_gate_rank=4)),
    dict(depth=2, integrate_layers=True, **GATED),
    dict(depth=2, cross_attend=True, pre_and_post_norm=True, use_rmsnorm=True, **GATED),
    dict(depth=2, gated_multi_residual=True, use_adaptive_layernorm=True, dim_condition=6,
         residual_fn_kwargs=dict(read_gate_rank=4)),
]


def _ids(c: dict) -> str:
    return ",".join(k for k in c if k not in ("depth", "attn_aggregated_residual_kwargs", "residual_fn_kwargs"))


def _pair(opts: dict, seed: int = 0):
    """``(ours, peer)``: x-transformers' stack with ``opts`` (weights perturbed), safeformer's loaded from it strictly;
    and x-transformers' loaded back from safeformer's state dict strictly."""
    opts = dict(opts)
    causal = opts.pop("causal", True)
    ctx = dict(cross_attn_dim_context=12) if opts.get("cross_attend") else {}
    torch.manual_seed(seed)
    peer_cls, cls = (xt.Decoder, sf.Decoder) if causal else (xt.Encoder, sf.Encoder)
    peer = perturb_params(peer_cls(dim=DIM, heads=HEADS, attn_dim_head=DIM_HEAD, **opts, **ctx), seed).eval()
    ours = cls(dim=DIM, heads=HEADS, dim_head=DIM_HEAD, **opts, **ctx).eval()
    assert set(ours.state_dict()) == set(peer.state_dict())
    ours.load_state_dict(peer.state_dict(), strict=True)
    peer.load_state_dict(ours.state_dict(), strict=True)
    return ours, peer


@pytest.mark.parametrize("opts", CASES, ids=_ids)
def test_matches_x_transformers_on_copied_weights_with_gradients(opts):
    """The same hidden states as x-transformers at the real positions of a right-padded batch (a padded context
    where there is cross-attention, a condition where the norms are adaptive), and the same gradients of a loss on
    them, for the input and every parameter."""
    ours, peer = _pair(opts)
    torch.manual_seed(1)
    x = torch.randn(2, 7, DIM)
    mask = torch.tensor([[True] * 7, [True] * 5 + [False] * 2])
    kw = dict(mask=mask)
    if opts.get("cross_attend"):
        kw.update(context=torch.randn(2, 3, 12), context_mask=torch.tensor([[True, True, True], [True, False, True]]))
    if opts.get("use_adaptive_layernorm"):
        kw.update(condition=torch.randn(2, 6))
    weight = torch.randn(2, 7, DIM)
    grads = []
    for model in (ours, peer):
        model.zero_grad()
        xi = x.clone().requires_grad_()
        out = model(xi, **kw)
        (out[mask] * weight[mask]).sum().backward()
        grads.append((out.detach(), xi.grad, {n: p.grad for n, p in model.named_parameters()}))
    (o1, g1, p1), (o2, g2, p2) = grads
    torch.testing.assert_close(o1[mask], o2[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g1[mask], g2[mask], atol=1e-5, rtol=1e-5)
    assert set(p1) == set(p2)
    for name in p1:
        if p2[name] is None:
            assert p1[name] is None or not p1[name].any(), name
        else:
            torch.testing.assert_close(p1[name], p2[name], atol=1e-5, rtol=1e-4, msg=name)


def test_module_tree_and_layer_hiddens_are_x_transformers():
    """The residual modules sit where x-transformers keeps them (``layer_integrators[i]``, ``layers[i][2]``), named
    as there and exported from ``safeformer.nn.block``; ``return_hiddens``' ``layer_hiddens`` (every block's input
    before the mixing, then the stream(s) before the final norm) equal x-transformers'."""
    assert {"AttentionResidual", "GatedMultiResidual"} <= set(sf_block.__all__)
    for opts, kind in ((CASES[0], "AttentionResidual"), (CASES[5], "GatedMultiResidual")):
        ours, peer = _pair(opts, seed=2)
        where = "layer_integrators" if kind == "AttentionResidual" else "layers"
        mods = [m if where == "layer_integrators" else m[2] for m in getattr(ours, where)]
        peer_mods = [m if where == "layer_integrators" else m[2] for m in getattr(peer, where)]
        assert [type(m).__name__ for m in mods] == [type(m).__name__ for m in peer_mods] == [kind] * len(mods)
        if kind == "GatedMultiResidual":  # its read gate normalises: no pre-norm, a post-norm, the final norm
            assert all(blk[0][0] is None and blk[0][2] is not None for blk in ours.layers)
            assert not isinstance(ours.final_norm, torch.nn.Identity)
        x = torch.randn(2, 5, DIM)
        with torch.no_grad():
            _, inter = ours(x, return_hiddens=True)
            _, peer_inter = peer(x, return_hiddens=True)
        assert len(inter.layer_hiddens) == len(peer_inter.layer_hiddens)
        for h, h_peer in zip(inter.layer_hiddens, peer_inter.layer_hiddens):
            torch.testing.assert_close(h, h_peer, atol=1e-5, rtol=1e-5)


def test_the_modules_alone_equal_x_transformers():
    """``AttentionResidual`` with x-transformers' three call forms (hiddens; x, hiddens; hiddens=), views included,
    and ``GatedMultiResidual``'s ``prepare`` / ``forward`` (safeformer keeps the streams as ``(b, n, S, c)`` where
    x-transformers folds them into the batch), on the same perturbed weights."""
    torch.manual_seed(0)
    for views in (1, 3):
        peer = perturb_params(xt_mod.AttentionResidual(DIM, num_views=views, lora_rank=4), 5)
        ours = sf_block.AttentionResidual(DIM, num_views=views, lora_rank=4)
        ours.load_state_dict(peer.state_dict(), strict=True)
        hiddens = [torch.randn(2, 5, DIM) for _ in range(3)]
        want = peer(hiddens)
        assert want.shape == ((views, 2, 5, DIM) if views > 1 else (2, 5, DIM))
        for got in (ours(hiddens), ours(hiddens[-1], hiddens), ours(hiddens=torch.stack(hiddens))):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for s, views in ((1, 1), (3, 1), (2, 3)):
        peer = perturb_params(xt_mod.GatedMultiResidual(DIM, layer_index=1, num_residual_streams=s,
                                                        num_input_views=views, read_gate_rank=4), 6)
        ours = sf_block.GatedMultiResidual(DIM, layer_index=1, num_residual_streams=s, num_input_views=views,
                                           read_gate_rank=4)
        ours.load_state_dict(peer.state_dict(), strict=True)
        streams, out = torch.randn(2, 5, s, DIM), torch.randn(2, 5, DIM)
        branch_peer, res_peer, kw = peer.prepare(rearrange(streams, "b n s d -> (b s) n d"))
        branch, res, beta = ours.prepare(streams)
        torch.testing.assert_close(branch, branch_peer, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(beta, kw["beta"], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(rearrange(ours(out, res, beta), "b n s d -> (b s) n d"),
                                   peer(out, res_peer, **kw), atol=1e-6, rtol=1e-5)


SAFE = [dict(depth=2, **AGG), dict(depth=2, qkv_receive_diff_residuals=True, **AGG), dict(depth=2, **GATED),
        dict(depth=2, gated_multi_residual=True, residual_fn_kwargs=dict(read_gate_rank=3))]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("opts", SAFE, ids=_ids)
def test_padded_sample_equals_alone_and_planted_nan_reaches_nothing(opts, causal):
    """Left, inner and right padding, a fully padded sample, NaN at every padded position: each sample's real
    outputs equal the sample alone; outputs and gradients finite, padded positions exactly 0 with no gradient."""
    stack = perturb_params(sf.AttentionLayers(dim=DIM, heads=HEADS, dim_head=DIM_HEAD, causal=causal,
                                              rotary_pos_emb=True, **opts), 1).eval()
    mask = torch.tensor([[False, False] + [True] * 5, [True, True, False, True, True, False, False], [False] * 7])
    check_padded_equals_alone(stack, DIM, mask)


@pytest.mark.parametrize("opts", SAFE, ids=_ids)
def test_kv_cache_and_greedy_generation_equal_the_full_forward(opts):
    """Both options are per token: one position at a time from the KV cache (left-padded prompt) equals the whole
    sequence at once, and greedy generation with the cache (the decode step runs them) equals it without."""
    stack = perturb_params(sf.Decoder(dim=DIM, heads=HEADS, dim_head=DIM_HEAD, rotary_pos_emb=True, **opts), 2).eval()
    assert stack.can_cache_kv
    torch.manual_seed(4)
    x = torch.randn(2, 6, DIM)
    mask = torch.tensor([[False, True, True, True, True, True], [True] * 6])
    with torch.no_grad():
        full = stack(x, mask=mask)
        out, cache = stack(x[:, :3], mask=mask[:, :3], return_cache=True)
        outs = [out]
        for t in range(3, 6):
            out, cache = stack(x[:, t: t + 1], mask=mask[:, t: t + 1], cache=cache, return_cache=True)
            outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-5, rtol=1e-5)
    net = perturb_params(sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, attn_layers=sf.Decoder(
        dim=DIM, depth=2, heads=HEADS, attn_dim_head=DIM_HEAD, **{k: v for k, v in opts.items() if k != "depth"})),
        3).eval()
    assert static_reason(net) is None  # per token: the decode step runs them (separate q/k/v inputs too)
    wrapper = sf.AutoregressiveWrapper(net)
    prompt = torch.randint(0, VOCAB, (2, 4))
    cached = wrapper.generate(prompt, 6, temperature=0.0, cache_kv=True)
    uncached = wrapper.generate(prompt, 6, temperature=0.0, cache_kv=False)
    assert torch.equal(cached, uncached)


# (options, what the error names, whether x-transformers 2.31.10 asserts against them too)
REFUSED = [
    (dict(**AGG, gated_multi_residual=True, residual_fn_kwargs=dict(read_gate_rank=4)), "mutually exclusive", True),
    (dict(**AGG, gate_residual=True), "mutually exclusive", True),
    (dict(**AGG, orthog_residual=True), "mutually exclusive", True),
    (dict(**GATED, mv_split_residual=True), "mutually exclusive", True),
    (dict(**GATED, sandwich_norm=True), "sandwich_norm", True),
    (dict(**GATED, use_dynamic_tanh=True), "use_dynamic_tanh", True),
    (dict(gated_multi_residual=True, num_residual_streams=2), "read_gate_rank", True),
    (dict(**AGG, integrate_layers=True), "integrate_layers", False),  # x-transformers ignores AGG there
    (dict(**AGG, num_residual_streams=2, qkv_receive_diff_residuals=True), "different shapes", True),
    (dict(**AGG, scale_residual=0.5), "scale_residual", False),
    (dict(**AGG, depth_scale_residual=0.5), "depth_scale_residual", False),
    (dict(**GATED, scale_residual=True), "scale_residual", False),
    (dict(**GATED, pre_norm_has_final_norm=False), "pre_norm_has_final_norm", False),
    (dict(**GATED, use_adaptive_rmsnorm=True), "num_residual_streams > 1", False),
    (dict(attn_aggregated_residuals=True), "lora_rank", True),  # x-transformers' default rank 64 >= dim
    (dict(attn_aggregated_residuals=True, attn_aggregated_residual_kwargs=dict(lora_rank=0)), "lora_rank", False),
    (dict(attn_aggregated_residual_kwargs=dict(lora_rank=4)), "attn_aggregated_residuals", False),
    (dict(gated_multi_residual=True, residual_fn_kwargs=dict(read_gate_rank=4, learned=True)), "residual_fn_kwargs",
     False),
    (dict(num_residual_streams=2, residual_fn_kwargs=dict(read_gate_rank=4)), "residual_fn_kwargs", False),
]


@pytest.mark.parametrize("opts,match,xt_asserts", REFUSED, ids=[m for _, m, _ in REFUSED])
def test_contradictions_are_refused_by_name(opts, match, xt_asserts):
    """What x-transformers asserts against is a ``ValueError`` naming the options here (and x-transformers does
    fail on it); what it would silently ignore (or break on later) is refused too."""
    with pytest.raises(ValueError, match=match):
        sf.Decoder(dim=DIM, depth=2, heads=HEADS, **opts)
    if xt_asserts:
        with pytest.raises((AssertionError, RuntimeError, ValueError, TypeError)):
            peer = xt.Decoder(dim=DIM, depth=2, heads=HEADS, **opts)
            peer(torch.randn(1, 3, DIM))


def test_bad_values_are_type_errors_naming_the_keyword():
    for opts, match in ((dict(attn_aggregated_residuals=1), "attn_aggregated_residuals"),
                        (dict(gated_multi_residual="yes"), "gated_multi_residual"),
                        (dict(attn_aggregated_residuals=True, attn_aggregated_residual_kwargs=dict(rank=4)),
                         "attn_aggregated_residual_kwargs"),
                        (dict(attn_aggregated_residuals=True, attn_aggregated_residual_kwargs=[("lora_rank", 4)]),
                         "attn_aggregated_residual_kwargs"),
                        (dict(attn_aggregated_residuals=True,
                              attn_aggregated_residual_kwargs=dict(lora_rank=4, lora_activation="silu")),
                         "lora_activation")):
        with pytest.raises(TypeError, match=match):
            sf.Decoder(dim=DIM, depth=2, heads=HEADS, **opts)
    with pytest.raises(ValueError, match="unpadded=True"):
        sf.Decoder(dim=DIM, depth=2, heads=HEADS, unpadded=True, **AGG)


# ---------------------------------------------------------------------------------------------------------------
# AttentionLayers.forward's attn_bias and transform_block_inputs
# ---------------------------------------------------------------------------------------------------------------

CALL_CASES = [dict(depth=2), dict(depth=2, attn_num_mem_kv=2, causal=False), dict(depth=2, **GATED),
              dict(depth=2, attn_use_rel_proj_pos_bias=True)]


@pytest.mark.parametrize("opts", CALL_CASES, ids=lambda c: _ids(c) or "plain")
def test_attn_bias_and_block_input_hook_match_x_transformers(opts):
    """x-transformers' ``attn_bias`` (every self-attention's additive bias, of any broadcastable shape) and
    ``transform_block_inputs`` (a callable of the depth or a dict per depth; the streams apart as ``(b S, n, c)``)
    give x-transformers' hidden states and input gradients at the real positions of a right-padded batch (float64:
    the hooks and biases here amplify float32 rounding past 1e-5)."""
    opts = dict(opts)
    bias_ok = not opts.get("attn_num_mem_kv")  # x-transformers does not pad a given bias for memory keys
    ours, peer = (m.double() for m in _pair(opts, seed=4))
    torch.manual_seed(5)
    f64 = dict(dtype=torch.float64)
    x = torch.randn(2, 7, DIM, **f64)
    mask = torch.tensor([[True] * 7, [True] * 5 + [False] * 2])
    s = opts.get("num_residual_streams", 1)
    mix = torch.randn(2 * s, 7, DIM, **f64)
    calls = [dict(transform_block_inputs={2: lambda t: t * 1.5 + mix}),
             dict(transform_block_inputs=lambda depth, t: torch.tanh(t) * depth)]
    if bias_ok:
        calls += [dict(attn_bias=torch.randn(2, HEADS, 7, 7, **f64)), dict(attn_bias=torch.randn(7, 7, **f64)),
                  dict(attn_bias=torch.randn(HEADS, 7, 7, **f64), transform_block_inputs={2: torch.sin})]
    weight = torch.randn(2, 7, DIM, **f64)
    for kw in calls:
        res = []
        for model in (ours, peer):
            xi = x.clone().requires_grad_()
            out = model(xi, mask=mask, **kw)
            (out[mask] * weight[mask]).sum().backward()
            res.append((out.detach()[mask], xi.grad[mask]))
        torch.testing.assert_close(res[0], res[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_attn_bias_nan_at_masked_slots_reaches_nothing_and_a_minus_inf_row_is_dead(causal):
    """NaN in the bias wherever a query may not attend (padded queries and keys; future keys in a causal stack) and
    NaN in padded inputs: outputs and gradients (of the input and of the bias) finite, the bias' masked slots get
    no gradient, each sample equals itself alone (its bias sliced). A row whose bias is ``-inf`` everywhere is a
    dead row: exactly 0 attention, finite (x-transformers gives NaN there). The KV cache continues with the bias's
    rows of the new positions."""
    stack = perturb_params(sf.AttentionLayers(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, causal=causal,
                                              rotary_pos_emb=True, attn_num_mem_kv=1), 6).eval()
    mask = torch.tensor([[False, True, True, True, True, True], [True, True, False, True, False, False], [False] * 6])
    torch.manual_seed(7)
    x = torch.where(mask[..., None], torch.randn(3, 6, DIM), float("nan")).requires_grad_()
    hidden = ~(mask[:, None, :, None] & mask[:, None, None, :])
    if causal:
        hidden = hidden | ~torch.ones(6, 6, dtype=torch.bool).tril()
    hidden = hidden.expand(3, HEADS, 6, 6)
    bias = torch.where(hidden, float("nan"), torch.randn(3, HEADS, 6, 6)).requires_grad_()
    out = stack(x, mask=mask, attn_bias=bias)
    (out * torch.randn_like(out)).sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all() and torch.isfinite(bias.grad).all()
    assert (bias.grad[hidden] == 0).all() and (out[~mask] == 0).all()
    with torch.no_grad():
        for s in range(2):
            r = mask[s]
            alone = stack(x[s: s + 1, r].detach(), attn_bias=bias[s: s + 1][:, :, r][:, :, :, r].detach())
            torch.testing.assert_close(out[s, r].detach(), alone[0], atol=1e-5, rtol=1e-5)
    enc = sf.Encoder(dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD)
    xi = torch.randn(1, 4, DIM, requires_grad=True)
    dead = torch.zeros(1, 1, 4, 4)
    dead[..., 1, :] = float("-inf")
    _, inter = enc(xi, attn_bias=dead, return_hiddens=True)
    assert (inter.attn_intermediates[0].post_softmax_attn[:, :, 1] == 0).all()
    out = enc(xi, attn_bias=dead)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(xi.grad).all()
    if causal:
        dec = perturb_params(sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, rotary_pos_emb=True), 8)
        xs, b = torch.randn(2, 6, DIM), torch.randn(2, HEADS, 6, 6)
        with torch.no_grad():
            full = dec(xs, attn_bias=b)
            step, cache = dec(xs[:, :3], attn_bias=b[:, :, :3, :3], return_cache=True)
            outs = [step]
            for t in range(3, 6):
                step, cache = dec(xs[:, t: t + 1], attn_bias=b[:, :, t: t + 1, : t + 1], cache=cache,
                                  return_cache=True)
                outs.append(step)
        torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-5, rtol=1e-5)


def test_block_input_hook_sees_no_padding_and_bad_call_values_are_refused_by_name():
    """The hook sees padded positions as exact zeros and whatever it writes there (NaN) reaches nothing; bad values
    of both keywords and the options x-transformers asserts against (or drops the bias for) are refused by name."""
    stack = sf.Decoder(dim=DIM, depth=3, heads=HEADS, dim_head=DIM_HEAD)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    x = torch.where(mask[..., None], torch.randn(2, 5, DIM), float("nan"))
    seen = []

    def hook(depth, t):
        seen.append(depth)
        assert (t[~mask] == 0).all()
        return torch.where(mask[..., None], t + 0.5, float("nan"))

    out = stack(x, mask=mask, transform_block_inputs=hook)
    assert seen == [2, 3] and torch.isfinite(out).all() and (out[~mask] == 0).all()
    alone = stack(x[1:, :3], transform_block_inputs=lambda d, t: t + 0.5)
    torch.testing.assert_close(out[1, :3], alone[0], atol=1e-5, rtol=1e-5)
    for kw, err, match in ((dict(attn_bias=torch.ones(2, 5, 5, dtype=torch.bool)), TypeError, "attn_bias"),
                           (dict(attn_bias=torch.randn(2, 3, 5, 5)), ValueError, "attn_bias"),
                           (dict(attn_bias=torch.randn(5, 4)), ValueError, "attn_bias"),
                           (dict(transform_block_inputs={"2": torch.sin}), TypeError, "transform_block_inputs"),
                           (dict(transform_block_inputs=3), TypeError, "transform_block_inputs"),
                           (dict(transform_block_inputs={2: lambda t: t[:, :2]}), ValueError,
                            "transform_block_inputs")):
        with pytest.raises(err, match=match):
            stack(torch.randn(2, 5, DIM), **kw)
    for opts in (dict(alibi_pos_bias=True), dict(rel_pos_bias=True), dict(attn_data_dependent_alibi=True)):
        with pytest.raises(ValueError, match="attn_bias"):
            sf.Decoder(dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD, **opts)(
                torch.randn(1, 3, DIM), attn_bias=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="attn_bias"):
        sf.CrossAttender(dim=DIM, depth=1, heads=HEADS)(torch.randn(1, 3, DIM), context=torch.randn(1, 2, DIM),
                                                       attn_bias=torch.zeros(3, 2))
