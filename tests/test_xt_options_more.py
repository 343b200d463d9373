"""More of x-transformers' attention options in safeformer: ``attn_qk_norm_dim_scale`` (per-head q/k norm
gains), ``attn_value_rmsnorm`` (per-head value norms) and ``attn_orthog_projected_values`` /
``_per_head`` ("belief attention": the output minus its projection onto the sequence's own values).

Each option is checked against a float64 formula written out here, against x-transformers on the same
weights (``from_x_transformers``), and for the contract: NaN planted at padded positions reaches nothing,
padded rows are exact zeros, and what cannot run (a KV cache with the orthogonal projection) is refused
with a clear error. The S1-S9 suite runs the cases ``Decoder-headnorms`` and ``Encoder-orthog``
(``helpers.models.CASES``).
"""

from __future__ import annotations

import pytest
import torch

import safeformer as sf
from safeformer.decoding.static import static_reason

NAN = float("nan")
xt = pytest.importorskip("x_transformers")

MASK = torch.tensor([[True, True, True, True, False, False], [False, True, True, True, True, True],
                     [True] * 6])


def _perturb(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _formula(attn: sf.Attention, x: torch.Tensor, real: torch.Tensor, causal: bool,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """float64, written out: x-transformers' qk-norm (L2 per head, times the learned per-head scales), value RMS norm
    with gains ``1 + gamma``, softmax attention over the real keys (query head ``n`` reading key head ``n % h_kv``),
    the output projected off the real values (over the whole sample), then ``to_out``. Padded rows are 0."""
    P = {n: p.detach().double() for n, p in attn.named_parameters()}
    x = x.double()
    b, n, _ = x.shape
    h, hk, d = attn.heads, attn.kv_heads, attn.dim_head
    eps = attn.v_norm.eps if attn.v_norm is not None else 0.0

    def lin(name, t):
        y = t @ P[f"{name}.weight"].T
        return y + P[f"{name}.bias"] if f"{name}.bias" in P else y

    def rms(t):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps)

    q = lin("to_q", x).view(b, n, h, d)
    k = lin("to_k", x).view(b, n, hk, d)
    v = lin("to_v", x).view(b, n, hk, d)
    if attn.q_norm is not None:  # (h, 1, d) scales: per head, per feature
        q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12) * P["qk_norm_q_scale"][:, 0]
        k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12) * P["qk_norm_k_scale"][:, 0]
    if residual is not None:  # (b, h_kv, n, d): lerp towards v by sigmoid(Linear(x)) per position and head
        mix = torch.sigmoid(lin("to_value_residual_mix.0", torch.where(real[..., None], x, 0.0)))[..., None]
        v = residual.double().transpose(1, 2) + mix * (v - residual.double().transpose(1, 2))
    if attn.v_norm is not None:
        v = rms(v) * (1 + P["value_rmsnorm.gamma"][:, 0])
    g = h // hk
    k, v = k.repeat(1, 1, g, 1), v.repeat(1, 1, g, 1)  # query head n uses kv head n % h_kv (x-transformers')
    logits = torch.einsum("bihd,bjhd->bhij", q, k) * d**-0.5
    allowed = real[:, None, None, :].expand(b, h, n, n)
    if causal:
        allowed = allowed & torch.ones(n, n, dtype=torch.bool).tril()
    logits = logits.masked_fill(~allowed, float("-inf"))
    w = torch.nan_to_num(logits.softmax(-1), nan=0.0)
    out = torch.einsum("bhij,bjhd->bihd", w, v)  # (b, n, h, d)
    out = torch.where(real[:, :, None, None], out, 0.0)
    if attn.orthog:
        vr = torch.where(real[:, :, None, None], v, 0.0).reshape(b, -1)
        o = out.reshape(b, -1)
        unit = vr / vr.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        o = (o - (o * unit).sum(-1, keepdim=True) * unit).reshape(b, n, h * d)
        parts = int(attn.orthog_projected_values) + int(attn.orthog_projected_values_per_head)
        flat = torch.cat([o] * parts, dim=-1)
    else:
        flat = out.reshape(b, n, h * d)
    y = lin("to_out", flat)
    return torch.where(real[:, :, None], y, 0.0)


