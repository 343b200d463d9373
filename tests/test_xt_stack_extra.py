"""x-transformers' layer-pattern and residual-path options of ``AttentionLayers``: ``custom_layers``, ``par_ratio``,
``sandwich_coef``, ``macaron``, ``only_attn``, ``weight_tie_layers``, ``layers_execute_order`` (constructor),
``sandwich_norm``, ``pre_norm=False``, ``scale_residual`` / ``scale_residual_constant``, ``depth_scale_residual``,
``gate_residual``, ``use_layerscale``, ``zero_init_branch_output``, ``softclamp_output``, ``shift_tokens``.

The math is checked against x-transformers itself on copied weights (float32); safety by a padded sample equal to
the sample alone with NaN planted at every padded position, the KV cache / unpadded path / static decode step
equal to the padded forward where the option runs there, and clear refusals where it does not.

Shape legend: b batch, n positions, c model width.
"""

from __future__ import annotations

import pytest
import torch
import x_transformers as xt
import x_transformers.x_transformers as xt_mod
from helpers import check_padded_equals_alone, perturb_params

import safeformer as sf
from safeformer.decoding.static import build_static_cache, static_reason

DIM, HEADS, DIM_HEAD, VOCAB = 16, 2, 8, 40


pytestmark = pytest.mark.usefixtures("one_thread")
_perturb = perturb_params


def _unwrap(layer):
    """x-transformers' branch module without its wrappers: ``(Attention or FeedForward, LayerScale or None)``."""
    scale = None
    while True:
        if isinstance(layer, xt_mod.LayerScale):
            scale, layer = layer, layer.fn
        elif isinstance(layer, (xt_mod.Scale, xt_mod.ShiftTokens)):
            layer = layer.fn
        else:
            return layer, scale


def _copy(ours: sf.AttentionLayers, peer) -> None:
    """x-transformers' weights (its ``AttentionLayers`` ``peer``) into ``ours``: the state dict, strictly."""
    assert tuple(peer.layer_types) == ours.layer_types
    ours.load_state_dict(peer.state_dict(), strict=True)


def _pair(opts: dict, causal: bool = True, seed: int = 0):
    """``(ours, peer)``: x-transformers' stack with ``opts`` (weights perturbed), safeformer's on the same weights."""
    opts = dict(opts)
    torch.manual_seed(seed)
    ctx = 12 if opts.get("cross_attend") else None
    peer_cls, cls = (xt.Decoder, sf.Decoder) if causal else (xt.Encoder, sf.Encoder)
    peer = _perturb(peer_cls(dim=DIM, heads=HEADS, attn_dim_head=DIM_HEAD, **opts,
                             **({"cross_attn_dim_context": ctx} if ctx else {})), seed).eval()
    ours = cls(dim=DIM, heads=HEADS, dim_head=DIM_HEAD, dim_context=ctx, **opts).eval()
    _copy(ours, peer)
    return ours, peer


XT_CASES = [
    dict(custom_layers=("a", "f", "a", "a", "f")),
    dict(custom_layers=("a", "c", "f", "c", "f"), cross_attend=True),
    dict(depth=3, par_ratio=2),
    dict(depth=3, sandwich_coef=1),
    dict(depth=2, macaron=True),
    dict(depth=3, weight_tie_layers=True),
    dict(depth=2, layers_execute_order=(0, 1, 0, 1, 2, 3)),
    dict(depth=2, only_attn=True, cross_attend=True),
    dict(depth=2, sandwich_norm=True, use_layerscale=True, layerscale_init_value=0.1),
    dict(depth=2, pre_norm=False),
    dict(depth=2, scale_residual=True, scale_residual_constant=0.7, softclamp_output=True, softclamp_output_value=2.0),
    dict(depth=2, scale_residual=0.5),
    dict(depth=2, depth_scale_residual=0.5, macaron=True),
    dict(depth=2, gate_residual=True, scale_residual=True),
    dict(depth=2, shift_tokens=1),
    dict(depth=2, shift_tokens=(2, 0, 1, 0), causal=False),
    dict(depth=3, residual_attn=True, alibi_pos_bias=True),
    dict(depth=2, residual_attn=True, cross_residual_attn=True, cross_attend=True, causal=False),
]


def _ids(c: dict) -> str:
    return ",".join(k for k in c if k not in ("depth", "causal"))


