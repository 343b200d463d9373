"""Tests for ``safeformer.research.xval``: the xVal embedding and loss against float64 references in plain code,
the safety contract (padding with fully padded samples, NaN/inf in ``x_num`` wherever it is not read,
garbage ids at padded positions, NaN/inf at masked context slots, all-ignored batches), guided
generation (one batched forward equals the formula over separate passes, cached equals uncached), named
errors, and parity with x-transformers' xval module on converted weights."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, assert_finite, assert_zero

import safeformer as sf
from safeformer.research.xval import (
    GenerateReturn,
    XValAutoregressiveWrapper,
    XValTransformerWrapper,
    xval_from_x_transformers,
)

V, NUM, B, N, D = 10, 9, 4, 7, 16
VALUES = [float("nan"), float("inf"), -float("inf"), 1e4]


def make(seed: int = 0, dtype=torch.float32, cross: bool = False, **kw) -> XValTransformerWrapper:
    torch.manual_seed(seed)
    net = XValTransformerWrapper(num_tokens=V, max_seq_len=16, numerical_token_id=NUM, attn_layers=sf.Decoder(
        dim=D, depth=2, heads=2, dim_head=8, cross_attend=cross), **kw)
    return net.to(dtype)


def data(seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, N), generator=g)
    x[:, 1::2] = NUM  # plenty of numbers
    x_num = torch.randn(B, N, generator=g, dtype=dtype)
    mask = torch.arange(N)[None] < torch.tensor([0, 3, 5, N])[:, None]  # sample 0 fully padded
    return x, x_num, mask


def ref_loss(net, x, x_num, mask, ignore_index=-100, weight=1.0):
    """Float64 loss by hand: each sample's real tokens alone, sum of CE + w * MSE over the counted targets."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for i in range(x.shape[0]):
        n = int(mask[i].sum())
        if n < 2:
            continue
        xi, ni = x[i, :n], x_num[i, :n].double()
        emb = net.token_emb.weight.double()[xi] * torch.where(xi == NUM, ni, 1.0)[:, None]
        h = net.net(emb[None, :-1].to(net.token_emb.weight.dtype), return_embeddings=True)
        logits, num = net.heads(h)
        lp = logits[0].double().log_softmax(-1)
        for t in range(n - 1):
            if xi[t + 1] == ignore_index:
                continue
            loss = -lp[t, xi[t + 1]]
            if xi[t + 1] == NUM:
                loss = loss + weight * (num[0, t].double() - ni[t + 1]) ** 2
            total, count = total + loss, count + 1
    return total / max(count, 1)


def test_embedding_matches_float64_formula():
    net = make(dtype=torch.float64)
    x, x_num, mask = data(dtype=torch.float64)
    emb = net.embed(x, x_num, mask)
    want = net.token_emb.weight[torch.where(mask, x, 0)] * torch.where((x == NUM) & mask, x_num, 1.0)[..., None]
    assert_close(emb, want, "embedding", torch.float64)


def test_loss_matches_float64_reference():
    net = make(dtype=torch.float64)
    model = XValAutoregressiveWrapper(net, numerical_loss_weight=0.5)
    x, x_num, mask = data(1, torch.float64)
    got = model(x, x_num, mask=mask)
    assert_close(got, ref_loss(net, x, x_num, mask, weight=0.5), "xval loss", torch.float64)
    loss, parts = model(x, x_num, mask=mask, return_loss_breakdown=True)
    counted = mask[:, 1:] & mask[:, :-1]
    assert_zero(parts.cross_entropy_loss[~counted], "CE at uncounted targets")
    assert_zero(parts.numerical_mse_loss[~(counted & (x[:, 1:] == NUM))], "MSE where no number is counted")


