"""x-transformers' ``Attend`` module (``safeformer.core.attend.Attend``): equal to x-transformers' ``Attend`` on live
rows, and safe where it is not (NaN planted in masked keys/values, queries with no key)."""

import pytest
import torch

from safeformer.attend import Attend

B, H, I, J, D = 3, 2, 5, 6, 8


def _qkv(g, dtype=torch.float32):
    return [torch.randn(B, H, n, D, generator=g, dtype=dtype) for n in (I, J, J)]


def _key_mask(g):
    mask = torch.rand(B, J, generator=g) < 0.7
    mask[0] = False  # sample 0 sees no key: its rows are dead
    mask[1] = True
    return mask


def _reference(q, k, v, mask, causal, scale=None, extra_logit=None):
    """Plain float64 softmax attention; rows with no allowed key give 0."""
    q, k, v = q.double(), k.double(), v.double()
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    allowed = torch.ones(s.shape, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & (mask[:, None, None, :] if mask.dim() == 2 else mask)
    if causal:
        i, j = s.shape[-2:]
        allowed = allowed & (torch.arange(j)[None, :] <= torch.arange(i)[:, None] + (j - i))
    s = s.masked_fill(~allowed, float("-inf"))
    if extra_logit is not None:  # a zero key/value with this logit, always allowed
        s = torch.cat((extra_logit.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1), s), dim=-1)
        v = torch.cat((torch.zeros_like(v[..., :1, :]), v), dim=-2)
    w = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return w @ v


