"""x-transformers' call arguments ``TransformerWrapper.forward(transform_block_inputs=)`` and
``AttentionLayers.forward(return_gumbel_log_probs=, rotary_pos_emb=, in_attn_cond=)`` in safeformer.

Each is checked against x-transformers itself: the same keyword call on both models, safeformer's loaded from
x-transformers' (perturbed) weights strictly (and back), outputs and gradients at the real positions of a
right-padded batch (float32, 1e-5). Safety: NaN planted at padded positions (inputs, and what the argument holds
there) reaches no output and no gradient, a padded sample equals itself alone, and bad values raise errors naming the
argument. ``polar_pos_emb`` is tested in tests/test_xt_polar_call.py, the packed flash masks in
tests/test_flash_pack_seq.py.

Shape legend: b batch, n positions, c model width, h heads, N rotary positions given, r rotary dims.
"""

from __future__ import annotations

import pytest
import torch
import x_transformers as xt
from helpers import perturb_params

import safeformer as sf

DIM, HEADS, DIM_HEAD, VOCAB = 16, 2, 8, 20
NAN = float("nan")
MASK = torch.tensor([[True] * 7, [True] * 5 + [False] * 2])
pytestmark = pytest.mark.usefixtures("one_thread")


def _stack_pair(opts: dict, seed: int = 0):
    """``(ours, peer)``: x-transformers' stack with ``opts`` (weights perturbed) and safeformer's loaded from it
    strictly; x-transformers' loaded back from safeformer's strictly."""
    opts = dict(opts)
    causal = opts.pop("causal", True)
    depth = opts.pop("depth", 2)
    torch.manual_seed(seed)
    peer_cls, cls = (xt.Decoder, sf.Decoder) if causal else (xt.Encoder, sf.Encoder)
    peer = perturb_params(peer_cls(dim=DIM, depth=depth, heads=HEADS, attn_dim_head=DIM_HEAD, **opts), seed).eval()
    ours = cls(dim=DIM, depth=depth, heads=HEADS, dim_head=DIM_HEAD, **opts).eval()
    ours.load_state_dict(peer.state_dict(), strict=True)
    peer.load_state_dict(ours.state_dict(), strict=True)
    return ours, peer


def _compare(ours, peer, x: torch.Tensor, mask: torch.Tensor, **kw) -> None:
    """Outputs at the real positions, the input's gradient there and every parameter's gradient of a loss on the
    real positions: the same in both models."""
    weight = torch.randn(*mask.shape, DIM)
    res = []
    for model in (ours, peer):
        model.zero_grad()
        xi = x.clone().requires_grad_()
        out = model(xi, mask=mask, **kw)
        (out[mask] * weight[mask]).sum().backward()
        grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
        res.append((out.detach()[mask], xi.grad[mask], grads))
    torch.testing.assert_close(res[0][:2], res[1][:2], atol=1e-5, rtol=1e-5)
    assert res[0][2].keys() == res[1][2].keys() and res[0][2]
    torch.testing.assert_close(res[0][2], res[1][2], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# TransformerWrapper.forward(transform_block_inputs=)
# ---------------------------------------------------------------------------------------------------------------

def _wrapper_pair(layer_opts: dict | None = None, **wrapper_opts):
    torch.manual_seed(0)
    lo = dict(dim=DIM, depth=3, heads=HEADS, **(layer_opts or {}))
    peer = perturb_params(xt.TransformerWrapper(num_tokens=VOCAB, max_seq_len=16, attn_layers=xt.Decoder(
        attn_dim_head=DIM_HEAD, **lo), **wrapper_opts), 0).eval()
    ours = sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=16, attn_layers=sf.Decoder(dim_head=DIM_HEAD, **lo),
                                 **wrapper_opts).eval()
    ours.load_state_dict(peer.state_dict(), strict=True)
    peer.load_state_dict(ours.state_dict(), strict=True)
    return ours, peer


