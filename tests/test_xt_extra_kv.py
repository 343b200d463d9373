"""x-transformers' extra keys/values and key/value residuals on the layer stack and the wrapper:
``self_attn_additional_kv`` / ``additional_kv_mask`` / ``detach_additional_kv`` / ``route_additional_kv_to_top``,
``self_attn_kv_residuals`` / ``cross_attn_kv_residuals``, ``seq_pos_offset``, and ``Attention``'s
``additional_key_values`` / ``additional_key_value_mask`` / ``kv_input_residual``.

Math: x-transformers itself on converted weights (float32). Safety: NaN planted at masked added keys/values
and at padded residual rows stays out of outputs and gradients; a padded sample equals the sample alone; the
KV cache equals the full forward; the unpadded path and cached contexts are refused with a clear error.
"""

from __future__ import annotations

import pytest
import torch

import safeformer as sf

xt = pytest.importorskip("x_transformers")

DIM, HEADS, DH = 32, 4, 8
NAN = float("nan")


def convert(stack, **wrapper_kwargs):
    """An x-transformers stack and its safeformer conversion (through a wrapper without positions)."""
    w = xt.TransformerWrapper(num_tokens=11, max_seq_len=0, use_abs_pos_emb=False, attn_layers=stack,
                              **wrapper_kwargs).eval()
    return w, sf.from_x_transformers(w).eval()


def assert_close(a, b, atol=2e-5):
    assert a.shape == b.shape
    assert torch.allclose(a, b, atol=atol, rtol=1e-4), (a - b).abs().max().item()


def plant(t, keep, value=NAN):
    """``t`` with ``value`` where ``keep`` (broadcast) is False, as a fresh leaf."""
    return torch.where(keep, t, value).detach().requires_grad_()


# ----------------------------------------------------------------------------------------------------
# math: x-transformers on the same weights
# ----------------------------------------------------------------------------------------------------


def test_kv_residuals_match_x_transformers():
    torch.manual_seed(0)
    xw, sw = convert(xt.Decoder(dim=DIM, depth=2, heads=HEADS, attn_dim_head=DH, cross_attend=True,
                                rotary_pos_emb=True))
    a, b = xw.attn_layers, sw.attn_layers
    x, ctx = torch.randn(3, 6, DIM), torch.randn(3, 5, DIM)
    cr, sr = torch.randn(2, 3, 5, DIM), torch.randn(2, 3, 6, DIM)
    for kw in (dict(cross_attn_kv_residuals=cr), dict(cross_attn_kv_residuals=cr[0]),
               dict(self_attn_kv_residuals=sr), dict(self_attn_kv_residuals=sr[0]),  # 3-d: first block only
               dict(self_attn_kv_residuals=sr[:, :, :1]),  # broadcast over positions
               dict(self_attn_kv_residuals=sr[:1], cross_attn_kv_residuals=cr),
               dict(seq_pos_offset=3)):
        assert_close(a(x, context=ctx, **kw), b(x, context=ctx, **kw))


@pytest.mark.parametrize("kv_heads,added_heads", [(4, 4), (4, 2), (4, 1), (2, 1), (2, 2), (2, 4)])
def test_additional_kv_matches_x_transformers(kv_heads, added_heads):
    """Converted grouped-query heads permute the query heads: the added heads follow x-transformers' pairing."""
    torch.manual_seed(1)
    xw, sw = convert(xt.Decoder(dim=DIM, depth=3, heads=HEADS, attn_dim_head=DH, attn_kv_heads=kv_heads,
                                rotary_pos_emb=True))
    x = torch.randn(3, 6, DIM)
    kv = [(torch.randn(3, added_heads, 7, DH), torch.randn(3, added_heads, 7, DH)) for _ in range(2)]
    m = torch.rand(3, 7) < 0.6
    m[0] = False  # a sample whose added keys are all masked: its queries still see themselves
    for kw in (dict(additional_kv_mask=m), {}, dict(additional_kv_mask=m, route_additional_kv_to_top=False)):
        assert_close(xw.attn_layers(x, self_attn_additional_kv=kv, **kw),
                     sw.attn_layers(x, self_attn_additional_kv=kv, **kw))