OPTIONS = [
    dict(qk_norm=True, qk_norm_dim_scale=True),
    dict(value_rmsnorm=True),
    dict(qk_norm=True, qk_norm_dim_scale=True, value_rmsnorm=True),
    dict(orthog_projected_values=True),
    dict(orthog_projected_values_per_head=True, qk_norm=True, qk_norm_dim_scale=True),
    dict(orthog_projected_values=True, orthog_projected_values_per_head=True),
]
IDS = ["qk-dim-scale", "value-rmsnorm", "both-norms", "orthog", "orthog-per-head+qk", "orthog-both"]


@pytest.mark.parametrize("opts", OPTIONS, ids=IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_options_match_float64_formula_and_ignore_padding(opts, causal, dtype):
    """Each option equals the written-out float64 formula at real positions; padded positions are exact
    zeros; NaN planted at padded positions changes nothing and gets zero gradient (projection biases on,
    so a padded position's value would be the bias: it must still add nothing)."""
    torch.manual_seed(0)
    attn = _perturb(sf.Attention(16, heads=4, dim_head=8, kv_heads=2, bias=True, **opts))
    x = torch.randn(3, 6, 16)
    want = _formula(attn, x, MASK, causal)
    attn = attn.to(dtype)
    planted = x.clone()
    planted[~MASK] = NAN
    planted = planted.to(dtype).requires_grad_()
    out = attn(planted, mask=MASK, causal=causal)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    assert bool((out[~MASK] == 0).all())
    out.square().sum().backward()
    assert bool(torch.isfinite(planted.grad).all()) and bool((planted.grad[~MASK] == 0).all())
    assert all(bool(torch.isfinite(p.grad).all()) for p in attn.parameters() if p.grad is not None)


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_learned_value_residual_mix_matches_float64_formula(causal):
    """``value_residual=`` mixes into the new values ``lerp(residual, v, sigmoid(Linear(x)))``; NaN at padded
    positions of x changes nothing (the residual there is finite, as the stack's own values are)."""
    torch.manual_seed(4)
    attn = _perturb(sf.Attention(16, heads=4, dim_head=8, kv_heads=2, bias=True, learned_value_residual_mix=True))
    x = torch.randn(3, 6, 16)
    residual = torch.randn(3, 2, 6, 8)
    want = _formula(attn, x, MASK, causal, residual)
    planted = x.clone()
    planted[~MASK] = NAN
    planted.requires_grad_()
    out = attn(planted, mask=MASK, causal=causal, value_residual=residual)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    out.square().sum().backward()
    assert bool(torch.isfinite(planted.grad).all()) and bool((planted.grad[~MASK] == 0).all())
    with pytest.raises(ValueError, match="value_residual must have"):
        attn(x, value_residual=residual[:, :1])


def test_value_residual_stack_decodes_with_the_cache_as_without_and_refuses_what_it_cannot_run():
    """Every later attention mixes the first one's values; cached generation (the decode step: the first
    self-attention's new values reach the others) equals the uncached recompute, with and without a context."""
    torch.manual_seed(5)
    net = _perturb(sf.TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=sf.Decoder(
        dim=16, depth=3, heads=2, dim_head=8, cross_attend=True, add_value_residual=True))).eval()
    assert static_reason(net) is None
    ar = sf.AutoregressiveWrapper(net)
    prompt, ctx = torch.randint(0, 20, (2, 3)), torch.randn(2, 4, 16)
    a = ar.generate(prompt, 5, context=ctx, temperature=0.0)
    b = ar.generate(prompt, 5, context=ctx, temperature=0.0, cache_kv=False)
    assert torch.equal(a, b)
    for bad in (dict(attn_value_rmsnorm=True), dict(checkpoint_layers=True), dict(unpadded=True)):
        with pytest.raises(ValueError, match="add_value_residual"):
            sf.Decoder(dim=16, depth=2, heads=2, dim_head=8, add_value_residual=True, **bad)


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_data_dependent_alibi_matches_float64_formula(causal):
    """The forget-gate bias: ``F = cumsum(logsigmoid(Linear(x)))`` over the real positions only, the bias
    ``F[i] - F[j]`` (and ``R[j] - R[i]`` above the diagonal without ``causal``); padded rows 0, NaN there
    reaches nothing."""
    torch.manual_seed(6)
    attn = _perturb(sf.Attention(16, heads=4, dim_head=8, kv_heads=2, causal=causal, data_dependent_alibi=True,
                                 data_dependent_alibi_kwargs=dict(post_log_scale=0.7)))
    x = torch.randn(3, 6, 16)
    P = {n: p.detach().double() for n, p in attn.named_parameters()}
    xd = torch.where(MASK[..., None], x.double(), 0.0)
    g = torch.nn.functional.logsigmoid(xd @ P["data_dependent_alibi.to_forget_gates.0.weight"].T
                                       + P["data_dependent_alibi.to_forget_gates.0.bias"]) * 0.7
    g = torch.where(MASK[..., None], g, 0.0).transpose(1, 2).cumsum(-1)
    bias = []
    for b in range(3):  # written out per pair: the sum of the real gates strictly after j up to i (or the reverse)
        f = g[b]
        rows = torch.zeros(4, 6, 6, dtype=torch.float64)
        for qi in range(6):
            for kj in range(6):
                if causal or qi >= kj:
                    rows[:, qi, kj] = f[:4, qi] - f[:4, kj]
                else:
                    rows[:, qi, kj] = f[4:, kj] - f[4:, qi]
        bias.append(rows)
    bias = torch.stack(bias)
    want = hp_ref(attn, x, bias, causal)
    planted = x.clone()
    planted[~MASK] = NAN
    planted.requires_grad_()
    out = attn(planted, mask=MASK, causal=causal)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    assert bool((out[~MASK] == 0).all())
    out.square().sum().backward()
    assert bool(torch.isfinite(planted.grad).all()) and bool((planted.grad[~MASK] == 0).all())
    assert bool(torch.isfinite(attn.to_forget_gates.weight.grad).all())