@pytest.mark.parametrize("opts", XT_CASES, ids=_ids)
def test_matches_x_transformers_on_copied_weights(opts):
    """The same hidden states as x-transformers (float32, every weight perturbed), without padding and with right
    padding (real positions), with a padded context where there is cross-attention."""
    opts = dict(opts)
    causal = opts.pop("causal", True)
    ours, peer = _pair(opts, causal)
    x = torch.randn(2, 7, DIM)
    mask = torch.tensor([[True] * 7, [True] * 5 + [False] * 2])
    ctx = dict(context=torch.randn(2, 3, 12)) if opts.get("cross_attend") else {}
    cmask = torch.tensor([[True, True, True], [True, False, True]])
    with torch.no_grad():
        torch.testing.assert_close(ours(x, **ctx), peer(x, **ctx), atol=1e-5, rtol=1e-5)
        ctx_m = dict(ctx, context_mask=cmask) if ctx else {}
        got, want = ours(x, mask=mask, **ctx_m), peer(x, mask=mask, **ctx_m)
        torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)


def test_layer_patterns_and_inits_match_x_transformers():
    """The block layouts are x-transformers' (``layer_types``, ``layers_execute_order``), and so are ``return_hiddens``'
    hiddens with them; the output projections' inits: zero (``zero_init_branch_output``), depth-scaled
    (``depth_scale_residual=True``)."""
    for opts in (dict(depth=6, par_ratio=4), dict(depth=5, par_ratio=3, cross_attend=True), dict(depth=4, sandwich_coef=2),
                 dict(depth=3, macaron=True, cross_attend=True), dict(depth=2, only_attn=True, macaron=True),
                 dict(depth=3, weight_tie_layers=True, cross_attend=True)):
        ours, peer = sf.Decoder(dim=DIM, heads=HEADS, **opts), xt.Decoder(dim=DIM, heads=HEADS, **opts)
        assert ours.layer_types == tuple(peer.layer_types), opts
        assert ours.layers_execute_order == tuple(peer.layers_execute_order), opts
    ours, peer = _pair(dict(depth=2, macaron=True, cross_attend=True))  # hiddens: the stream entering each self-attention
    x, ctx = torch.randn(1, 5, DIM), torch.randn(1, 3, 12)
    with torch.no_grad():
        got, want = ours(x, context=ctx, return_hiddens=True)[1], peer(x, context=ctx, return_hiddens=True)[1]
    assert len(got.hiddens) == len(want.hiddens) == 2 and len(got.layer_hiddens) == len(want.layer_hiddens)
    for a, b in zip(got.hiddens + got.layer_hiddens, want.hiddens + want.layer_hiddens):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    stack = sf.Decoder(dim=DIM, depth=2, heads=HEADS, zero_init_branch_output=True)
    assert all((blk.mixer.to_out.weight == 0).all() if blk.kind != "ff" else (blk.mixer.proj_out.weight == 0).all()
               and (blk.mixer.proj_out.bias == 0).all() for blk in stack.layers)
    torch.manual_seed(0)
    stack = sf.Decoder(dim=64, depth=3, heads=4, dim_head=16, ff_mult=8, depth_scale_residual=True)
    for ind, blk in enumerate(stack.layers):
        proj = blk.mixer.proj_out if blk.kind == "ff" else blk.mixer.to_out
        want = (2 * proj.in_features * (ind // 2 + 1)) ** -0.5
        assert abs(proj.weight.std().item() / want - 1) < 0.1, (ind, proj.weight.std().item(), want)
        assert blk.scale == 1.0


SAFE_CASES = [
    dict(custom_layers=("a", "a", "f", "a", "f")),
    dict(depth=3, sandwich_coef=1, macaron=True, sandwich_norm=True, use_layerscale=True, layerscale_init_value=0.5),
    dict(depth=2, weight_tie_layers=True, scale_residual=0.5),
    dict(depth=2, pre_norm=False, gate_residual=True, scale_residual=True),
    dict(depth=2, scale_residual=True, scale_residual_constant=0.8, softclamp_output=True, softclamp_output_value=3.0),
    dict(depth=2, shift_tokens=2, only_attn=True),
    dict(depth=2, shift_tokens=(1, 0, 2, 1, 0, 1), macaron=True, depth_scale_residual=0.7),
    dict(depth=3, residual_attn=True, attn_num_mem_kv=2),
]


def _stack(opts: dict, causal: bool = True, seed: int = 2, cross: bool = False, **extra):
    torch.manual_seed(seed)
    cls = sf.Decoder if causal else sf.Encoder
    ctx = dict(cross_attend=True, dim_context=12) if cross else {}
    return _perturb(cls(dim=DIM, heads=HEADS, dim_head=DIM_HEAD, rotary_pos_emb=True, **ctx, **opts, **extra),
                    seed, 0.2).eval()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("opts", SAFE_CASES, ids=_ids)
def test_padded_sample_equals_alone_and_planted_nan_reaches_nothing(opts, causal):
    """Left, inner and right padding, a fully padded sample, NaN at every padded position: each sample's real outputs
    equal the sample alone; outputs and gradients finite, padded positions exactly 0 with no gradient."""
    mask = torch.tensor([[False, False] + [True] * 5, [True, True, False, True, True, False, False], [False] * 7])
    check_padded_equals_alone(_stack(opts, causal), DIM, mask)


CACHED = [c for c in SAFE_CASES if not c.get("shift_tokens")] + [dict(depth=2, layers_execute_order=(0, 1, 2, 0, 1, 2, 3, 4, 5)),
    dict(depth=2, residual_attn=True, cross_residual_attn=True)]


@pytest.mark.parametrize("opts", CACHED, ids=_ids)
def test_kv_cache_decodes_as_the_full_forward(opts):
    """Per-token options continue from the KV cache: one position at a time (left-padded prompt, a padded context)
    equals the whole sequence at once."""
    layers = opts.get("custom_layers")
    extra = dict(custom_layers=tuple(t for c in layers for t in (("c", c) if c == "f" else (c,)))) if layers else {}
    model = _stack({**opts, **extra}, causal=True, cross=True)
    torch.manual_seed(4)
    x, ctx = torch.randn(2, 6, DIM), torch.randn(2, 3, 12)
    mask = torch.tensor([[False, True, True, True, True, True], [True] * 6])
    cmask = torch.tensor([[True, True, False], [False, False, False]])
    with torch.no_grad():
        full = model(x, mask=mask, context=ctx, context_mask=cmask)
        out, cache = model(x[:, :3], mask=mask[:, :3], context=ctx, context_mask=cmask, return_cache=True)
        outs = [out]
        for t in range(3, 6):
            out, cache = model(x[:, t: t + 1], mask=mask[:, t: t + 1], cache=cache, return_cache=True)
            outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-5, rtol=1e-5)


BLOCK_SIDE = [dict(custom_layers=("a", "a", "f", "a", "f")),
              dict(depth=3, sandwich_coef=1, macaron=True, sandwich_norm=True, use_layerscale=True,
                   layerscale_init_value=0.5, depth_scale_residual=0.7),
              dict(depth=4, par_ratio=2, only_attn=False)]


@pytest.mark.parametrize("opts", BLOCK_SIDE, ids=_ids)
def test_block_side_options_run_unpadded_and_on_the_static_step(opts):
    """Layouts, macaron, sandwich norm, layerscale and float scales run per block: the unpadded path equals the
    padded one, and the static decode step equals the dynamic cache (float64)."""
    padded, packed = _stack(opts, unpadded=False), _stack(opts, unpadded=True)
    x = torch.randn(3, 6, DIM)
    mask = torch.tensor([[False, True, True, True, True, True], [True] * 3 + [False] * 3, [True] * 6])
    with torch.no_grad():
        torch.testing.assert_close(packed(x, mask=mask), padded(x, mask=mask), atol=1e-5, rtol=1e-5)
    torch.manual_seed(6)
    net = _perturb(sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, attn_layers=sf.Decoder(
        dim=DIM, heads=HEADS, dim_head=DIM_HEAD, rotary_pos_emb=True, **opts)), 6, 0.2).eval().double()
    assert static_reason(net) is None
    prompts = torch.randint(0, VOCAB, (2, 4))
    feed = torch.randint(0, VOCAB, (2, 3))
    with torch.no_grad():
        _, cache = net(prompts, return_cache=True)
        dyn, c = [], cache
        for t in range(3):
            lg, c = net(feed[:, t: t + 1], cache=c, return_cache=True)
            dyn.append(lg[:, -1])
        static = build_static_cache(net, cache, cache.length + 3)
        stat = [net(feed[:, t: t + 1], cache=static)[:, -1] for t in range(3)]
    torch.testing.assert_close(torch.stack(stat, 1), torch.stack(dyn, 1), atol=1e-10, rtol=1e-10)