@pytest.mark.parametrize("value", VALUES)
def test_garbage_where_not_read_reaches_nothing(value):
    """``value`` in ``x_num`` at non-number and padded positions, garbage ids at padded positions and
    ``value`` at masked context slots: the same loss and gradients, all finite; outputs at real positions
    unchanged."""
    net = make(cross=True)
    model = XValAutoregressiveWrapper(net)
    x, x_num, mask = data(2)
    g = torch.Generator().manual_seed(3)
    ctx = torch.randn(B, 3, D, generator=g)
    ctx_mask = torch.tensor([[True, False, True], [False] * 3, [True] * 3, [True, True, False]])
    not_read = ~((x == NUM) & mask)

    def run(x_, xn, c):
        xn, c = xn.clone().requires_grad_(), c.clone().requires_grad_()
        net.zero_grad()
        loss = model(x_, xn, mask=mask, context=c, context_mask=ctx_mask)
        loss.backward()
        out = net(x_, xn.detach(), mask=mask, context=c.detach(), context_mask=ctx_mask)
        return loss, xn.grad, c.grad, [p.grad.clone() for p in net.parameters()], out

    clean = run(x, x_num, ctx)
    dirty = run(torch.where(mask, x, 10**6), x_num.masked_fill(not_read, value), ctx.masked_fill(~ctx_mask[..., None], value))
    assert_finite(dirty[0], "loss")
    assert torch.equal(clean[0], dirty[0])
    assert_finite(dirty[1], "x_num grad")
    assert_zero(dirty[1][not_read], "x_num gradient where it is not read")
    assert_zero(dirty[2][~ctx_mask], "gradient at masked context slots")
    for a, b in zip(clean[3], dirty[3]):
        assert_finite(b, "parameter grad")
        assert torch.equal(a, b)
    for a, b in zip(clean[4], dirty[4]):
        assert_finite(b, "output")
        assert torch.equal(a[mask], b[mask])


def test_all_ignored_is_zero_loss_with_zero_gradients():
    net = make()
    model = XValAutoregressiveWrapper(net)
    x, x_num, _ = data(4)
    cases = {"all padding": dict(mask=torch.zeros(B, N, dtype=torch.bool)),
             "all ignore_index": dict(x=torch.full((B, N), -100))}
    for name, kw in cases.items():
        xn = x_num.clone().requires_grad_()
        net.zero_grad()
        loss = model(kw.get("x", x), xn, mask=kw.get("mask"))
        loss.backward()
        assert loss.item() == 0.0, name
        assert_zero(xn.grad, f"{name}: x_num grad")
        for p in net.parameters():
            assert_zero(p.grad, f"{name}: parameter grad", none_ok=True)


def test_left_padding_changes_nothing():
    net = make(dtype=torch.float64)
    model = XValAutoregressiveWrapper(net)
    x, x_num, mask = data(5, torch.float64)
    right = model(x, x_num, mask=mask, reduction="none")
    shift = N - mask.sum(1)
    idx = (torch.arange(N)[None] - shift[:, None]) % N
    lx, lnum, lmask = x.gather(1, idx), x_num.gather(1, idx), mask.gather(1, idx)
    left = model(torch.where(lmask, lx, 10**6), lnum.masked_fill(~lmask, float("nan")), mask=lmask, reduction="none")
    assert_close(left.sum(1), right.sum(1), "per-sample loss under left padding", torch.float64)


def test_condition_dropping_trains():
    net = make(cross=True)
    model = XValAutoregressiveWrapper(net, cond_drop_prob=0.5).train()
    x, x_num, mask = data(6)
    ctx = torch.randn(B, 3, D)
    loss = model(x, x_num, mask=mask, context=ctx, generator=torch.Generator().manual_seed(0))
    loss.backward()
    assert_finite(loss, "loss")


# ----------------------------------------------------------------------------------------------------
# generation
# ----------------------------------------------------------------------------------------------------


def test_generate_shapes_and_finite_numbers():
    model = XValAutoregressiveWrapper(make()).eval()
    x, x_num, _ = data(7)
    out = model.generate(x[:, :3], x_num[:, :3], 5)
    assert isinstance(out, GenerateReturn)
    assert out.sampled_token_ids.shape == out.sampled_numbers.shape == out.is_number_mask.shape == (B, 5)
    assert_finite(out.sampled_numbers, "sampled numbers")
    assert torch.equal(out.is_number_mask, out.sampled_token_ids == NUM)
    assert_zero(out.sampled_numbers[~out.is_number_mask], "numbers where no number was sampled")
    nan = model.generate(x[:, :3], x_num[:, :3], 5, non_number_value=float("nan"))
    assert nan.sampled_numbers[~nan.is_number_mask].isnan().all()
    assert model.training is False