def hp_ref(attn: sf.Attention, x: torch.Tensor, bias: torch.Tensor, causal: bool) -> torch.Tensor:
    """float64 attention with ``attn``'s projections and an additive ``bias (b, h, i, j)`` over the real keys."""
    P = {n: p.detach().double() for n, p in attn.named_parameters()}
    b, n, _ = x.shape
    h, hk, d = attn.heads, attn.kv_heads, attn.dim_head
    x = x.double()
    q = (x @ P["to_q.weight"].T).view(b, n, h, d)
    k = (x @ P["to_k.weight"].T).view(b, n, hk, d).repeat(1, 1, h // hk, 1)  # query head n: key head n % h_kv
    v = (x @ P["to_v.weight"].T).view(b, n, hk, d).repeat(1, 1, h // hk, 1)
    logits = torch.einsum("bihd,bjhd->bhij", q, k) * d**-0.5 + bias
    allowed = MASK[:, None, None, :].expand(b, h, n, n)
    if causal:
        allowed = allowed & torch.ones(n, n, dtype=torch.bool).tril()
    w = torch.nan_to_num(logits.masked_fill(~allowed, float("-inf")).softmax(-1), nan=0.0)
    out = torch.einsum("bhij,bjhd->bihd", w, v).reshape(b, n, h * d) @ P["to_out.weight"].T
    return torch.where(MASK[..., None], out, 0.0)


def test_data_dependent_alibi_refuses_a_cache_cross_attention_and_alibi():
    dec = sf.Decoder(dim=16, depth=1, heads=2, dim_head=8, cross_attend=True, attn_data_dependent_alibi=True)
    assert dec.layers[0].mixer.to_forget_gates is not None and dec.layers[1].mixer.to_forget_gates is None
    x, ctx = torch.randn(2, 4, 16), torch.randn(2, 3, 16)
    _, cache = dec(x, context=ctx, return_cache=True)
    with pytest.raises(ValueError, match="cache_kv=False"):
        dec(x[:, :1], cache=cache)
    net = sf.TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=sf.Decoder(
        dim=16, depth=1, heads=2, dim_head=8, attn_data_dependent_alibi=True))
    assert "data_dependent_alibi" in static_reason(net)
    assert sf.AutoregressiveWrapper(net).generate(torch.randint(0, 20, (2, 3)), 2, cache_kv=False).shape == (2, 2)
    with pytest.raises(ValueError, match="data_dependent_alibi"):
        sf.Decoder(dim=16, depth=1, heads=2, dim_head=8, attn_data_dependent_alibi=True, unpadded=True)
    with pytest.raises(ValueError, match="alibi_pos_bias"):
        sf.Decoder(dim=16, depth=1, heads=2, dim_head=8, attn_data_dependent_alibi=True, alibi_pos_bias=True)
    with pytest.raises(ValueError, match="data_dependent_alibi_kwargs"):
        sf.Attention(16, heads=2, dim_head=8, data_dependent_alibi=True, data_dependent_alibi_kwargs=dict(scale=2))
    with pytest.raises(ValueError, match="self-attention"):
        sf.Attention(16, heads=2, dim_head=8, data_dependent_alibi=True)(x, ctx)


def test_qk_norm_dim_scale_initial_logits_are_cosine_similarities():
    """At init the scales are ``d ** 0.25``: with the ``d ** -0.5`` logit scale the logit is the cosine similarity of
    q and k (x-transformers' ``qk_norm_dim_scale``: ``qk_norm_q_scale (h, 1, d)``, ``qk_norm_k_scale (h_kv, 1, d)``)."""
    attn = sf.Attention(16, heads=2, dim_head=16, qk_norm=True, qk_norm_dim_scale=True)
    assert attn.qk_norm_q_scale.shape == (2, 1, 16) and attn.qk_norm_k_scale.shape == (2, 1, 16)
    assert bool((attn.qk_norm_q_scale == 16**0.25).all())
    q = torch.randn(3, 2, 16)
    k = torch.randn(3, 2, 16)
    logit = (attn.norm_q(q) * attn.norm_k(k)).sum(-1) * 16**-0.5
    torch.testing.assert_close(logit, torch.nn.functional.cosine_similarity(q, k, dim=-1), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="qk_norm_eps"):  # a floor of 0 would divide a zero row by 0
        sf.Attention(16, heads=2, dim_head=16, qk_norm=True, qk_norm_eps=0.0)


XT_CASES = [
    dict(attn_qk_norm=True, attn_qk_norm_dim_scale=True, attn_kv_heads=2),
    dict(attn_qk_norm=True, attn_qk_norm_dim_scale=True, attn_num_mem_kv=2),
    dict(attn_value_rmsnorm=True),
    dict(attn_value_rmsnorm=True, attn_qk_norm=True, attn_qk_norm_dim_scale=True),
    dict(attn_orthog_projected_values=True, attn_kv_heads=2),
    dict(attn_orthog_projected_values_per_head=True),
    dict(attn_orthog_projected_values=True, attn_orthog_projected_values_per_head=True, attn_kv_heads=2),
    dict(add_value_residual=True),
    dict(add_value_residual=True, learned_value_residual_mix=False, attn_kv_heads=2),
    dict(add_value_residual=True, cross_attend=True),
    dict(attn_data_dependent_alibi=True),
    dict(attn_data_dependent_alibi=True, attn_num_mem_kv=1, attn_kv_heads=2),
    dict(attn_data_dependent_alibi=True, encoder=True),
]


@pytest.mark.parametrize("opts", XT_CASES, ids=[",".join(k.removeprefix("attn_") for k, v in c.items() if k != "attn_kv_heads"
                                                        and v is True) for c in XT_CASES])
def test_from_x_transformers_gives_equal_outputs(opts):
    """A converted x-transformers model gives its logits (float32, trained-looking gains and scales)."""
    torch.manual_seed(1)
    opts = dict(opts)
    cls = xt.Encoder if opts.pop("encoder", False) else xt.Decoder
    peer = xt.TransformerWrapper(num_tokens=50, max_seq_len=32, attn_layers=cls(
        dim=32, depth=2, heads=4, attn_dim_head=8, rotary_pos_emb=True, rotary_emb_dim=8, **opts)).eval()
    with torch.no_grad():
        for name, p in peer.named_parameters():
            if "scale" in name or "gamma" in name or "forget" in name:
                p.add_(0.3 * torch.randn_like(p))
    ours = sf.from_x_transformers(peer).eval()
    x = torch.randint(0, 50, (2, 9))
    ctx = torch.randn(2, 5, 32) if opts.get("cross_attend") else None
    with torch.no_grad():
        torch.testing.assert_close(ours(x, context=ctx), peer(x, context=ctx), atol=1e-5, rtol=1e-5)


def test_value_rmsnorm_with_grouped_heads_is_refused_by_the_converter():
    peer = xt.TransformerWrapper(num_tokens=20, max_seq_len=8, attn_layers=xt.Decoder(
        dim=16, depth=1, heads=4, attn_dim_head=8, attn_kv_heads=1, attn_value_rmsnorm=True))
    with pytest.raises(ValueError, match="attn_value_rmsnorm with grouped"):
        sf.from_x_transformers(peer)


def test_orthog_refuses_a_cache_cross_attention_and_the_packed_path():
    """The projection covers the whole sequence: a KV cache would project the new positions alone (cached
    would differ from uncached), so continuing a cache is refused, generation recomputes each step instead,
    the static step names the reason, and ``unpadded=True`` is refused. Cross-attention blocks of a
    stack do not project (their values are the context's); ``Attention`` with a context refuses."""
    dec = sf.Decoder(dim=16, depth=1, heads=2, dim_head=8, cross_attend=True, attn_orthog_projected_values=True)
    assert dec.layers[0].mixer.orthog and not dec.layers[1].mixer.orthog
    x, ctx = torch.randn(2, 4, 16), torch.randn(2, 3, 16)
    _, cache = dec(x, context=ctx, return_cache=True)
    with pytest.raises(ValueError, match="cache_kv=False"):
        dec(x[:, :1], cache=cache)
    net = sf.TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=sf.Decoder(
        dim=16, depth=1, heads=2, dim_head=8, attn_orthog_projected_values=True))
    assert "orthog" in static_reason(net)
    ar = sf.AutoregressiveWrapper(net)
    prompt = torch.randint(0, 20, (2, 3))
    assert not net.can_cache_kv  # generation recomputes each step: the tokens of cache_kv=False
    assert torch.equal(ar.generate(prompt, 2, temperature=0.0), ar.generate(prompt, 2, temperature=0.0, cache_kv=False))
    with pytest.raises(ValueError, match="orthog"):
        sf.Decoder(dim=16, depth=1, heads=2, dim_head=8, attn_orthog_projected_values=True, unpadded=True)
    attn = sf.Attention(16, heads=2, dim_head=8, orthog_projected_values=True)
    with pytest.raises(ValueError, match="self-attention"):
        attn(x, ctx)