def test_what_cannot_run_is_refused_or_falls_back():
    """Token shifts refuse a KV cache (and so the decode step); they and repeated blocks refuse ``unpadded=True``; the
    residual options refuse ``unpadded=True``; contradictory options are refused by name."""
    for opts in (dict(weight_tie_layers=True), dict(layers_execute_order=(0, 1, 0, 1)), dict(shift_tokens=1)):
        stack = sf.Decoder(dim=DIM, depth=2, heads=HEADS, **opts)
        shift = "shift_tokens" in opts
        assert stack.can_cache_kv != shift and not stack.packable
        if shift:
            with pytest.raises(ValueError, match="KV cache"):
                stack(torch.randn(1, 3, DIM), return_cache=True)
        with pytest.raises(ValueError, match="unpadded=True"):
            sf.Decoder(dim=DIM, depth=2, heads=HEADS, unpadded=True, **opts)
        net = sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=16, attn_layers=sf.Decoder(
            dim=DIM, depth=2, heads=HEADS, **opts))
        assert (static_reason(net) is not None) == shift and net.can_cache_kv != shift  # repeats: the step runs them
    with pytest.raises(ValueError, match="ff_deep_embeds"):
        sf.Decoder(dim=DIM, depth=2, heads=HEADS, weight_tie_layers=True)(
            torch.randn(1, 3, DIM), ff_deep_embeds=torch.ones(1, 3, 1, DIM))
    for opts in (dict(residual_attn=True), dict(residual_attn=True, checkpoint_layers=True)):
        with pytest.raises(ValueError, match="residual_attn"):
            sf.Decoder(dim=DIM, depth=2, heads=HEADS, unpadded=not opts.get("checkpoint_layers"), **opts)
    net = sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=16, attn_layers=sf.Decoder(
        dim=DIM, depth=2, heads=HEADS, residual_attn=True))
    assert static_reason(net) is None and not net.attn_layers.packable and net.can_cache_kv  # the step carries logits
    with pytest.raises(ValueError, match="cross_attend"):
        sf.Decoder(dim=DIM, depth=2, heads=HEADS, cross_residual_attn=True)
    for opts in (dict(pre_norm=False), dict(scale_residual=True), dict(scale_residual_constant=0.5),
                 dict(gate_residual=True), dict(softclamp_output=True)):
        with pytest.raises(ValueError, match="unpadded=True"):
            sf.Decoder(dim=DIM, depth=2, heads=HEADS, unpadded=True, **opts)
        assert static_reason(sf.TransformerWrapper(  # per token: the decode step runs the routing
            num_tokens=VOCAB, max_seq_len=16, attn_layers=sf.Decoder(dim=DIM, depth=2, heads=HEADS, **opts))) is None
    bad = [(dict(depth=2, custom_layers=("a", "x")), "custom_layers"), (dict(custom_layers=("a", "c")), "cross_attend"),
           (dict(depth=2, par_ratio=1), "par_ratio"), (dict(depth=2, sandwich_coef=3), "sandwich_coef"),
           (dict(depth=2, par_ratio=2, sandwich_coef=1), "choose one layer layout"),
           (dict(depth=2, weight_tie_layers=True, sandwich_coef=1), "weight_tie_layers"),
           (dict(depth=2, only_attn=True, layers_execute_order=(0, 1)), "only_attn"),
           (dict(custom_layers=("a", "f"), only_attn=True), "only_attn"),
           (dict(depth=2, layers_execute_order=(0, 9)), "layers_execute_order"),
           (dict(depth=2, sandwich_norm=True, pre_norm=False), "sandwich_norm"),
           (dict(depth=2, use_layerscale=True, use_adaptive_layerscale=True), "use_layerscale"),
           (dict(depth=2, gate_residual=True, orthog_residual=True), "choose one"),
           (dict(depth=2, scale_residual=True, mv_split_residual=True), "scale_residual"),
           (dict(depth=2, shift_tokens=-1), "shift_tokens"), (dict(depth=2, shift_tokens=(1, 2)), "shift_tokens"),
           (dict(depth=2, softclamp_output=True, softclamp_output_value=0.0), "softclamp_output_value"),
           (dict(depth=2, scale_residual=float("nan")), "scale_residual"),
           (dict(custom_layers=("a", "f"), ff_mult=(2, 3)), "per-layer"), (dict(), "depth"),
           (dict(depth=4, weight_tie_layers=True, unet_skips=True), "unet_skips"),
           (dict(depth=2, weight_tie_layers=True, integrate_layers=True), "integrate_layers")]
    for opts, match in bad:
        with pytest.raises(ValueError, match=match):
            sf.Decoder(dim=DIM, heads=HEADS, **opts)
    with pytest.raises(ValueError, match="repeat_blocks"):
        sf.Decoder(dim=DIM, depth=2, heads=HEADS, sandwich_coef=1)(torch.randn(1, 2, DIM), repeat_blocks=(0, 2))


def test_weight_tied_layers_share_one_layer_and_save_load(tmp_path):
    """``weight_tie_layers`` builds one layer run ``depth`` times (as ``layers_execute_order`` on a one-layer stack);
    the layer options survive save_pretrained / from_pretrained."""
    tied = _stack(dict(depth=3, weight_tie_layers=True))
    assert len(tied.layers) == 2 and tied.default_order == (0, 1) * 3
    x = torch.randn(2, 5, DIM)
    with torch.no_grad():
        torch.testing.assert_close(tied(x), tied(x, layers_execute_order=(0, 1, 0, 1, 0, 1)))
    net = sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=16, attn_layers=sf.Decoder(
        dim=DIM, heads=HEADS, custom_layers=("a", "f", "a"), macaron=True, sandwich_norm=True, use_layerscale=True,
        gate_residual=True, shift_tokens=1)).eval()
    _perturb(net)
    net.save_pretrained(tmp_path)
    back = sf.TransformerWrapper.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens), net(tokens))