@pytest.mark.parametrize("value", VALUES)
def test_generate_guided_cached_uncached_and_garbage(value):
    net = make(cross=True)
    model = XValAutoregressiveWrapper(net).eval()
    x, x_num, _ = data(8)
    pmask = torch.arange(4)[None] >= torch.tensor([0, 1, 3, 2])[:, None]  # left padding
    ctx = torch.randn(B, 3, D)
    ctx_mask = torch.tensor([[True, False, True], [False] * 3, [True] * 3, [True, True, False]])
    kw = dict(mask=pmask, context_mask=ctx_mask, cond_scale=2.5, temperature=0.0)
    want = model.generate(x[:, :4], x_num[:, :4], 6, context=ctx, **kw)
    not_read = ~((x[:, :4] == NUM) & pmask)
    for cache_kv in (True, False):
        got = model.generate(torch.where(pmask, x[:, :4], 10**6), x_num[:, :4].masked_fill(not_read, value), 6,
                             context=ctx.masked_fill(~ctx_mask[..., None], value), cache_kv=cache_kv, **kw)
        assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
        assert_close(got.sampled_numbers, want.sampled_numbers, "numbers", torch.float32)


def test_guidance_is_the_formula_over_separate_passes():
    net = make(cross=True, dtype=torch.float64)
    model = XValAutoregressiveWrapper(net).eval()
    x, x_num, _ = data(9, torch.float64)
    ctx = torch.randn(B, 3, D, dtype=torch.float64)
    s = 3.0
    got = model.generate(x[:, :4], x_num[:, :4], 1, context=ctx, cond_scale=s, temperature=0.0)
    with torch.no_grad():
        lc, nc = net(x[:, :4], x_num[:, :4], context=ctx)
        lu, nu = net(x[:, :4], x_num[:, :4])
    guided = lu[:, -1].log_softmax(-1) + s * (lc[:, -1].log_softmax(-1) - lu[:, -1].log_softmax(-1))
    assert torch.equal(got.sampled_token_ids[:, 0], guided.argmax(-1))
    num = nu[:, -1] + s * (nc[:, -1] - nu[:, -1])
    is_num = got.is_number_mask[:, 0]
    assert_close(got.sampled_numbers[is_num, 0], num[is_num], "guided number", torch.float64)


def test_generate_past_max_seq_len_slides():
    model = XValAutoregressiveWrapper(make()).eval()
    x, x_num, _ = data(10)
    out = model.generate(x[:, :5], x_num[:, :5], 14, temperature=0.0)
    assert out.sampled_token_ids.shape == (B, 14)
    assert_finite(out.sampled_numbers, "numbers")


# ----------------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------------