def test_bad_combinations_raise_clear_errors():
    with pytest.raises(ValueError, match="qk_norm=True"):
        sf.Attention(16, heads=2, dim_head=8, qk_norm_dim_scale=True)
    with pytest.raises(ValueError, match="value_rmsnorm"):
        sf.Attention(16, heads=2, dim_head=8, value_rmsnorm=True, orthog_projected_values=True)
    with pytest.raises(ValueError, match="qk_norm=True"):
        sf.Encoder(dim=16, depth=1, heads=2, dim_head=8, attn_qk_norm_dim_scale=True)


def test_head_norms_decode_with_the_cache_as_without():
    """Per-head q/k and value norms run on every path: cached (dynamic and static) generation equals the
    uncached recompute."""
    torch.manual_seed(3)
    net = _perturb(sf.TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=sf.Decoder(
        dim=16, depth=2, heads=4, dim_head=8, kv_heads=2, attn_qk_norm=True, attn_qk_norm_dim_scale=True,
        attn_value_rmsnorm=True, attn_num_mem_kv=1))).eval()
    ar = sf.AutoregressiveWrapper(net)
    prompt = torch.randint(0, 20, (2, 3))
    a = ar.generate(prompt, 5, temperature=0.0, cache_kv=True)
    b = ar.generate(prompt, 5, temperature=0.0, cache_kv=False)
    assert torch.equal(a, b)
    net2 = _perturb(sf.TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=sf.Decoder(
        dim=16, depth=2, heads=4, dim_head=8, attn_qk_norm=True, attn_qk_norm_dim_scale=True,
        attn_value_rmsnorm=True))).eval()
    assert static_reason(net2) is None
    ar2 = sf.AutoregressiveWrapper(net2)
    assert torch.equal(ar2.generate(prompt, 5, temperature=0.0), ar2.generate(prompt, 5, temperature=0.0, cache_kv=False))


