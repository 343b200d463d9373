"""x-transformers' wrappers hand every ``AttentionLayers.forward`` keyword they do not name themselves on to their stack
(``TransformerWrapper.forward(**kwargs)``, ``ContinuousTransformerWrapper.forward(**kwargs)``); safeformer's wrappers
name them and hand them on: ``return_gumbel_log_probs``, ``self_attn_kv_mask``, ``context_pos``, ``attn_bias``,
``layers_execute_order``, ``repeat_blocks``, ``self_attn_kv_residuals``, ``cross_attn_kv_residuals``,
``flash_pack_seq_kwargs`` (both wrappers) and ``transform_block_inputs``, ``rotary_pos_emb``, ``in_attn_cond``,
``deep_embeds_and_ids``, ``self_attn_additional_kv`` & co. (the continuous wrapper; ``TransformerWrapper`` had them).

Each is checked against x-transformers itself: the same keyword call on both wrappers, safeformer's loaded from
x-transformers' (perturbed) weights strictly (and back), outputs and every parameter gradient at the real positions of
a right-padded batch (float32, 1e-5). Safety: NaN at padded inputs reaches no output, log probability or gradient, a
padded sample equals itself alone, and bad values raise errors naming the keyword.

Shape legend: b batch, n positions, c model width, h heads, j context length, L feed-forward blocks.
"""

from __future__ import annotations

import pytest
import torch
import x_transformers as xt
from helpers import perturb_params

import safeformer as sf

DIM, HEADS, DIM_HEAD, VOCAB, CTX = 16, 2, 8, 20, 3
NAN = float("nan")
MASK = torch.tensor([[True] * 7, [True] * 5 + [False] * 2])
CTX_MASK = torch.tensor([[True] * 3, [True, True, False]])
pytestmark = pytest.mark.usefixtures("one_thread")


def _pair(kind: str, layer_opts: dict | None = None, seed: int = 0):
    """``(ours, peer)``: x-transformers' wrapper (``kind`` "tokens" or "continuous") over a stack with ``layer_opts``
    (weights perturbed) and safeformer's from the same keyword call, loaded from it strictly (and back)."""
    lo = dict(dim=DIM, depth=2, heads=HEADS, **(layer_opts or {}))
    causal = lo.pop("causal", True)
    made = []
    for lib, dh in ((xt, "attn_dim_head"), (sf, "dim_head")):
        torch.manual_seed(seed)
        layers = (lib.Decoder if causal else lib.Encoder)(**{dh: DIM_HEAD}, **lo)
        if kind == "tokens":
            made.append(lib.TransformerWrapper(num_tokens=VOCAB, max_seq_len=16, attn_layers=layers))
        else:
            made.append(lib.ContinuousTransformerWrapper(dim_in=5, dim_out=4, max_seq_len=16, attn_layers=layers))
    peer, ours = made
    perturb_params(peer, seed)
    ours.load_state_dict(peer.state_dict(), strict=True)
    peer.load_state_dict(ours.state_dict(), strict=True)
    return ours.eval(), peer.eval()


def _inputs(kind: str, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 7), generator=g) if kind == "tokens" else torch.randn(2, 7, 5, generator=g)