def test_wrapper_additional_kv_matches_x_transformers():
    torch.manual_seed(2)
    xw, sw = convert(xt.Decoder(dim=DIM, depth=2, heads=HEADS, attn_dim_head=DH, rotary_pos_emb=True))
    ids = torch.randint(0, 11, (2, 5))
    kv = [(torch.randn(2, HEADS, 4, DH), torch.randn(2, HEADS, 4, DH)) for _ in range(2)]
    m = torch.tensor([[True, False, True, True], [False, True, False, False]])
    assert_close(xw(ids, self_attn_additional_kv=kv, additional_kv_mask=m),
                 sw(ids, self_attn_additional_kv=kv, additional_kv_mask=m))


def test_attention_module_matches_x_transformers():
    torch.manual_seed(3)
    for causal in (False, True):
        a = xt.Attention(DIM, dim_head=DH, heads=HEADS, causal=causal)
        b = sf.Attention(DIM, dim_head=DH, heads=HEADS, causal=causal)
        for name in ("to_q", "to_k", "to_v", "to_out"):
            getattr(b, name).weight.data.copy_(getattr(a, name).weight.data)
        x, r = torch.randn(2, 5, DIM), torch.randn(2, 5, DIM)
        kv = (torch.randn(2, 2, 3, DH), torch.randn(2, 2, 3, DH))
        m = torch.tensor([[True, False, True], [False, False, False]])
        assert_close(a(x, additional_key_values=kv, additional_key_value_mask=m, kv_input_residual=r),
                     b(x, additional_key_values=kv, additional_key_value_mask=m, kv_input_residual=r))


# ----------------------------------------------------------------------------------------------------
# safety: masked slots, padding, the cache
# ----------------------------------------------------------------------------------------------------


def make_decoder(**kw):
    torch.manual_seed(4)
    return sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DH, rotary_pos_emb=True, cross_attend=True, **kw)


def test_nan_in_masked_added_kv_and_padded_residuals_stays_out():
    model = make_decoder(attn_num_mem_kv=0)
    b, n, a, j = 3, 5, 4, 3
    x = torch.randn(b, n, DIM)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False], [False, False, True, True, True]])
    ctx, cmask = torch.randn(b, j, DIM), torch.tensor([[True, True, False], [False] * 3, [True] * 3])
    amask = torch.tensor([[True, False, True, True], [False] * 4, [True, True, False, True]])
    kv = [(torch.randn(b, 2, a, DH), torch.randn(b, 2, a, DH)) for _ in range(2)]
    sr, cr = torch.randn(2, b, n, DIM), torch.randn(2, b, j, DIM)

    def run(value):
        ks = [(plant(k, amask[:, None, :, None], value), plant(v, amask[:, None, :, None], value)) for k, v in kv]
        s_res = plant(sr, mask[None, :, :, None], value)
        c_res = plant(cr, cmask[None, :, :, None], value)
        out = model(x, mask=mask, context=ctx, context_mask=cmask, self_attn_additional_kv=ks, additional_kv_mask=amask,
                    self_attn_kv_residuals=s_res, cross_attn_kv_residuals=c_res)
        leaves = [t for pair in ks for t in pair] + [s_res, c_res]
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, DIM)).sum(), leaves)
        return out, grads

    clean, g_clean = run(0.0)
    for value in (NAN, float("inf"), 1e4):
        dirty, g_dirty = run(value)
        assert torch.equal(dirty, clean)
        for gd, gc in zip(g_dirty, g_clean):
            assert torch.isfinite(gd).all() and torch.equal(gd, gc)
    k_grad = g_clean[0]
    assert not k_grad[~amask[:, None, :, None].expand_as(k_grad)].any(), "masked added keys got a gradient"
    assert torch.equal(clean[~mask], torch.zeros_like(clean[~mask]))