def test_context_pos_matches_x_transformers_and_keeps_masked_context_out():
    """``context_pos`` rotates cross-attention (queries by the tokens' positions, keys by the context's), as
    x-transformers does on the same weights; NaN at masked context positions reaches nothing, a dropped
    context is an exact no-op, and what it cannot run is refused."""
    torch.manual_seed(7)
    peer = xt.TransformerWrapper(num_tokens=50, max_seq_len=32, attn_layers=xt.Encoder(
        dim=32, depth=2, heads=4, attn_dim_head=8, rotary_pos_emb=True, cross_attend=True,
        cross_attn_dim_context=24)).eval()
    ours = sf.from_x_transformers(peer).eval().attn_layers
    x, ctx = torch.randn(2, 7, 32), torch.randn(2, 5, 24)
    for pos, cpos in ((None, torch.arange(5)), (torch.arange(7), torch.arange(5)[None] + 3)):
        with torch.no_grad():
            torch.testing.assert_close(ours(x, context=ctx, pos=pos, context_pos=cpos),
                                       peer.attn_layers(x, context=ctx, pos=pos, context_pos=cpos), atol=1e-5, rtol=1e-5)
    cmask = torch.tensor([[True, True, True, False, False], [False] * 5])
    planted = ctx.clone()
    planted[~cmask] = NAN
    planted.requires_grad_()
    cpos = torch.arange(5)
    out = ours(x, context=planted, context_mask=cmask, context_pos=cpos)
    want = ours(x, context=ctx, context_mask=cmask, context_pos=cpos)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(out[1], ours(x[1:], context=ctx[1:, :0])[0])  # dropped context: no cross branch
    out.square().sum().backward()
    assert bool(torch.isfinite(planted.grad).all()) and bool((planted.grad[~cmask] == 0).all())
    with pytest.raises(ValueError, match="KV cache"):
        ours(x, context=ctx, context_pos=cpos, return_cache=True)
    with pytest.raises(ValueError, match="context_pos"):
        ours(x, context_pos=cpos)
    with pytest.raises(ValueError, match="positions"):
        ours(x, context=ctx, context_pos=torch.arange(4))
    with pytest.raises(ValueError, match="rotary_pos_emb"):
        sf.Encoder(dim=16, depth=1, heads=2, dim_head=8, cross_attend=True)(
            torch.randn(1, 3, 16), context=torch.randn(1, 2, 16), context_pos=torch.arange(2))