MIX = torch.randn(2, 7, DIM, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
HOOKS = {
    "dict_depth_1_and_3": dict(transform_block_inputs={1: lambda t: t * 1.5 + MIX, 3: torch.tanh}),
    "callable": dict(transform_block_inputs=lambda depth, t: t * (0.5 + 0.25 * depth) + 0.1),
    "token_embeds_win_at_depth_1": dict(transform_token_embeds=lambda t: t * 0.5,
                                        transform_block_inputs=lambda depth, t: t * depth),
}
WRAPPERS = {"plain": {}, "recycling": dict(recycling=True, train_max_recycle_steps=2),
            "memory_tokens": dict(num_memory_tokens=2)}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
@pytest.mark.parametrize("hook", list(HOOKS))
def test_wrapper_transform_block_inputs_matches_x_transformers(wrapper, hook):
    """Depth 1 transforms the token embeddings (unless ``transform_token_embeds`` is given), depths 2, 3, ... the
    stream entering each later layer: x-transformers' logits and parameter gradients at the real positions (float64:
    the hooks amplify float32 rounding of the summed parameter gradients past 1e-5)."""
    ours, peer = (m.double() for m in _wrapper_pair(**WRAPPERS[wrapper]))
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    call = dict(HOOKS[hook], **({"recycle_steps": 2} if wrapper == "recycling" else {}))
    weight = torch.randn(2, 7, VOCAB, dtype=torch.float64)
    res = []
    for model in (ours, peer):
        model.zero_grad()
        out = model(ids, mask=MASK, **call)
        (out[MASK] * weight[MASK]).sum().backward()
        res.append((out.detach()[MASK], {k: p.grad for k, p in model.named_parameters() if p.grad is not None}))
    plain = ours(ids, mask=MASK, **({"recycle_steps": 2} if wrapper == "recycling" else {}))
    assert not torch.allclose(plain[MASK], res[0][0], atol=1e-3)  # the hook changed something
    assert res[0][1].keys() == res[1][1].keys()
    torch.testing.assert_close(res[0], res[1], atol=1e-5, rtol=1e-5)


def test_wrapper_transform_block_inputs_padding_and_refusals():
    """The hook sees padded positions as exact zeros at every depth (depth 1 included) and the NaN it writes there
    reaches nothing: logits and gradients finite, the padded sample equal to itself alone. Bad hooks are refused by
    name."""
    ours, _ = _wrapper_pair()
    seen = []

    def hook(depth, t):
        seen.append(depth)
        pad = (t == 0).all(-1, keepdim=True)  # a real position's stream is never exactly 0 here
        assert bool(pad[1, 5:].all()) and not bool(pad[0].any())
        return torch.where(pad, NAN, t * 1.25)

    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    out = ours(ids, mask=MASK, transform_block_inputs=hook)
    out[MASK].sum().backward()
    assert seen == [1, 2, 3] and torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)
    with torch.no_grad():
        alone = ours(ids[1:, :5], transform_block_inputs=lambda d, t: t * 1.25)
    torch.testing.assert_close(out[1, :5].detach(), alone[0], atol=1e-5, rtol=1e-5)
    for bad, err in ((3, TypeError), ({"1": torch.sin}, TypeError), ({1: lambda t: t[:, :2]}, ValueError),
                     ({2: lambda t: t[:, :2]}, ValueError)):
        with pytest.raises(err, match="transform_block_inputs"):
            ours(ids, mask=MASK, transform_block_inputs=bad)


# ---------------------------------------------------------------------------------------------------------------
# AttentionLayers.forward(return_gumbel_log_probs=True)
# ---------------------------------------------------------------------------------------------------------------