def test_padded_sample_equals_alone():
    model = make_decoder()
    n, a = 6, 4
    x, ctx = torch.randn(1, 4, DIM), torch.randn(1, 2, DIM)
    kv = [(torch.randn(1, HEADS, a, DH), torch.randn(1, HEADS, a, DH)) for _ in range(2)]
    amask = torch.tensor([[True, True, False, True]])
    sr = torch.randn(2, 1, 4, DIM)
    want = model(x, context=ctx, self_attn_additional_kv=kv, additional_kv_mask=amask, self_attn_kv_residuals=sr)
    for left in (False, True):
        pad = torch.full((1, n - 4, DIM), NAN)
        xp = torch.cat((pad, x), 1) if left else torch.cat((x, pad), 1)
        mask = torch.arange(n)[None] >= n - 4 if left else torch.arange(n)[None] < 4
        rp = torch.cat((pad[None].expand(2, -1, -1, -1), sr), 2) if left else torch.cat((sr, pad[None].expand(2, -1, -1, -1)), 2)
        got = model(xp, mask=mask, context=ctx, self_attn_additional_kv=kv, additional_kv_mask=amask,
                    self_attn_kv_residuals=rp)
        assert_close(got[mask], want[0])


def test_kv_cache_equals_full_forward():
    model = make_decoder()
    b, n = 2, 6
    x, ctx = torch.randn(b, n, DIM), torch.randn(b, 3, DIM)
    kv = [(torch.randn(b, 1, 4, DH), torch.randn(b, 1, 4, DH)) for _ in range(2)]
    amask = torch.tensor([[True, False, True, True], [True, True, True, False]])
    cond = torch.randn(b, 1, DIM)  # the Free Transformer's latent: one residual for every position
    extra = dict(self_attn_additional_kv=kv, additional_kv_mask=amask, self_attn_kv_residuals=cond)
    full = model(x, context=ctx, **extra)
    out, cache = model(x[:, :3], context=ctx, return_cache=True, **extra)
    outs = [out]
    for t in range(3, n):
        out, cache = model(x[:, t : t + 1], cache=cache, return_cache=True, **extra)
        outs.append(out)
    assert_close(torch.cat(outs, 1), full)
    # x-transformers' protocol: the intermediates as the cache, the whole sequence so far as the input
    _, inter = model(x[:, :5], context=ctx, return_hiddens=True, **extra)
    step = model(x, cache=inter, **extra)
    assert_close(step, full[:, 5:])


def test_layer_intermediates_as_additional_kv():
    torch.manual_seed(5)
    vlm = sf.TransformerWrapper(num_tokens=11, max_seq_len=16, attn_layers=sf.Decoder(dim=DIM, depth=2, heads=2,
                                                                                      dim_head=DH)).eval()
    action = sf.Decoder(dim=DIM, depth=3, heads=HEADS, dim_head=DH).eval()
    ids = torch.randint(0, 11, (2, 7))
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    _, inter = vlm(ids, mask=mask, return_intermediates=True)
    x = torch.randn(2, 5, DIM)
    keep = torch.rand(2, 7) < 0.7
    got = action(x, self_attn_additional_kv=inter, additional_kv_mask=keep, detach_additional_kv=True)
    want = action(x, self_attn_additional_kv=list(inter.cache.self_kv), additional_kv_mask=keep & mask)
    assert torch.equal(got, want)
    # the padded vlm sample equals that sample alone (its padding masks its keys)
    _, alone = vlm(ids[1:, :4], return_intermediates=True)
    got1 = action(x[1:], self_attn_additional_kv=alone, additional_kv_mask=keep[1:, :4])
    assert_close(got[1:], got1)


def test_detach_and_gradients_into_added_kv():
    model = make_decoder()
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, HEADS, 3, DH, generator=g).requires_grad_()
    v = torch.randn(1, HEADS, 3, DH, generator=g).requires_grad_()
    x = torch.randn(1, 4, DIM, generator=g)
    w = torch.randn(1, 4, DIM, generator=g)  # a weighted sum: a plain sum after the final norm has no gradient
    (model(x, self_attn_additional_kv=[(k, v)]) * w).sum().backward()
    assert k.grad is not None and bool(k.grad.any())
    k.grad = None
    out = model(x, self_attn_additional_kv=[(k, v)], detach_additional_kv=True)
    assert not out.requires_grad or torch.autograd.grad(out.sum(), [k], allow_unused=True)[0] is None