def test_ff_softclamp_value_matches_formula_and_x_transformers():
    """``ff_softclamp_value``: ``act(tanh(h / v) * v)`` on the hidden layer (float64 formula), converted from
    x-transformers with equal outputs; with ``glu`` (which x-transformers ignores) it is built with a warning."""
    torch.manual_seed(8)
    ff = _perturb(sf.FeedForward(8, mult=2, softclamp_value=0.5)).double()
    x = torch.randn(3, 8, dtype=torch.float64) * 3
    h = x @ ff.proj_in.weight.T + ff.proj_in.bias
    want = torch.nn.functional.gelu(torch.tanh(h / 0.5) * 0.5) @ ff.proj_out.weight.T + ff.proj_out.bias
    torch.testing.assert_close(ff(x), want)
    peer = xt.TransformerWrapper(num_tokens=50, max_seq_len=32, attn_layers=xt.Decoder(
        dim=32, depth=2, heads=4, attn_dim_head=8, ff_softclamp_value=0.3)).eval()
    ours = sf.from_x_transformers(peer).eval()
    tokens = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), peer(tokens), atol=1e-5, rtol=1e-5)
    with pytest.warns(UserWarning, match="glu"):  # x-transformers ignores it with glu: built, with a warning
        sf.Decoder(dim=16, depth=1, heads=2, dim_head=8, ff_glu=True, ff_softclamp_value=5.0)
    with pytest.raises(ValueError, match="softclamp_value"):
        sf.FeedForward(8, softclamp_value=-1.0)