def _hard_softmax(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``F.gumbel_softmax(hard=True)`` without its noise (straight-through one-hot of the softmax)."""
    soft = t.softmax(dim)
    one_hot = torch.zeros_like(soft).scatter_(dim, soft.argmax(dim, keepdim=True), 1.0)
    return one_hot - soft.detach() + soft


@pytest.mark.parametrize("opts", [dict(attn_gumbel_softmax=True), dict(attn_gumbel_softmax=True, attn_kv_heads=1),
                                  dict(cross_attend=True, causal=False)],
                         ids=["gumbel", "gumbel_gqa", "softmax_cross"])
def test_return_gumbel_log_probs_matches_x_transformers(opts, monkeypatch):
    """Each attention intermediate's ``log_probs (b, h, i)``: the log probability of the key each query picked, as
    x-transformers computes it (real query rows), with the outputs and the gradients of a loss through both. The
    gumbel noise is made constant in both libraries (a constant shift of the logits: the hard softmax's pick), so
    that the draws agree."""
    ours, peer = _stack_pair(opts, seed=3)
    if opts.get("attn_gumbel_softmax"):
        for layer in peer.layers:
            if hasattr(layer[1], "attend"):
                layer[1].attend.attn_fn = _hard_softmax
        monkeypatch.setattr(torch, "rand_like", lambda t, *a, **k: torch.full_like(t, 0.5))
    torch.manual_seed(4)
    x = torch.randn(2, 7, DIM)
    kw = dict(context=torch.randn(2, 3, DIM), context_mask=torch.tensor([[True] * 3, [True, True, False]])) \
        if opts.get("cross_attend") else {}
    rows = MASK[:, None, :].expand(2, HEADS, 7)
    res = []
    for model in (ours, peer):
        model.zero_grad()
        xi = x.clone().requires_grad_()
        out, inter = model(xi, mask=MASK, return_gumbel_log_probs=True, **kw)
        lps = [i.log_probs for i in inter.attn_intermediates]
        (out[MASK].sum() + sum(lp[rows].sum() for lp in lps)).backward()
        res.append((out.detach()[MASK], xi.grad[MASK], [lp.detach()[rows] for lp in lps],
                    {k: p.grad for k, p in model.named_parameters() if p.grad is not None}))
    assert len(res[0][2]) == (4 if opts.get("cross_attend") else 2)
    assert all(bool((lp < -1e-3).any()) for lp in res[0][2])  # not all picks certain: the test can fail
    torch.testing.assert_close(res[0], res[1], atol=1e-5, rtol=1e-5)


def test_return_gumbel_log_probs_padding_dead_rows_and_refusals():
    """NaN at padded inputs reaches no log probability; padded queries and dead rows (an all-masked context) pick
    nothing: 0. A non-bool value and the arguments still unsupported are refused by name."""
    stack = perturb_params(sf.Encoder(dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD, cross_attend=True,
                                      attn_gumbel_softmax=True), 5)
    x = torch.where(MASK[..., None], torch.randn(2, 7, DIM), NAN).requires_grad_()
    ctx_mask = torch.tensor([[True] * 3, [False] * 3])
    out, inter = stack(x, mask=MASK, context=torch.randn(2, 3, DIM), context_mask=ctx_mask,
                       return_gumbel_log_probs=True)
    self_lp, cross_lp = (i.log_probs for i in inter.attn_intermediates)
    (out[MASK].sum() + self_lp.sum() + cross_lp.sum()).backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all() and (x.grad[~MASK] == 0).all()
    assert (self_lp[1, :, 5:] == 0).all() and (self_lp[MASK[:, None].expand(2, HEADS, 7)] < 0).any()
    assert (cross_lp[1] == 0).all() and (cross_lp[0] <= 0).all()  # sample 1's context is empty: dead rows
    enc = sf.Encoder(dim=DIM, depth=1, heads=HEADS)
    with pytest.raises(TypeError, match="return_gumbel_log_probs"):
        enc(torch.randn(1, 3, DIM), return_gumbel_log_probs="yes")
    for name, value, exc in (("polar_pos_emb", (torch.zeros(1), torch.zeros(1)), ValueError),
                             ("flash_pack_seq_context_kwargs", {}, TypeError)):  # bad values, named
        with pytest.raises(exc, match=name):
            enc(torch.randn(1, 3, DIM), **{name: value})


# ---------------------------------------------------------------------------------------------------------------
# AttentionLayers.forward(rotary_pos_emb=)
# ---------------------------------------------------------------------------------------------------------------

ROTARY = {"no_own_rotary": ({}, 4, False), "own_rotary_gqa": (dict(rotary_pos_emb=True, attn_kv_heads=1), 8, False),
          "xpos": (dict(rotary_pos_emb=True, rotary_xpos=True, rotary_xpos_scale_base=8), 4, True),
          "encoder": (dict(causal=False, attn_num_mem_kv=2), 6, False)}


@pytest.mark.parametrize("case", list(ROTARY))
def test_rotary_pos_emb_matches_x_transformers(case):
    """A given ``(freqs, xpos_scale)`` (x-transformers' ``RotaryEmbedding`` of custom positions, longer than the
    sequence: its last ``n`` used) rotates every self-attention in place of the stack's own positions."""
    opts, rot, xpos = ROTARY[case]
    ours, peer = _stack_pair(opts, seed=6)
    pos = torch.tensor([[9, 3, 1, 4, 1, 5, 9, 2, 6], [0, 2, 7, 1, 8, 2, 8, 1, 8]])
    freqs, scale = xt.x_transformers.RotaryEmbedding(rot, use_xpos=xpos, scale_base=8)(pos)
    torch.manual_seed(7)
    x = torch.randn(2, 7, DIM)
    _compare(ours, peer, x, MASK, rotary_pos_emb=(freqs, scale))
    with torch.no_grad():  # the given positions are used: not the stack's own
        assert not torch.allclose(ours(x, mask=MASK)[MASK], ours(x, mask=MASK, rotary_pos_emb=(freqs, scale))[MASK])


def test_rotary_pos_emb_padding_cross_positions_and_refusals():
    """NaN in the given angles and scales at padded positions (and in the padded inputs) reaches nothing; a padded
    sample equals itself alone with its own angles. With ``context_pos`` cross-attention's queries take the given
    angles, as in x-transformers. Bad values, a KV cache, memories and PoPE are refused by name."""
    stack = perturb_params(sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, rotary_pos_emb=True,
                                      rotary_xpos=True, rotary_xpos_scale_base=8), 8).eval()
    freqs, scale = stack.rotary_pos_emb(torch.arange(7)[None].expand(2, 7) * 2)
    freqs, scale = freqs.clone(), scale.clone()
    freqs[1, 5:], scale[1, 5:] = NAN, NAN
    x = torch.where(MASK[..., None], torch.randn(2, 7, DIM), NAN).requires_grad_()
    out = stack(x, mask=MASK, rotary_pos_emb=(freqs, scale))
    (out * torch.randn_like(out)).sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all() and (out[~MASK] == 0).all()
    with torch.no_grad():
        alone = stack(x[1:, :5], rotary_pos_emb=(freqs[1:, :5], scale[1:, :5]))
    torch.testing.assert_close(out[1, :5].detach(), alone[0], atol=1e-5, rtol=1e-5)

    ours, peer = _stack_pair(dict(rotary_pos_emb=True, cross_attend=True), seed=9)
    rpe = peer.rotary_pos_emb(torch.arange(7) + 3)
    ctx, cpos = torch.randn(2, 4, DIM), torch.arange(4)[None].expand(2, 4)
    _compare(ours, peer, torch.randn(2, 7, DIM), MASK, context=ctx, context_pos=cpos, rotary_pos_emb=rpe)

    dec = sf.Decoder(dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD, rotary_pos_emb=True)
    xs, good = torch.randn(2, 5, DIM), torch.randn(1, 5, 4)
    _, inter = dec(xs, rotary_pos_emb=(good, 1.0), return_hiddens=True)
    assert inter.cache is None  # a cache would hold keys rotated by these angles only
    for bad, err in (((good,), TypeError), (good, TypeError), ((good.long(), 1.0), ValueError),
                     ((torch.randn(1, 4, 4), 1.0), ValueError), ((torch.randn(1, 5, 3), 1.0), ValueError),
                     ((torch.randn(1, 5, 10), 1.0), ValueError), ((good, -torch.ones(1, 5, 4)), ValueError),
                     ((good, torch.ones(1, 5)), ValueError)):
        with pytest.raises(err, match="rotary_pos_emb"):
            dec(xs, rotary_pos_emb=bad)
    with pytest.raises(ValueError, match="rotary_pos_emb"):
        dec(xs, rotary_pos_emb=(good, 1.0), return_cache=True)
    with pytest.raises(ValueError, match="rotary_pos_emb"):
        dec(xs, rotary_pos_emb=(good, 1.0), mems=[torch.randn(2, 3, DIM)])
    pope = sf.Decoder(dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD, polar_pos_emb=True)
    with pytest.raises(ValueError, match="rotary_pos_emb"):
        pope(xs, rotary_pos_emb=(good, 1.0))


# ---------------------------------------------------------------------------------------------------------------
# AttentionLayers.forward(in_attn_cond=)
# ---------------------------------------------------------------------------------------------------------------

COND_STACKS = {"decoder": {}, "encoder_cross": dict(causal=False, cross_attend=True),
               "gated_streams": dict(gated_multi_residual=True, num_residual_streams=2,
                                     residual_fn_kwargs=dict(read_gate_rank=4)),
               "unet_sandwich": dict(depth=4, unet_skips=True, sandwich_norm=True)}


@pytest.mark.parametrize("shape", [(2, DIM), (2, 1, DIM), (2, 7, DIM)], ids=["b_c", "b_1_c", "b_n_c"])
@pytest.mark.parametrize("case", list(COND_STACKS))
def test_in_attn_cond_matches_x_transformers(case, shape):
    """In-attention conditioning: the condition added to every block's branch input (not to the stream)."""
    opts = COND_STACKS[case]
    ours, peer = _stack_pair(opts, seed=10)
    torch.manual_seed(11)
    x, cond = torch.randn(2, 7, DIM), torch.randn(*shape)
    kw = dict(context=torch.randn(2, 3, DIM)) if opts.get("cross_attend") else {}
    _compare(ours, peer, x, MASK, in_attn_cond=cond, **kw)
    with torch.no_grad():
        assert not torch.allclose(ours(x, mask=MASK, **kw)[MASK], ours(x, mask=MASK, in_attn_cond=cond, **kw)[MASK])


def test_in_attn_cond_padding_cache_and_refusals():
    """NaN in the condition's padded rows (and the padded inputs) reaches nothing and a padded sample equals itself
    alone; decoding with a KV cache equals the whole sequence at once. Bad values are refused by name."""
    stack = perturb_params(sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, rotary_pos_emb=True), 12)
    stack.eval()
    cond = torch.randn(2, 7, DIM)
    cond[1, 5:] = NAN
    cond.requires_grad_()
    x = torch.where(MASK[..., None], torch.randn(2, 7, DIM), NAN).requires_grad_()
    out = stack(x, mask=MASK, in_attn_cond=cond)
    (out * torch.randn_like(out)).sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all() and torch.isfinite(cond.grad).all()
    assert (cond.grad[1, 5:] == 0).all() and (out[~MASK] == 0).all()
    with torch.no_grad():
        alone = stack(x[1:, :5], in_attn_cond=cond[1:, :5])
        torch.testing.assert_close(out[1, :5].detach(), alone[0], atol=1e-5, rtol=1e-5)
        xs, c = torch.randn(2, 6, DIM), torch.randn(2, DIM)
        full = stack(xs, in_attn_cond=c)
        step, cache = stack(xs[:, :3], in_attn_cond=c, return_cache=True)
        steps = [step]
        for t in range(3, 6):
            step, cache = stack(xs[:, t: t + 1], in_attn_cond=c, cache=cache, return_cache=True)
            steps.append(step)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    for bad, err in ((torch.ones(2, DIM, dtype=torch.long), TypeError), (torch.randn(2, DIM).double(), TypeError),
                     (torch.randn(2, 7, DIM + 1), ValueError), (torch.randn(3, DIM), ValueError),
                     (torch.randn(2, 4, DIM), ValueError), (torch.randn(DIM), ValueError)):
        with pytest.raises(err, match="in_attn_cond"):
            stack(torch.randn(2, 7, DIM), in_attn_cond=bad)
    reinject = sf.Decoder(dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD, reinject_input=True)
    with pytest.raises(ValueError, match="in_attn_cond"):
        reinject(torch.randn(2, 7, DIM), in_attn_cond=torch.randn(2, DIM))