def test_named_errors():
    net = make()
    model = XValAutoregressiveWrapper(net)
    x, x_num, mask = data()
    with pytest.raises(ValueError, match="numerical_token_id"):
        XValTransformerWrapper(num_tokens=V, max_seq_len=8, numerical_token_id=V, attn_layers=sf.Decoder(dim=8, depth=1))
    with pytest.raises(ValueError, match="emb_dim"):
        make(emb_dim=D + 1)
    with pytest.raises(ValueError, match="max_mem_len"):
        make(max_mem_len=4)
    with pytest.raises(TypeError, match="attn_layers"):
        XValTransformerWrapper(num_tokens=V, max_seq_len=8, numerical_token_id=0, attn_layers=torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="XValTransformerWrapper"):
        XValAutoregressiveWrapper(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="causal"):
        XValAutoregressiveWrapper(XValTransformerWrapper(num_tokens=V, max_seq_len=8, numerical_token_id=0,
                                                         attn_layers=sf.Encoder(dim=8, depth=1)))
    with pytest.raises(ValueError, match="x_num"):
        net(x, x_num[:, :-1])
    with pytest.raises(TypeError, match="x_num"):
        net(x, x)
    with pytest.raises(TypeError, match="x must hold integer"):
        net(x_num, x_num)
    with pytest.raises(ValueError, match="x holds token id"):
        net(x + V, x_num)
    with pytest.raises(TypeError, match="mask"):
        model(x, x_num, mask=mask.int())
    with pytest.raises(ValueError, match="mems"):
        net(x, x_num, return_mems=True)
    with pytest.raises(ValueError, match="reduction"):
        model(x, x_num, reduction="sum")
    with pytest.raises(ValueError, match="context"):
        model(x, x_num, context=torch.randn(B, 3, D))  # no cross-attention
    with pytest.raises(ValueError, match="seq_len"):
        model.generate(x[:, :2], x_num[:, :2], -1)
    with pytest.raises(ValueError, match="mask"):
        model.generate(x[:, :2], x_num[:, :2], 2, mask=torch.zeros(B, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="start_numbers"):
        model.generate(x[:, :2], x_num[:, :3], 2)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(x[:, :2], x_num[:, :2], 2, temperature=-1.0)
    with pytest.raises(ValueError, match="cond_scale"):
        model.generate(x[:, :2], x_num[:, :2], 2, cond_scale={"context": 2.0})
    with pytest.raises(TypeError, match="XValTransformerWrapper"):
        xval_from_x_transformers(net)


# ----------------------------------------------------------------------------------------------------
# x-transformers
# ----------------------------------------------------------------------------------------------------


def _xt(tie: bool = False, mem: int = 0, rotary: bool = False):
    xt = pytest.importorskip("x_transformers")
    from x_transformers.xval import XValTransformerWrapper as XV

    torch.manual_seed(0)
    m = XV(num_tokens=V, numerical_token_id=NUM, max_seq_len=16, tie_embedding=tie, num_memory_tokens=mem,
           attn_layers=xt.Decoder(dim=D, depth=2, heads=2, attn_dim_head=8, rotary_pos_emb=rotary))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g) * (p.abs().mean() + 0.1))
    return m.eval()


@pytest.mark.parametrize("cfg", [dict(), dict(tie=True), dict(mem=2), dict(rotary=True)], ids=["plain", "tied", "memory", "rotary"])
def test_parity_forward_with_x_transformers(cfg):
    xm = _xt(**cfg)
    sm = xval_from_x_transformers(xm)
    x, x_num, _ = data(11)
    mask = torch.arange(N)[None] < torch.tensor([N, 5, 2, 6])[:, None]  # right padding, no sample empty
    for m in (None, mask):
        xl, xn = xm(x, x_num, mask=m)
        sl, sn = sm(x, x_num, mask=m)
        real = torch.ones(B, N, dtype=torch.bool) if m is None else m
        assert_close(sl[real], xl[real], "logits", torch.float32)
        assert_close(sn[real], xn[real], "numbers", torch.float32)
        assert (sl[real] - xl[real]).abs().max() < 1e-5 and (sn[real] - xn[real]).abs().max() < 1e-5


def test_parity_loss_gradients_and_greedy_generation_with_x_transformers():
    pytest.importorskip("x_transformers")
    from x_transformers.autoregressive_wrapper import top_k as xt_top_k
    from x_transformers.xval import XValAutoregressiveWrapper as XA

    xm = _xt()
    xa = XA(xm, numerical_loss_weight=0.7)
    sa = xval_from_x_transformers(xa)
    assert sa.numerical_loss_weight == 0.7
    x, x_num, _ = data(12)
    mask = torch.arange(N)[None] < torch.tensor([N, 5, 2, 6])[:, None]
    x_num = x_num.masked_fill(x != NUM, float("nan"))  # x-transformers' convention for non-numbers
    xl = xa(x, x_num, mask=mask)
    sl = sa(x, x_num, mask=mask)
    assert abs(xl.item() - sl.item()) < 1e-5
    xl.backward()
    sl.backward()
    assert_close(sa.net.to_numerical_output.weight.grad, xa.net.to_numerical_output[0].weight.grad, "number head grad", torch.float32)
    assert_close(sa.net.token_emb.weight.grad, xa.net.token_emb.emb.weight.grad, "embedding grad", torch.float32)
    # greedy generation: the top token only, in both
    xo = xa.generate(x[:, :3], x_num[:, :3].nan_to_num(), 4, filter_logits_fn=xt_top_k, filter_kwargs=dict(k=1))
    so = sa.generate(x[:, :3], x_num[:, :3].nan_to_num(), 4, temperature=0.0, non_number_value=float("nan"))
    assert torch.equal(xo.sampled_token_ids, so.sampled_token_ids)
    assert torch.equal(xo.is_number_mask, so.is_number_mask)
    m = so.is_number_mask
    assert_close(so.sampled_numbers[m], xo.sampled_numbers[m], "generated numbers", torch.float32)


