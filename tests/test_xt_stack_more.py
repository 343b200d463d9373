"""x-transformers' residual routing options of ``AttentionLayers`` (``block.ResidualRouting``): hyper-connections
(``num_residual_streams``, ``qkv_receive_diff_residuals``), LIMe (``integrate_layers``), ``unet_skips``,
``reinject_input``, ``pre_and_post_norm``, ``orthog_residual``, ``mv_split_residual``; ``repeat_blocks`` /
``layer_hiddens``; ``layer_schedule`` and per-layer ``ff_mult`` / ``attn_dropout`` / ``ff_dropout``.

The math is checked against x-transformers itself on copied weights (float32), its hyper-connections with the
Sinkhorn step over the ``S x S`` mixing matrix (x-transformers 2.31.10 normalises each stream's ``1 x S`` row
alone, which makes every mix the all-ones matrix; see ``test_sinkhorn_mix_is_doubly_stochastic``); safety by a
padded sample equal to the sample alone, NaN planted at padded positions reaching nothing, the KV cache
equal to the full forward where the option is per token, and clear refusals where it is not.

Shape legend: b batch, n positions, c model width, S residual streams.
"""

from __future__ import annotations

import pytest
import torch
import x_transformers as xt
import x_transformers.x_transformers as xt_mod
from helpers import check_padded_equals_alone, perturb_params

import safeformer as sf
from safeformer.decoding.static import static_reason
from safeformer.nn.block import sinkhorn

DIM, HEADS, DIM_HEAD, VOCAB = 32, 4, 8, 50


def _xt_sinkhorn_over_streams(t, iters=20):
    """x-transformers' ``sinkhorn`` fed its ``(..., S, 1, S)`` rows, applied to the ``S x S`` matrix instead."""
    return sinkhorn(t.squeeze(-2), iters).unsqueeze(-2)


pytestmark = pytest.mark.usefixtures("one_thread")
_perturb = perturb_params


def _pair(opts: dict, *, encoder: bool = False, depth: int = 2, seed: int = 0):
    """``(ours, peer)``: x-transformers' wrapper with ``opts`` (weights perturbed) and safeformer's built by the same
    call, x-transformers' state dict loaded strictly (the routing's parameters where x-transformers keeps them)."""
    torch.manual_seed(seed)
    common = dict(dim=DIM, depth=depth, heads=HEADS, attn_dim_head=DIM_HEAD)
    peer = _perturb(xt.TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, attn_layers=(
        xt.Encoder if encoder else xt.Decoder)(**common, **opts)), seed).eval()
    ours = sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, attn_layers=(
        sf.Encoder if encoder else sf.Decoder)(**common, **opts)).eval()
    ours.load_state_dict(peer.state_dict(), strict=True)
    return ours, peer


XT_CASES = [
    dict(num_residual_streams=4),
    dict(num_residual_streams=4, qkv_receive_diff_residuals=True),
    dict(integrate_layers=True),
    dict(integrate_layers=True, num_residual_streams=4),
    dict(integrate_layers=True, layer_integrate_use_softmax=False),
    dict(unet_skips=True, depth=4),
    dict(unet_skips=True, depth=5, encoder=True),
    dict(reinject_input=True),
    dict(reinject_input=True, learned_reinject_input_gate=True),
    dict(pre_and_post_norm=True),
    dict(mv_split_residual=True),
    dict(mv_split_residual=True, residual_fn_kwargs=dict(learned=True), pre_and_post_norm=True),
    dict(orthog_residual=True),
]


@pytest.mark.parametrize("opts", XT_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_matches_x_transformers_on_copied_weights(opts, monkeypatch):
    """The same logits as x-transformers (float32, every weight perturbed), unpadded and right-padded (real
    positions; x-transformers' absolute positions agree there); orthog_residual reduces over padding in
    x-transformers, so it is compared without a mask."""
    monkeypatch.setattr(xt_mod, "sinkhorn", _xt_sinkhorn_over_streams)
    opts = dict(opts)
    encoder, depth = opts.pop("encoder", False), opts.pop("depth", 2)
    ours, peer = _pair(opts, encoder=encoder, depth=depth)
    tokens = torch.randint(0, VOCAB, (2, 9))
    mask = torch.tensor([[True] * 9, [True] * 6 + [False] * 3])
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), peer(tokens), atol=1e-5, rtol=1e-5)
        if not opts.get("orthog_residual"):
            got, want = ours(tokens, mask=mask), peer(tokens, mask=mask)
            torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)