def test_wrapper_hands_rotary_pos_emb_and_in_attn_cond_to_the_stack_as_x_transformers():
    """``TransformerWrapper.forward(rotary_pos_emb=, in_attn_cond=)``: x-transformers hands its extra keywords to
    the stack; the same numbers on the same weights, padded positions reaching nothing."""
    torch.manual_seed(0)
    theirs = xt.TransformerWrapper(num_tokens=20, max_seq_len=16,
                                   attn_layers=xt.Decoder(dim=16, depth=2, heads=2, rotary_pos_emb=True))
    ours = sf.TransformerWrapper(num_tokens=20, max_seq_len=16,
                                 attn_layers=sf.Decoder(dim=16, depth=2, heads=2, rotary_pos_emb=True))
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.2 * torch.randn(p.shape))
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randint(0, 20, (2, 6))
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    freqs = theirs.attn_layers.rotary_pos_emb(torch.arange(6) * 2.0)  # not the stack's own positions
    cond = torch.randn(2, 16)
    for kw in (dict(rotary_pos_emb=freqs), dict(in_attn_cond=cond)):
        torch.testing.assert_close(ours(x, mask=mask, **kw)[mask], theirs(x, mask=mask, **kw)[mask], atol=1e-5,
                                   rtol=1e-5)
    bad = torch.randn(2, 6, 16)
    bad[~mask] = float("nan")
    out = ours(x, mask=mask, in_attn_cond=bad)
    assert torch.isfinite(out[mask]).all()