def test_generate_x_transformers_filter_call():
    """x-transformers' call: ``generate(start_tokens, start_numbers, seq_len, filter_logits_fn, filter_kwargs)``."""
    model = XValAutoregressiveWrapper(make()).eval()
    x, x_num, _ = data(13)
    out = model.generate(x[:, :2], x_num[:, :2], 3, sf.top_k, {"k": 3})
    assert out.sampled_token_ids.shape == (B, 3)
    assert bool(((out.sampled_token_ids >= 0) & (out.sampled_token_ids < V)).all())


# ----------------------------------------------------------------------------------------------------
# the door probes (for tests/doors.py) and the clauses run on them here
# ----------------------------------------------------------------------------------------------------


def _probe_inputs(seed: int, value: float):
    g = torch.Generator().manual_seed(seed)
    b, n, j = 4, 6, 3
    lengths = torch.randint(0, n + 1, (b,), generator=g)
    lengths[0], lengths[-1] = 0, n
    mask = sf.padding_mask(lengths, n, left=bool(seed % 2))
    x = torch.randint(0, V, (b, n), generator=g)
    x[:, ::2] = NUM
    garbage = 0 if value == 0 else 10**6
    x = torch.where(mask, x, torch.full_like(x, garbage))
    read = (x == NUM) & mask
    x_num = torch.randn(b, n, generator=g).masked_fill(~read, value).requires_grad_()
    ctx_mask = torch.rand(b, j, generator=g) < 0.6
    ctx_mask[1], ctx_mask[-1] = False, True
    ctx = torch.randn(b, j, D, generator=g)
    return b, n, j, mask, x, read, x_num, ctx, ctx_mask


def probe_xval_wrapper(seed: int, value: float):
    """``XValTransformerWrapper`` (cross-attending, memory tokens): padding on either side with a fully
    padded sample, garbage ids at padded positions, ``value`` in ``x_num`` wherever it is not read and at
    masked context slots. The output is ``cat(logits, number)`` at real positions."""
    from doors import Probe

    b, n, j, mask, x, read, x_num, ctx, ctx_mask = _probe_inputs(seed, value)
    net = make(cross=True, num_memory_tokens=2)
    ctx = ctx.masked_fill(~ctx_mask[..., None], value).requires_grad_()
    logits, num = net(x, x_num, mask=mask, context=ctx, context_mask=ctx_mask)
    out = torch.cat((logits, num[..., None]), -1)  # (b, n, v + 1)
    return Probe(out, {"x_num": x_num, "context": ctx}, {"x_num": ~read, "context": ~ctx_mask[..., None].expand_as(ctx)},
                 compare=mask[..., None].expand_as(out), bad_calls=[
                     ("x_num of another shape", lambda: net(x, x_num[:, 1:]), ValueError, "x_num"),
                     ("integer x_num", lambda: net(x, x), TypeError, "x_num"),
                     ("float ids", lambda: net(x_num, x_num), TypeError, "x"),
                     ("id outside the vocabulary at a real position", lambda: net(x.clamp(max=0) + V, x_num), ValueError, "x"),
                     ("int mask", lambda: net(x, x_num, mask=mask.int()), TypeError, "mask"),
                     ("context of wrong width", lambda: net(x, x_num, context=torch.randn(b, j, D + 1)), ValueError, "context"),
                     ("XL mems", lambda: net(x, x_num, mems=[]), ValueError, "mems"),
                     ("numerical_token_id outside the vocabulary", lambda: XValTransformerWrapper(
                         num_tokens=V, max_seq_len=8, numerical_token_id=-1, attn_layers=sf.Decoder(dim=8, depth=1)),
                      ValueError, "numerical_token_id"),
                 ])