def _hard_softmax(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``F.gumbel_softmax(hard=True)`` without its noise (straight-through one-hot of the softmax)."""
    soft = t.softmax(dim)
    one_hot = torch.zeros_like(soft).scatter_(dim, soft.argmax(dim, keepdim=True), 1.0)
    return one_hot - soft.detach() + soft


def _constant_gumbel(peer, monkeypatch) -> None:
    """The gumbel noise made constant in both libraries (a constant shift of the logits: the hard softmax's pick)."""
    for layer in peer.attn_layers.layers:
        if hasattr(layer[1], "attend"):
            layer[1].attend.attn_fn = _hard_softmax
    monkeypatch.setattr(torch, "rand_like", lambda t, *a, **k: torch.full_like(t, 0.5))


# ---------------------------------------------------------------------------------------------------------------
# return_gumbel_log_probs
# ---------------------------------------------------------------------------------------------------------------

GUMBEL = {"tokens_gumbel": ("tokens", dict(attn_gumbel_softmax=True)),
          "continuous_gumbel": ("continuous", dict(attn_gumbel_softmax=True, attn_kv_heads=1)),
          "tokens_softmax_cross": ("tokens", dict(causal=False, cross_attend=True))}


@pytest.mark.parametrize("case", list(GUMBEL))
def test_return_gumbel_log_probs_through_the_wrapper_matches_x_transformers(case, monkeypatch):
    """x-transformers' wrapper returns what its flags ask for (the logits alone without ``return_intermediates``);
    each attention intermediate then carries ``log_probs (b, h, n)``: equal at the real query rows, with the outputs
    and every parameter gradient of a loss through both."""
    kind, opts = GUMBEL[case]
    ours, peer = _pair(kind, opts, seed=3)
    if opts.get("attn_gumbel_softmax"):
        _constant_gumbel(peer, monkeypatch)
    x = _inputs(kind)
    kw = dict(context=torch.randn(2, CTX, DIM), context_mask=CTX_MASK) if opts.get("cross_attend") else {}
    rows = MASK[:, None, :].expand(2, HEADS, 7)
    res = []
    for model in (ours, peer):
        model.zero_grad()
        plain = model(x, mask=MASK, return_gumbel_log_probs=True, **kw)  # the return form is unchanged
        assert isinstance(plain, torch.Tensor)
        out, inter = model(x, mask=MASK, return_gumbel_log_probs=True, return_intermediates=True, **kw)
        torch.testing.assert_close(out[MASK], plain[MASK])
        lps = [i.log_probs for i in inter.attn_intermediates]
        (out[MASK].sum() + sum(lp[rows].sum() for lp in lps)).backward()
        res.append((out.detach()[MASK], [lp.detach()[rows] for lp in lps],
                    {k: p.grad for k, p in model.named_parameters() if p.grad is not None}))
    assert len(res[0][1]) == (4 if opts.get("cross_attend") else 2)
    assert all(bool((lp < -1e-3).any()) for lp in res[0][1])  # not every pick certain: the test can fail
    assert res[0][2].keys() == res[1][2].keys() and res[0][2]
    torch.testing.assert_close(res[0], res[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["tokens", "continuous"])
def test_return_gumbel_log_probs_padding_and_refusal(kind, monkeypatch):
    """NaN (continuous) or out-of-vocabulary ids (tokens) at padded inputs reach no log probability, output or
    gradient; padded queries pick nothing (0); the padded sample's log probabilities equal its own alone (constant
    gumbel noise, so that both calls draw the same). A non-bool is a ``TypeError`` naming the keyword."""
    monkeypatch.setattr(torch, "rand_like", lambda t, *a, **k: torch.full_like(t, 0.5))
    ours, _ = _pair(kind, dict(attn_gumbel_softmax=True), seed=5)
    x = _inputs(kind, seed=2)
    x = torch.where(MASK, x, 999) if kind == "tokens" else torch.where(MASK[..., None], x, NAN).requires_grad_()
    out, inter = ours(x, mask=MASK, return_gumbel_log_probs=True, return_intermediates=True)
    lps = [i.log_probs for i in inter.attn_intermediates]
    (out[MASK].sum() + sum(lp.sum() for lp in lps)).backward()
    assert torch.isfinite(out[MASK]).all() and all(torch.isfinite(lp).all() for lp in lps)
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)
    if kind == "continuous":
        assert torch.isfinite(x.grad).all() and (x.grad[~MASK] == 0).all()
    assert all((lp[1, :, 5:] == 0).all() and (lp[MASK[:, None].expand(2, HEADS, 7)] < 0).any() for lp in lps)
    with torch.no_grad():
        _, alone = ours(x[1:, :5].detach(), return_gumbel_log_probs=True, return_intermediates=True)
    for lp, lp_alone in zip(lps, (i.log_probs for i in alone.attn_intermediates)):
        torch.testing.assert_close(lp[1:, :, :5].detach(), lp_alone, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="return_gumbel_log_probs"):
        ours(x.detach(), mask=MASK, return_gumbel_log_probs="yes")
    with pytest.raises(TypeError, match="return_gumbel_log_probs"):
        ours(x.detach(), mask=MASK, return_gumbel_log_probs=1)


# ---------------------------------------------------------------------------------------------------------------
# the other stack keywords handed on
# ---------------------------------------------------------------------------------------------------------------

def _kv_mask() -> torch.Tensor:
    """A key mask for self-attention: the padded keys masked too (x-transformers reads this in place of ``mask``),
    some real keys masked, key 0 kept (no dead rows)."""
    keep = torch.tensor([[1, 1, 0, 1, 0, 1, 1], [1, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    return keep & MASK


def _double(obj):
    """``obj`` with every floating-point tensor in it (dicts, lists, tuples) in float64."""
    if isinstance(obj, torch.Tensor):
        return obj.double() if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _double(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_double(v) for v in obj)
    return obj


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# name: (layer options, call keywords, wrappers); tensors built per call
KEYWORDS = {
    "self_attn_kv_mask": ({}, lambda: dict(self_attn_kv_mask=_kv_mask()), ("tokens", "continuous")),
    "attn_bias": ({}, lambda: dict(attn_bias=torch.randn(2, HEADS, 7, 7, generator=_g(4))), ("tokens", "continuous")),
    "context_pos": (dict(causal=False, cross_attend=True, rotary_pos_emb=True),
                    lambda: dict(context=torch.randn(2, CTX, DIM, generator=_g(5)), context_mask=CTX_MASK,
                                 context_pos=torch.tensor([[0, 2, 5], [1, 3, 4]])), ("tokens", "continuous")),
    "layers_execute_order": ({}, lambda: dict(layers_execute_order=(0, 1, 0, 1, 2, 3)), ("tokens", "continuous")),
    "repeat_blocks": ({}, lambda: dict(repeat_blocks=((0, 1), 2)), ("tokens", "continuous")),
    "self_attn_kv_residuals": ({}, lambda: dict(self_attn_kv_residuals=torch.randn(2, 7, DIM, generator=_g(6))),
                               ("tokens", "continuous")),
    "cross_attn_kv_residuals": (dict(causal=False, cross_attend=True),
                                lambda: dict(context=torch.randn(2, CTX, DIM, generator=_g(7)), context_mask=CTX_MASK,
                                             cross_attn_kv_residuals=torch.randn(2, CTX, DIM, generator=_g(8))),
                                ("tokens", "continuous")),
    "transform_block_inputs": ({}, lambda: dict(transform_block_inputs={1: torch.sin, 2: lambda t: t * 1.5 + 0.1}),
                               ("continuous",)),
    "rotary_pos_emb": ({}, lambda: dict(rotary_pos_emb=(torch.randn(1, 7, 4, generator=_g(9)), 1.0)), ("continuous",)),
    "in_attn_cond": ({}, lambda: dict(in_attn_cond=torch.randn(2, DIM, generator=_g(10))), ("continuous",)),
    "deep_embeds_and_ids": ({}, lambda: dict(deep_embeds_and_ids=(
        1 + 0.5 * torch.randn(VOCAB, 2, DIM, generator=_g(11)), torch.randint(0, VOCAB, (2, 7), generator=_g(12)))),
        ("continuous",)),
    "self_attn_additional_kv": ({}, lambda: dict(
        self_attn_additional_kv=[tuple(torch.randn(2, HEADS, 3, DIM_HEAD, generator=_g(13 + i)) for i in range(2))],
        additional_kv_mask=torch.tensor([[True, True, False], [True, False, True]]), route_additional_kv_to_top=False),
        ("continuous",)),
}
CASES = [(name, kind) for name, (_, _, kinds) in KEYWORDS.items() for kind in kinds]


@pytest.mark.parametrize("name,kind", CASES, ids=[f"{k}-{n}" for n, k in CASES])
def test_stack_keyword_through_the_wrapper_matches_x_transformers(name, kind):
    """The keyword reaches the stack as x-transformers' wrapper hands it on: the outputs and every parameter gradient
    at the real positions equal x-transformers', and differ from the call without it (the test can fail). Float64:
    the summed embedding gradients of the deeper runs (``repeat_blocks``) round past 1e-5 in float32."""
    opts, make, _ = KEYWORDS[name]
    ours, peer = (m.double() for m in _pair(kind, opts, seed=2))
    x, call = _double(_inputs(kind)), _double(make())
    base = {k: v for k, v in call.items() if k in ("context", "context_mask")}
    weight = torch.randn(2, 7, VOCAB if kind == "tokens" else 4, generator=_g(20), dtype=torch.float64)
    res = []
    for model in (ours, peer):
        model.zero_grad()
        out = model(x, mask=MASK, **call)
        (out[MASK] * weight[MASK]).sum().backward()
        res.append((out.detach()[MASK], {k: p.grad for k, p in model.named_parameters() if p.grad is not None}))
    with torch.no_grad():
        without = ours(x, mask=MASK, **base)
    assert not torch.allclose(without[MASK], res[0][0], atol=1e-4)
    assert res[0][1].keys() == res[1][1].keys() and res[0][1]
    torch.testing.assert_close(res[0], res[1], atol=1e-5, rtol=1e-5)


def test_continuous_padding_with_stack_keywords_reaches_nothing():
    """NaN at the padded inputs and at the padded rows of what the keywords hold (residuals, in-attention condition)
    reaches no output and no gradient; the padded sample equals itself alone."""
    ours, _ = _pair("continuous", {}, seed=6)
    x = torch.where(MASK[..., None], _inputs("continuous", seed=3), NAN).requires_grad_()
    res = torch.where(MASK[..., None], torch.randn(2, 7, DIM, generator=_g(30)), NAN)
    cond = torch.where(MASK[..., None], torch.randn(2, 7, DIM, generator=_g(31)), NAN)
    bias = torch.randn(2, HEADS, 7, 7, generator=_g(32))
    kw = dict(self_attn_kv_residuals=res, in_attn_cond=cond, attn_bias=bias, layers_execute_order=(0, 1, 0, 1, 2, 3))
    out = ours(x, mask=MASK, **kw)
    out[MASK].sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all() and (x.grad[~MASK] == 0).all()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)
    with torch.no_grad():
        alone = ours(x[1:, :5].detach(), self_attn_kv_residuals=res[1:, :5], in_attn_cond=cond[1:, :5],
                     attn_bias=bias[1:, :, :5, :5], layers_execute_order=(0, 1, 0, 1, 2, 3))
    torch.testing.assert_close(out[1, :5].detach(), alone[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["tokens", "continuous"])
def test_flash_pack_seq_kwargs_pack_documents(kind):
    """``flash_pack_seq_kwargs`` (x-transformers runs it on flash-attn, CUDA only): one sequence of documents through
    the wrapper equals each document alone (no absolute positions); positions after the last document are dead."""
    torch.manual_seed(0)
    layers = sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, attn_flash_pack_seq=True)
    model = perturb_params(sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=16, attn_layers=layers,
                                                 use_abs_pos_emb=False) if kind == "tokens" else
                           sf.ContinuousTransformerWrapper(dim_in=5, dim_out=4, attn_layers=layers), 1).eval()
    x = _inputs(kind, seed=4)[:1]
    cu = torch.tensor([0, 2, 6])
    out = model(x, flash_pack_seq_kwargs=dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4))
    ref = torch.cat([model(x[:, a:b]) for a, b in ((0, 2), (2, 6))], dim=1)
    torch.testing.assert_close(out[:, :6], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["tokens", "continuous"])
def test_polar_pos_emb_reaches_the_stack_and_bad_values_are_named(kind):
    """x-transformers' ``polar_pos_emb`` (PoPE angles, ``PolarEmbedding.forward``'s form) reaches every
    self-attention through the wrapper: x-transformers' numbers (tests/test_xt_polar_call.py has the rest);
    ``flash_pack_seq_context_kwargs`` reaches the stack too (tests/test_flash_pack_seq.py). Bad values are errors
    naming them; a keyword neither library has stays a ``TypeError``."""
    from x_transformers.x_transformers import PolarEmbedding as XPolar

    ours, peer = _pair(kind)
    x = _inputs(kind)
    ours(x, polar_pos_emb=None, flash_pack_seq_context_kwargs=None)
    torch.manual_seed(2)
    pope = XPolar(DIM_HEAD, HEADS)
    with torch.no_grad():
        pope.learned_bias.uniform_(-6.0, 0.0)
        angles = pope(torch.arange(9) * 2)
        got, want = (m(x, mask=MASK, polar_pos_emb=angles) for m in (ours, peer))
        torch.testing.assert_close(got[MASK], want[MASK], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(got[MASK], ours(x, mask=MASK)[MASK])
    for name, value in (("polar_pos_emb", torch.zeros(1)), ("flash_pack_seq_context_kwargs", {})):
        with pytest.raises(TypeError, match=name):
            ours(x, **{name: value})
    with pytest.raises(TypeError, match="not_a_keyword"):
        ours(x, not_a_keyword=1)