def test_padded_path_and_errors():
    model = make_decoder(unpadded="auto")
    b, n = 2, 8
    x, mask = torch.randn(b, n, DIM), torch.zeros(b, n, dtype=torch.bool)
    mask[:, :2] = True  # mostly padding: "auto" would pack, these options keep the padded path
    kv = [(torch.randn(b, HEADS, 3, DH), torch.randn(b, HEADS, 3, DH))]
    out = model(x, mask=mask, self_attn_additional_kv=kv)
    ref = make_decoder(unpadded=False)(x, mask=mask, self_attn_additional_kv=kv)
    assert_close(out, ref)
    plan = model.plan_unpadded(mask)
    ctx = torch.randn(b, 3, DIM)
    bad = [
        (lambda: model(x, mask=mask, unpadded_plan=plan, self_attn_additional_kv=kv), ValueError, "padded path"),
        (lambda: model(x, additional_kv_mask=torch.ones(b, 3, dtype=torch.bool)), ValueError, "additional_kv_mask"),
        (lambda: model(x, self_attn_additional_kv=kv, additional_kv_mask=torch.ones(b, 4, dtype=torch.bool)),
         ValueError, "additional_key_value_mask"),
        (lambda: model(x, self_attn_additional_kv=kv, additional_kv_mask=torch.ones(b, 3)), TypeError, "additional_key_value_mask"),
        (lambda: model(x, self_attn_additional_kv=[(kv[0][0][:, :3], kv[0][1][:, :3])]), ValueError, "h_a"),
        (lambda: model(x, self_attn_additional_kv=[(kv[0][0].double(), kv[0][1].double())]), ValueError, "additional_key_values"),
        (lambda: model(x, self_attn_additional_kv=kv[0]), ValueError, "additional_key_values"),
        (lambda: model(x, self_attn_kv_residuals=torch.randn(3, b, n, DIM)), ValueError, "self_attn_kv_residuals"),
        (lambda: model(x, self_attn_kv_residuals=torch.randn(b, n + 1, DIM)), ValueError, "self_attn_kv_residuals"),
        (lambda: model(x, cross_attn_kv_residuals=torch.randn(b, 3, DIM)), ValueError, "context"),
        (lambda: model(x, context=ctx, cross_attn_kv_residuals=torch.randn(b, 4, DIM)), ValueError, "cross_attn_kv_residuals"),
        (lambda: model(x, seq_pos_offset=-1), ValueError, "seq_pos_offset"),
        (lambda: model(x, seq_pos_offset=1, pos=torch.arange(n)), ValueError, "seq_pos_offset"),
        (lambda: model(x, self_attn_additional_kv=kv, detach_additional_kv=1), TypeError, "detach_additional_kv"),
    ]
    _, cache = model(x, context=ctx, return_cache=True)
    bad.append((lambda: model(x[:, :1], cache=cache, cross_attn_kv_residuals=torch.randn(b, 3, DIM)), ValueError, "cached"))
    rec = sf.TransformerWrapper(num_tokens=11, max_seq_len=8, recycling=True,
                                attn_layers=sf.Decoder(dim=DIM, depth=1, heads=HEADS, dim_head=DH))
    bad.append((lambda: rec(torch.zeros(b, 3, dtype=torch.long), self_attn_additional_kv=kv, recycle_steps=1),
                ValueError, "recycling"))
    forget = sf.Decoder(dim=DIM, depth=1, heads=HEADS, dim_head=DH, attn_data_dependent_alibi=True)
    bad.append((lambda: forget(x, self_attn_additional_kv=kv), ValueError, "data_dependent_alibi"))
    for call, exc, text in bad:
        with pytest.raises(exc, match=text):
            call()