def probe_xval_autoregressive(seed: int, value: float):
    """``XValAutoregressiveWrapper`` in training mode with the context dropped per sample: the per-target
    losses (``reduction="none"``) are exactly 0 where no target counts, garbage as in the wrapper's probe
    and in every dropped context. Also: an all-padding batch is a loss of 0 with zero gradients, and
    guided generation from left-padded prompts holding garbage equals that from clean ones, cached and not."""
    from doors import Probe

    b, n, j, mask, x, read, x_num, ctx, ctx_mask = _probe_inputs(seed, value)
    net = make(cross=True)
    model = XValAutoregressiveWrapper(net, cond_drop_prob=0.5).train()
    replay = torch.Generator().manual_seed(seed)
    _, dropped = sf.drop_conditions(sf.Conditions(ctx, ctx_mask, None, None, None, None), model.cond_drop_probs,
                                    all_prob=0.0, generator=replay)
    hidden = ~ctx_mask | dropped["context"][:, None]
    ctx = ctx.masked_fill(hidden[..., None], value).requires_grad_()
    kw = dict(context=ctx, context_mask=ctx_mask)
    out = model(x, x_num, mask=mask, reduction="none", generator=torch.Generator().manual_seed(seed), **kw)  # (b, n - 1)
    counted = mask[:, 1:] & mask[:, :-1]
    # x_num is read as an input where it is a real number, and as a target where that target counts
    not_read = ~read

    none = model(x, x_num, mask=torch.zeros(b, n, dtype=torch.bool), generator=torch.Generator().manual_seed(seed), **kw)
    grads = torch.autograd.grad(none, [x_num, ctx, *net.parameters()], allow_unused=True)
    assert none.item() == 0.0 and all(gr is None or not bool(gr.any()) for gr in grads), \
        "an all-padding batch is not a loss of 0 with zero gradients"

    model.eval()
    with torch.no_grad():
        pm = sf.padding_mask(torch.tensor([1, 3, 2, 3]), 3, left=True)
        px, pnum = x[:, :3].clamp(0, V - 1), torch.randn(b, 3, generator=torch.Generator().manual_seed(seed))
        gen_kw = dict(mask=pm, context_mask=ctx_mask, cond_scale=2.0, temperature=0.0)
        clean_ctx = torch.randn(b, j, D, generator=torch.Generator().manual_seed(seed + 1))
        want = model.generate(px, pnum, 3, context=clean_ctx, **gen_kw)
        pread = (px == NUM) & pm
        for cache_kv in (True, False):
            got = model.generate(torch.where(pm, px, 10**6 if value else 0), pnum.masked_fill(~pread, value), 3,
                                 context=clean_ctx.masked_fill(~ctx_mask[..., None], value), cache_kv=cache_kv, **gen_kw)
            assert torch.equal(got.sampled_token_ids, want.sampled_token_ids), "garbage changed guided generation"
            assert torch.isfinite(got.sampled_numbers).all() and torch.allclose(got.sampled_numbers, want.sampled_numbers, atol=1e-5)
    model.train()
    return Probe(out, {"x_num": x_num, "context": ctx}, {"x_num": not_read, "context": hidden[..., None].expand_as(ctx)},
                 dead=~counted, bad_calls=[
                     ("x_num of another shape", lambda: model(x, x_num[:, 1:]), ValueError, "x_num"),
                     ("int mask", lambda: model(x, x_num, mask=mask.int()), TypeError, "mask"),
                     ("unknown reduction", lambda: model(x, x_num, reduction="avg"), ValueError, "reduction"),
                     ("context of wrong width", lambda: model(x, x_num, context=torch.randn(b, j, D + 1)), ValueError, "context"),
                     ("a non-causal net", lambda: XValAutoregressiveWrapper(XValTransformerWrapper(
                         num_tokens=V, max_seq_len=8, numerical_token_id=0, attn_layers=sf.Encoder(dim=8, depth=1))),
                      ValueError, "causal"),
                     ("negative seq_len", lambda: model.generate(x[:, :2], x_num[:, :2], -1), ValueError, "seq_len"),
                     ("an all-padding prompt", lambda: model.generate(x[:, :2], x_num[:, :2], 1,
                                                                      mask=torch.zeros(b, 2, dtype=torch.bool)), ValueError, "mask"),
                     ("a scale for a condition not given", lambda: model.generate(x[:, :2], x_num[:, :2], 1,
                                                                                 cond_scale={"prepend": 2.0}), ValueError, "prepend"),
                     ("negative temperature", lambda: model.generate(x[:, :2], x_num[:, :2], 1, temperature=-1.0),
                      ValueError, "temperature"),
                 ])