def test_rotary_xpos_needs_a_causal_stack():
    sf.Decoder(dim=16, depth=1, heads=2, dim_head=8, rotary_pos_emb=True, rotary_xpos=True)
    with pytest.raises(ValueError, match="rotary_xpos"):
        sf.Encoder(dim=16, depth=1, heads=2, dim_head=8, rotary_pos_emb=True, rotary_xpos=True)


def test_dynamic_tanh_matches_formula_and_x_transformers():
    """``use_dynamic_tanh``: every norm is ``tanh(a * x) * gamma + beta`` (float64 formula); x-transformers'
    models convert with equal outputs, their unit offsets (``norm_add_unit_offset``) folded in; padded
    positions stay out (a sample alone equals it left-padded)."""
    torch.manual_seed(9)
    norm = _perturb(sf.nn.modules.DynamicTanh(8, init_alpha=0.7)).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(norm(x), torch.tanh(norm.pre_tanh_scale * x) * norm.gamma + norm.beta)
    for kw in (dict(), dict(norm_add_unit_offset=False, dynamic_tanh_init_alpha=0.5)):
        peer = xt.TransformerWrapper(num_tokens=50, max_seq_len=32, attn_layers=xt.Decoder(
            dim=32, depth=2, heads=4, attn_dim_head=8, use_dynamic_tanh=True, **kw)).eval()
        _perturb(peer)
        ours = sf.from_x_transformers(peer).eval()
        tokens = torch.randint(0, 50, (2, 9))
        with torch.no_grad():
            torch.testing.assert_close(ours(tokens), peer(tokens), atol=1e-5, rtol=1e-5)
            mask = torch.tensor([[False, False] + [True] * 7, [True] * 9])
            torch.testing.assert_close(ours(tokens, mask=mask)[0, 2:], ours(tokens[:1, 2:])[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="use_dynamic_tanh"):
        sf.Decoder(dim=16, depth=1, heads=2, dim_head=8, use_dynamic_tanh=True, use_rmsnorm=True)