def _keep(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``mask (b, n)`` in the layout of a ``layer_hiddens`` entry ``h``."""
    if h.dim() == 4:  # (3, b, n, c)
        return mask[None, :, :, None]
    return mask.repeat_interleave(h.shape[0] // mask.shape[0], dim=0)[..., None]  # (b, n, c) or (b S, n, c)


@pytest.mark.parametrize("opts", [*XT_CASES[:4], dict(softclamp_output=True, softclamp_output_value=0.5)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_layer_hiddens_match_x_transformers_with_a_mask(opts, monkeypatch):
    """``return_intermediates`` with a padding mask: x-transformers' ``layer_hiddens`` at the real positions, in
    its layouts (every block's input: ``(b, n, c)``, or ``(3, b, n, c)`` for hyper-connections' separate q/k/v
    views; last, the stream before ``softclamp_output``: ``(b S, n, c)`` with several residual streams); padded
    positions exact zeros, also with NaN planted in the padded positions' embeddings."""
    monkeypatch.setattr(xt_mod, "sinkhorn", _xt_sinkhorn_over_streams)
    ours, peer = _pair(dict(opts))
    tokens = torch.randint(0, VOCAB - 3, (2, 9))
    tokens[1, 6:] = torch.arange(VOCAB - 3, VOCAB)  # the padded positions' ids appear nowhere else
    mask = torch.tensor([[True] * 9, [True] * 6 + [False] * 3])
    with torch.no_grad():
        _, got = ours(tokens, mask=mask, return_intermediates=True)
        _, want = peer(tokens, mask=mask, return_intermediates=True)
        assert len(got.layer_hiddens) == len(want.layer_hiddens)
        for g, w in zip(got.layer_hiddens, want.layer_hiddens):
            assert g.shape == w.shape
            keep = _keep(g, mask)
            torch.testing.assert_close(torch.where(keep, g, 0.0), torch.where(keep, w, 0.0), atol=1e-5, rtol=1e-5)
            assert torch.equal(torch.where(keep, 0.0, g), torch.zeros_like(g))  # padded positions: exact zeros
        ours.token_emb.weight[VOCAB - 3:] = float("nan")  # NaN in the padded positions' embeddings only
        _, planted = ours(tokens, mask=mask, return_intermediates=True)
        for g, h in zip(got.layer_hiddens, planted.layer_hiddens):
            assert torch.equal(g, h)


def test_sinkhorn_mix_is_doubly_stochastic():
    """Hyper-connections mix the streams by a doubly stochastic ``S x S`` matrix (rows and columns sum to 1),
    so the streams keep their scale; x-transformers 2.31.10's own mix sums every stream into each (its
    Sinkhorn step sees ``1 x S`` matrices), which grows the streams ``S``-fold per block."""
    torch.manual_seed(0)
    m = sinkhorn(torch.randn(3, 4, 4, dtype=torch.float64), iters=30)
    torch.testing.assert_close(m.sum(-1), torch.ones(3, 4, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(m.sum(-2), torch.ones(3, 4, dtype=torch.float64), atol=1e-12, rtol=0)
    hc = xt_mod.HyperConnection(8, layer_index=0, num_residual_streams=4)
    streams = torch.randn(2 * 4, 3, 8)
    _, mixed, _ = hc.prepare(streams)
    summed = streams.unflatten(0, (2, 4)).transpose(1, 2).sum(-2, keepdim=True)  # (b, n, 1, c)
    torch.testing.assert_close(mixed, summed.expand_as(mixed))  # x-transformers' all-ones mix


def test_hyper_connection_matches_float64_formula():
    """``HyperConnection.prepare`` / ``forward`` against the formula, float64, with perturbed weights."""
    torch.manual_seed(1)
    hc = _perturb(sf.nn.block.HyperConnection(8, layer_index=1, num_residual_streams=3, num_input_views=3)).double()
    streams = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    branch, mixed, beta = hc.prepare(streams)
    normed = torch.nn.functional.layer_norm(streams, (8,), hc.norm.weight, None, hc.norm.eps)
    alpha = normed @ hc.dynamic_alpha_fn * hc.dynamic_alpha_scale + hc.static_alpha  # (b, n, S, 3 + S)
    res = alpha[..., 3:].softmax(dim=-2)
    for _ in range(hc.sinkhorn_iters):
        res = res / res.sum(-1, keepdim=True)
        res = res / res.sum(-2, keepdim=True)
    full = torch.cat((alpha[..., :3].sigmoid(), res), dim=-1)
    want = torch.einsum("bnst,bnsd->bntd", full, streams)
    torch.testing.assert_close(branch, want[..., :3, :].permute(2, 0, 1, 3))
    torch.testing.assert_close(mixed, want[..., 3:, :])
    want_beta = 2 * torch.sigmoid(hc.static_beta + 2 * torch.sigmoid(normed @ hc.dynamic_beta_fn) * hc.dynamic_beta_scale)
    torch.testing.assert_close(beta, want_beta)
    out = torch.randn(2, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(hc(out, mixed, beta), mixed + out[..., None, :] * want_beta[..., None])


SAFE_CASES = [
    dict(num_residual_streams=3, qkv_receive_diff_residuals=True),
    dict(integrate_layers=True, num_residual_streams=2),
    dict(integrate_layers=True, qkv_receive_diff_residuals=True, reinject_input=True, learned_reinject_input_gate=True),
    dict(unet_skips=True, depth=4, pre_and_post_norm=True),
    dict(mv_split_residual=True, residual_fn_kwargs=dict(learned=True)),
    dict(orthog_residual=True),
]
PER_TOKEN = [c for c in SAFE_CASES if not (c.get("mv_split_residual") or c.get("orthog_residual"))]


def _stack(opts: dict, causal: bool = True, cross: bool = False, seed: int = 2):
    opts = dict(opts)
    depth = opts.pop("depth", 2)
    cls = sf.Decoder if causal else sf.Encoder
    torch.manual_seed(seed)
    extra = dict(cross_attend=True, dim_context=12) if cross else {}
    return _perturb(cls(dim=16, depth=depth, heads=2, dim_head=8, rotary_pos_emb=True, **extra, **opts), seed, 0.2).eval()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("opts", SAFE_CASES, ids=lambda c: ",".join(k for k in c if k != "depth"))
def test_padded_sample_equals_alone_and_planted_nan_reaches_nothing(opts, causal):
    """Left and right padding, a fully padded sample, NaN at every padded position: each sample's real outputs
    equal the sample alone; outputs and gradients are finite, padded positions get exactly 0 and no gradient."""
    mask = torch.tensor([[False, False] + [True] * 5, [True] * 4 + [False] * 3, [False] * 7])
    check_padded_equals_alone(_stack(opts, causal), 16, mask)


@pytest.mark.parametrize("opts", PER_TOKEN, ids=lambda c: ",".join(k for k in c if k != "depth"))
def test_kv_cache_decodes_as_the_full_forward(opts):
    """Per-token routing continues from the KV cache: one position at a time (left-padded prompt, a context
    with padding) equals the whole sequence at once."""
    cross = not opts.get("unet_skips")  # x-transformers' skip pairing leaves too few skips with cross-attention
    model = _stack(opts, causal=True, cross=cross)
    torch.manual_seed(4)
    x, ctx = torch.randn(2, 6, 16), torch.randn(2, 3, 12) if cross else None
    mask = torch.tensor([[False, True, True, True, True, True], [True] * 6])
    cmask = torch.tensor([[True, True, False], [False, False, False]]) if cross else None
    with torch.no_grad():
        full = model(x, mask=mask, context=ctx, context_mask=cmask)
        out, cache = model(x[:, :3], mask=mask[:, :3], context=ctx, context_mask=cmask, return_cache=True)
        outs = [out]
        for t in range(3, 6):
            out, cache = model(x[:, t : t + 1], mask=mask[:, t : t + 1], cache=cache, return_cache=True)
            outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-5, rtol=1e-5)


def test_dropped_context_equals_no_context():
    """With residual routing a cross-attention branch that adds nothing still runs the routing: an all-False
    context_mask gives exactly what context=None gives."""
    model = _stack(dict(num_residual_streams=3, integrate_layers=True), causal=True, cross=True)
    x, ctx = torch.randn(2, 5, 16), torch.randn(2, 3, 12)
    with torch.no_grad():
        dropped = model(x, context=ctx, context_mask=torch.zeros(2, 3, dtype=torch.bool))
        torch.testing.assert_close(dropped, model(x), atol=1e-6, rtol=1e-6)


def test_what_cannot_run_is_refused_or_falls_back():
    """Sequence-wide updates refuse a KV cache (``can_cache_kv`` False); every routing option refuses
    ``unpadded=True`` and runs the padded path under ``'auto'``; the decode step runs the per-token ones."""
    for opts in (dict(orthog_residual=True), dict(mv_split_residual=True)):
        stack = _stack(opts)
        assert not stack.can_cache_kv
        with pytest.raises(ValueError, match="KV cache"):
            stack(torch.randn(1, 3, 16), return_cache=True)
        net = sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=16, attn_layers=sf.Decoder(dim=16, depth=1, heads=2, **opts))
        assert not net.can_cache_kv
    for opts in SAFE_CASES:
        with pytest.raises(ValueError, match="unpadded=True"):
            sf.Decoder(dim=16, depth=4, heads=2, unpadded=True, **{k: v for k, v in opts.items() if k != "depth"})
        net = sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=16, attn_layers=sf.Decoder(
            dim=16, heads=2, **{"depth": 2, **opts}))
        assert not net.attn_layers.packable
        reason = static_reason(net)  # the step runs the per-token routing (separate q/k/v inputs too)
        off = any(opts.get(k) for k in ("mv_split_residual", "orthog_residual"))  # over the sequence: no cache
        assert (reason is None) != off and (reason is None or "whole sequence" in reason)
    assert sf.Decoder(dim=16, depth=1, heads=2).routing is None  # the plain stack: one stream, no routing
    with pytest.raises(ValueError, match="qkv_receive_diff_residuals"):
        sf.Decoder(dim=16, depth=1, heads=2, qkv_receive_diff_residuals=True)
    with pytest.raises(ValueError, match="choose one"):
        sf.Decoder(dim=16, depth=1, heads=2, num_residual_streams=2, orthog_residual=True)
    with pytest.raises(ValueError, match="reinject_input"):
        sf.Decoder(dim=16, depth=1, heads=2, num_residual_streams=2, reinject_input=True)
    with pytest.raises(ValueError, match="residual_fn_kwargs"):
        sf.Decoder(dim=16, depth=1, heads=2, residual_fn_kwargs=dict(learned=True))
    with pytest.raises(ValueError, match="unet_skips"):
        sf.Decoder(dim=16, depth=2, heads=2, cross_attend=True, unet_skips=True)
    with pytest.raises(ValueError, match="num_residual_streams"):
        sf.Decoder(dim=16, depth=1, heads=2, num_residual_streams=0)


def test_repeat_blocks_match_x_transformers_and_count_layer_hiddens(monkeypatch):
    """``repeat_blocks`` runs layers again in x-transformers' order (same outputs on copied weights), and
    ``layer_hiddens`` counts x-transformers' way: every block's input, then the stream before the final norm."""
    monkeypatch.setattr(xt_mod, "sinkhorn", _xt_sinkhorn_over_streams)
    ours, peer = _pair(dict(num_residual_streams=2), depth=4)
    x = torch.randn(1, 6, DIM)
    spec = (((1, 2), 2), (3, 2))  # layers 0, 1, 2, 1, 2, 3, 3
    with torch.no_grad():
        got, inter = ours.attn_layers(x, repeat_blocks=spec, return_hiddens=True)
        want, pinter = peer.attn_layers(x, repeat_blocks=spec, return_hiddens=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(inter.layer_hiddens) == len(pinter.layer_hiddens) == 2 * 7 + 1
    for a, b in zip(inter.layer_hiddens[:-1], pinter.layer_hiddens[:-1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    plain = sf.Decoder(dim=16, depth=3, heads=2)
    out, inter = plain(torch.randn(2, 4, 16), layers_execute_order=(0, 1, 0, 1, 2, 3, 4, 5), return_hiddens=True)
    assert len(inter.layer_hiddens) == 9 and len(inter.attn_intermediates) == 4
    with pytest.raises(ValueError, match="KV cache"):
        plain(torch.randn(1, 2, 16), repeat_blocks=((0, 1), 2), return_cache=True)
    with pytest.raises(ValueError, match="repeat_blocks"):
        plain(torch.randn(1, 2, 16), repeat_blocks=((1, 3), 2))
    with pytest.raises(ValueError, match="integrate_layers"):
        sf.Decoder(dim=16, depth=2, heads=2, integrate_layers=True)(torch.randn(1, 2, 16), repeat_blocks=(0, 2))


def test_layer_schedule_and_per_layer_options_match_x_transformers():
    """``layer_schedule`` gives x-transformers' values; per-layer ``ff_mult`` / ``attn_dropout`` / ``ff_dropout``
    set each layer (a sequence of ``attn_dropout`` leaves cross-attention at 0, as x-transformers routes it)."""
    for args in ((6, 2, 12, "cosine"), (0.0, 0.5, 5, "linear"), (0.0, 0.5, 4, lambda a, b, t: a + (b - a) * t**2)):
        assert sf.layer_schedule(*args) == pytest.approx(xt_mod.layer_schedule(*args))
    with pytest.raises(ValueError, match="depth"):
        sf.layer_schedule(1, 2, 1)
    with pytest.raises(ValueError, match="schedule"):
        sf.layer_schedule(1, 2, 3, "exp")
    mults = (4, 2, 1)
    stack = sf.Decoder(dim=16, depth=3, heads=2, cross_attend=True, ff_mult=mults, attn_dropout=(0.0, 0.1, 0.2),
                       ff_dropout=[0.3, 0.2, 0.1])
    peer = xt.Decoder(dim=16, depth=3, heads=2, cross_attend=True, ff_mult=mults)
    ffs = [blk.mixer for blk in stack.layers if blk.kind == "ff"]
    assert [f.proj_in.out_features for f in ffs] == [16 * m for m in mults]
    assert [m.ff[0][0].out_features for (_, m, _), k in zip(peer.layers, peer.layer_types) if k == "f"] == [16 * m for m in mults]
    assert [blk.mixer.dropout for blk in stack.layers if blk.kind == "self"] == [0.0, 0.1, 0.2]
    assert [blk.mixer.dropout for blk in stack.layers if blk.kind == "cross"] == [0.0, 0.0, 0.0]
    assert [f.dropout.p for f in ffs] == [0.3, 0.2, 0.1]
    mults = sf.layer_schedule(6, 2, 5)  # fractional widths: int(dim * mult), as x-transformers
    ours = sf.Decoder(dim=30, depth=5, heads=2, ff_mult=mults)
    peer = xt.Decoder(dim=30, depth=5, heads=2, ff_mult=mults)
    assert [blk.mixer.proj_in.out_features for blk in ours.layers if blk.kind == "ff"] == \
        [m.ff[0][0].out_features for (_, m, _), k in zip(peer.layers, peer.layer_types) if k == "f"]
    with pytest.raises(ValueError, match="ff_mult"):
        sf.Decoder(dim=16, depth=3, heads=2, ff_mult=(4, 2))


def test_save_load_and_checkpointing_keep_the_routing(tmp_path):
    """The routing options (and per-layer sequences) survive save_pretrained / from_pretrained; activation
    checkpointing recomputes the routed blocks with identical gradients."""
    net = sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=16, attn_layers=sf.Decoder(
        dim=16, depth=2, heads=2, num_residual_streams=2, qkv_receive_diff_residuals=True, ff_mult=(2, 3),
        pre_and_post_norm=True)).eval()
    _perturb(net.attn_layers.routing)
    net.save_pretrained(tmp_path)
    back = sf.TransformerWrapper.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens), net(tokens))
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        stack = _stack(dict(integrate_layers=True, qkv_receive_diff_residuals=True, unet_skips=True, depth=4))
        stack.checkpoint_layers = ckpt
        stack.train()
        x = torch.randn(2, 5, 16, requires_grad=True)
        stack(x, mask=torch.tensor([[True] * 5, [False, True, True, True, True]])).square().sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1])