def test_door_probe_clauses_wrapper():
    from test_dpo import check_probe

    check_probe(probe_xval_wrapper, has_dead=False)


def test_door_probe_clauses_autoregressive():
    from test_dpo import check_probe

    check_probe(probe_xval_autoregressive, has_dead=True)


def test_x_transformers_readme_example():
    """x-transformers' README example with the import changed (smaller sizes: the CPU suite)."""
    from safeformer import Decoder

    model = XValTransformerWrapper(num_tokens=4, numerical_token_id=3, max_seq_len=1024,
                                   attn_layers=Decoder(dim=32, depth=2, heads=4))
    model = XValAutoregressiveWrapper(model)
    ids = torch.randint(0, 4, (1, 77))
    nums = torch.randn(1, 77)
    loss = model(ids, nums)
    loss.backward()
    start_ids = torch.randint(0, 4, (1, 1))
    start_nums = torch.randn(1, 1)
    ids_out, num_out, is_number_mask = model.generate(start_ids, start_nums, 17)
    assert ids_out.shape == num_out.shape == is_number_mask.shape == (1, 17)
    assert_finite(num_out, "numbers")


def test_checkpoint_round_trip(tmp_path):
    model = XValAutoregressiveWrapper(make(cross=True, num_memory_tokens=1), numerical_loss_weight=0.5, cond_drop_prob=0.2)
    model.save_pretrained(tmp_path)
    back = XValAutoregressiveWrapper.from_pretrained(tmp_path)
    assert back.numerical_loss_weight == 0.5 and back.cond_drop_prob == 0.2
    x, x_num, mask = data()
    assert torch.equal(model.eval()(x, x_num, mask=mask), back.eval()(x, x_num, mask=mask))


def test_return_options_and_positions():
    net = make().eval()
    x, x_num, mask = data(14)
    h = net(x, x_num, mask=mask, return_embeddings=True)
    assert h.shape == (B, N, D)
    assert_zero(h[~mask], "hidden states at padded positions")
    (logits, num), inter = net(x, x_num, mask=mask, return_intermediates=True)
    assert logits.shape == (B, N, V) and num.shape == (B, N) and len(inter.attn_intermediates) == 2
    (_, _), maps = net(x, x_num, return_attn=True)
    assert len(maps) == 2 and maps[0].shape[-2:] == (N, N)
    pos = torch.arange(N).expand(B, N)
    assert_close(net(x, x_num, pos=pos)[0], net(x, x_num)[0], "explicit positions", torch.float32)


def test_parity_sampled_generation_with_x_transformers_defaults():
    """The same random draws give the same samples: x-transformers' default filter (top_k keeping
    ceil(0.1 v)) and temperature 1, from one seed in each library."""
    pytest.importorskip("x_transformers")
    from x_transformers.xval import XValAutoregressiveWrapper as XA

    xa = XA(_xt())
    sa = xval_from_x_transformers(xa)
    x, x_num, _ = data(15)
    torch.manual_seed(123)
    xo = xa.generate(x[:, :3], x_num[:, :3], 5)
    torch.manual_seed(123)
    so = sa.generate(x[:, :3], x_num[:, :3], 5, non_number_value=float("nan"))
    assert torch.equal(xo.sampled_token_ids, so.sampled_token_ids)
    m = so.is_number_mask
    assert_close(so.sampled_numbers[m], xo.sampled_numbers[m], "sampled numbers", torch.float32)
    assert torch.equal(xo.sampled_numbers.isnan(), so.sampled_numbers.isnan())