@pytest.mark.parametrize("causal", [False, True])
def test_matches_float64_reference_and_dead_rows_are_zero(causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = _qkv(g)
    mask = _key_mask(g)
    out, inter = Attend(causal=causal)(q, k, v, mask=mask)
    torch.testing.assert_close(out.double(), _reference(q, k, v, mask, causal), rtol=1e-5, atol=1e-5)
    assert (out[0] == 0).all() and inter.post_softmax_attn is None


def test_nan_in_masked_keys_and_values_never_leaks():
    g = torch.Generator().manual_seed(1)
    q, k, v = _qkv(g)
    mask = _key_mask(g)
    kp, vp = k.clone().requires_grad_(), v.clone().requires_grad_()
    with torch.no_grad():
        kp.masked_fill_(~mask[:, None, :, None], float("nan"))
        vp.masked_fill_(~mask[:, None, :, None], float("inf"))
    qp = q.clone().requires_grad_()
    out, _ = Attend()(qp, kp, vp, mask=mask)
    out.sum().backward()
    clean, _ = Attend()(q, k, v, mask=mask)
    assert torch.equal(out, clean)
    for t in (qp, kp, vp):
        assert torch.isfinite(t.grad).all()
    assert (kp.grad[~mask[:, None, :, None].expand_as(kp)] == 0).all()


def test_row_mask_zeroes_rows():
    g = torch.Generator().manual_seed(2)
    q, k, v = _qkv(g)
    rows = torch.rand(B, I, generator=g) < 0.5
    out, _ = Attend()(q, k, v, row_mask=rows)
    assert (out.permute(0, 2, 1, 3)[~rows] == 0).all()
    ref = _reference(q, k, v, rows[:, None, :, None].expand(B, 1, I, J), False)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_zero_kv_and_sink():
    g = torch.Generator().manual_seed(3)
    q, k, v = _qkv(g)
    mask = _key_mask(g)
    out, _ = Attend(add_zero_kv=True, causal=True)(q, k, v, mask=mask)
    torch.testing.assert_close(out.double(), _reference(q, k, v, mask, True, extra_logit=torch.zeros(H)),
                               rtol=1e-5, atol=1e-5)
    att = Attend(heads=H, head_learned_sink=True)
    with torch.no_grad():
        att.head_attn_sink.copy_(torch.tensor([0.5, -1.0]))
    out, _ = att(q, k, v, mask=mask)
    torch.testing.assert_close(out.double(), _reference(q, k, v, mask, False, extra_logit=att.head_attn_sink.detach()),
                               rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all() and (out[0] == 0).all()  # sample 0: only the zero value is seen


def test_unsupported_options_are_named():
    with pytest.raises(TypeError, match="flash_pack_seq"):
        Attend(flash_pack_seq=1)
    with pytest.raises(TypeError, match="bogus"):
        Attend(bogus=1)
    Attend(sigmoid=False, flash=True, qk_norm=True)  # defaults and kernel choices are accepted
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError, match="prev_attn"):
        Attend()(q, q, q, prev_attn=torch.zeros(1, 1, 3, 2))
    with pytest.raises(TypeError, match="flash_pack_seq=True"):
        Attend()(q, q, q, flash_pack_seq_kwargs=dict(cu_seqlens_q=None))
    with pytest.raises(TypeError, match="mask"):
        Attend()(q, q, q, mask=torch.ones(1, 2))


@pytest.mark.parametrize("causal", [False, True])
def test_equals_x_transformers_attend(causal):
    xt_attend = pytest.importorskip("x_transformers.attend")
    g = torch.Generator().manual_seed(4)
    q, k, v = _qkv(g)
    mask = _key_mask(g)
    mask[0, 0] = True  # x-transformers' rows with no key are handled its own way: compare live rows
    ours, _ = Attend(causal=causal)(q, k, v, mask=mask)
    theirs, _ = xt_attend.Attend(causal=causal)(q, k, v, mask=mask)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


_PROBE_OPTIONS = (
    {}, dict(sigmoid=True), dict(custom_attn_fn=lambda t: torch.relu(t) ** 2), dict(sparse_topk=2),
    dict(cog_signed=True), dict(pre_talking_heads=True, post_talking_heads=True, heads=H), dict(hard=True),
    dict(l2_distance=True), dict(softclamp_logits=True, logit_softclamp_value=1.0), dict(inverted_attention=True),
)


def probe_attend_module(seed: int, value: float):
    """``Attend`` with key padding (sample 0 sees no key) and ``value`` planted in masked keys and values."""
    from doors import Probe

    g = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(g)
    mask = _key_mask(g)
    where = ~mask[:, None, :, None].expand(B, H, J, D)
    k = k.masked_fill(where, value).requires_grad_()
    v = v.masked_fill(where, value).requires_grad_()
    q = q.requires_grad_()
    m = Attend(**_PROBE_OPTIONS[seed % len(_PROBE_OPTIONS)])  # each seed one of x-transformers' Attend options
    out, _ = m(q, k, v, mask=mask)
    dead = torch.zeros_like(out, dtype=torch.bool)
    dead[0] = True
    return Probe(out, {"q": q, "k": k, "v": v}, {"k": where, "v": where}, dead=dead, bad_calls=[
        ("3-d q", lambda: m(q[0], k, v), ValueError, "q"),
        ("int mask", lambda: m(q, k, v, mask=mask.int()), TypeError, "mask"),
        ("row_mask of wrong shape", lambda: m(q, k, v, row_mask=mask), ValueError, "row_mask"),
    ])


def test_door_probe_clauses():
    from test_dpo import check_probe

    check_probe(probe_attend_module, has_dead=True)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_grouped_query_heads_pair_as_x_transformers(kv_heads):
    """x-transformers' ``Attend`` pairs query head ``n`` with key/value head ``n % kv_heads`` (tiled); so does
    safeformer's, on every kernel (and the masks it takes)."""
    from x_transformers.attend import Attend as XAttend

    from safeformer.attend import Attend as SAttend

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k, v = torch.randn(2, kv_heads, 6, 8, generator=g), torch.randn(2, kv_heads, 6, 8, generator=g)
    mask = torch.tensor([[True] * 6, [True, True, True, False, False, False]])
    want, _ = XAttend()(q, k, v, mask=mask)
    got, _ = SAttend()(q, k, v, mask=mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
