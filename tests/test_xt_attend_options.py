"""x-transformers' ``Attend`` options on safeformer's ``Attend`` (used alone, and as ``Attention.attend``, the
scoring part): the same outputs and weights as x-transformers on the same inputs at every query that sees a key,
masked keys' content never reaching an output or a gradient, dead rows exactly 0, and ``sdp_kwargs`` restricting the
fused kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import safeformer as sf
from safeformer.testing import plan_attention

xt_attend = pytest.importorskip("x_transformers.attend")
xt = pytest.importorskip("x_transformers")

B, H, I, J, D = 3, 2, 5, 6, 8

OPTIONS = {
    "sigmoid": dict(sigmoid=True),
    "hard": dict(hard=True),
    "l2_distance": dict(l2_distance=True),
    "cog_signed": dict(cog_signed=True),
    "sparse_topk": dict(sparse_topk=2),
    "sparse_topk_straight_through": dict(sparse_topk=3, sparse_topk_straight_through=True),
    "softclamp": dict(softclamp_logits=True, logit_softclamp_value=0.5),
    "pre_talking_heads": dict(pre_talking_heads=True, heads=H),
    "post_talking_heads": dict(post_talking_heads=True, heads=H),
    "pre_scale_post_talking_heads": dict(pre_scale_post_talking_heads=True, heads=H),
    "custom_softmax": dict(custom_attn_fn=lambda t: t.softmax(dim=-1)),
    "custom_relu_squared": dict(custom_attn_fn=lambda t: F.relu(t) ** 2),
    "scale": dict(scale=0.3),
    "sink_cog": dict(head_learned_sink=True, heads=H, cog_signed=True),
    "zero_kv_sigmoid": dict(add_zero_kv=True, sigmoid=True),
    "selective": dict(selective=True, causal=True),
    "causal_sparse_topk": dict(sparse_topk=2, causal=True),
}


def _inputs(seed: int, kv_heads: int = H):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, I, D, generator=g)
    k = torch.randn(B, kv_heads, J, D, generator=g)
    v = torch.randn(B, kv_heads, J, D, generator=g)
    mask = torch.ones(B, J, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, :] = False  # sample 2 sees no key: every row dead
    return q, k, v, mask


def _pair(opts: dict, seed: int = 0):
    theirs = xt_attend.Attend(**opts)
    ours = sf.Attend(**opts)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the learned parts moved off their init, the same in both
        for p in theirs.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    ours.load_state_dict(theirs.state_dict(), strict=True)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return theirs, ours


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_outputs_and_weights_equal_x_transformers_where_a_key_is_seen(name):
    opts = OPTIONS[name]
    theirs, ours = _pair(opts)
    q, k, v, mask = _inputs(1)
    ref, ref_inter = theirs(q, k, v, mask=mask)
    out, inter = ours(q, k, v, mask=mask)
    live = slice(0, 2)  # samples 0 and 1 see keys on every row
    torch.testing.assert_close(out[live], ref[live], atol=1e-5, rtol=1e-5)
    if not ours.explicit:  # the fused kernels: no weights (as x-transformers' flash path)
        assert inter.post_softmax_attn is None
    elif not ("post_talking_heads" in opts or "pre_scale_post_talking_heads" in opts):  # theirs: before the mix
        torch.testing.assert_close(inter.post_softmax_attn[live].float(),
                                   ref_inter.post_softmax_attn[live].float(), atol=1e-5, rtol=1e-5)
    if opts.get("add_zero_kv") or opts.get("head_learned_sink"):
        return  # sample 2 sees the zero key: not a dead row
    assert (out[2] == 0).all()  # a dead row is exactly 0 (x-transformers: a value from the masked keys)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_masked_content_reaches_no_output_and_no_gradient(name):
    opts = OPTIONS[name]
    ours = sf.Attend(**opts)
    q, k, v, mask = _inputs(2)
    hidden = ~mask[:, None, :, None].expand_as(k)
    k = k.masked_fill(hidden, float("nan")).requires_grad_()
    v = v.masked_fill(hidden, float("inf")).requires_grad_()
    q = q.requires_grad_()
    out, _ = ours(q, k, v, mask=mask)
    assert torch.isfinite(out).all()
    out.square().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (k.grad[hidden] == 0).all() and (v.grad[hidden] == 0).all()
    if opts.get("causal"):
        return  # bottom-right aligned causality: the sample alone (fewer keys) aligns its queries otherwise
    # the same sample without the masked keys at all gives the same output
    alone, _ = sf.Attend(**opts)(q[1:2].detach(), k[1:2, :, :4].detach(), v[1:2, :, :4].detach())
    if opts.get("head_learned_sink") or "pre_talking_heads" in opts or "post_talking_heads" in opts \
            or "pre_scale_post_talking_heads" in opts:
        return  # fresh parameters in the second module (identity-initialised convs / zero sink: still comparable)
    torch.testing.assert_close(out[1:2].detach(), alone, atol=1e-5, rtol=1e-5)


def test_grouped_key_value_heads_pair_as_x_transformers():
    theirs, ours = _pair(dict(sigmoid=True))
    q, k, v, mask = _inputs(3, kv_heads=1)
    torch.testing.assert_close(ours(q, k, v, mask=mask)[0][:2], theirs(q, k, v, mask=mask)[0][:2], atol=1e-5,
                               rtol=1e-5)


def test_prev_attn_and_attn_delta_as_x_transformers_at_live_entries():
    theirs, ours = _pair({})
    q, k, v, mask = _inputs(4)
    g = torch.Generator().manual_seed(5)
    prev = torch.randn(B, H, I, J, generator=g)
    delta = 0.1 * torch.randn(B, H, I, J, generator=g)
    mask2 = mask.clone()
    mask2[1] = True  # x-transformers adds the delta at masked keys too: compare where none is masked
    ref, _ = theirs(q, k, v, mask=mask2, prev_attn=prev, attn_delta=delta)
    out, _ = ours(q, k, v, mask=mask2, prev_attn=prev, attn_delta=delta)
    torch.testing.assert_close(out[:2], ref[:2], atol=1e-5, rtol=1e-5)
    out, inter = ours(q, k, v, mask=mask, attn_delta=delta)  # nothing at masked keys
    assert (inter.post_softmax_attn[1, :, :, 4:] == 0).all() and (out[2] == 0).all()


def test_gumbel_and_inverted_run_safely():
    q, k, v, mask = _inputs(6)
    out, inter = sf.Attend(gumbel_softmax=True)(q, k, v, mask=mask)
    w = inter.post_softmax_attn
    assert torch.isfinite(out).all() and (w[1, :, :, 4:] == 0).all() and (w.sum(-1)[:2] - 1).abs().max() < 1e-5
    out, inter = sf.Attend(inverted_attention=True)(q, k, v, mask=mask)
    theirs = xt_attend.Attend(inverted_attention=True)(q, k, v, mask=mask)[0]
    torch.testing.assert_close(out[:2], theirs[:2], atol=1e-5, rtol=1e-5)  # key padding: the same numbers
    assert (out[2] == 0).all()


def test_custom_attn_fn_in_attention_equals_x_transformers_on_the_same_weights():
    fn = lambda t: F.relu(t) ** 2  # noqa: E731
    torch.manual_seed(0)
    theirs = xt.TransformerWrapper(num_tokens=20, max_seq_len=16,
                                   attn_layers=xt.Decoder(dim=16, depth=2, heads=2, attn_dim_head=8,
                                                          attn_custom_attn_fn=fn))
    ours = sf.TransformerWrapper(num_tokens=20, max_seq_len=16,
                                 attn_layers=sf.Decoder(dim=16, depth=2, heads=2, attn_dim_head=8,
                                                        attn_custom_attn_fn=fn))
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.2 * torch.randn(p.shape))
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randint(0, 20, (2, 7))
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    torch.testing.assert_close(ours(x, mask=mask)[mask], theirs(x, mask=mask)[mask], atol=1e-5, rtol=1e-5)


def test_bad_values_are_named():
    for opts, exc, word in ((dict(custom_attn_fn=3), TypeError, "custom_attn_fn"),
                            (dict(custom_attn_fn=abs, sigmoid=True), ValueError, "custom_attn_fn"),
                            (dict(sdp_kwargs=dict(enable_math="yes")), ValueError, "sdp_kwargs"),
                            (dict(sparse_topk=0), ValueError, "sparse_topk"),
                            (dict(pre_talking_heads=True), ValueError, "heads"),
                            (dict(scale=float("nan")), ValueError, "scale"),
                            (dict(cope=torch.nn.Linear(2, 2)), TypeError, "cope"),
                            (dict(sigmoid=1), TypeError, "sigmoid")):
        with pytest.raises(exc, match=word):
            sf.Attend(**opts)
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError, match="custom_attn_fn"):
        sf.Attend(custom_attn_fn=lambda t: t.sum(-1))(q, q, q)


def test_sdp_kwargs_choose_among_the_kernels_named():
    common = dict(device_type="cpu", dtype=torch.float32, head_dim=8, q_len=4, k_len=4, heads=2, kv_heads=2,
                  mask_kind="padding", causal=False)
    assert plan_attention(**common, backend=("math",)).expected == "math"
    assert plan_attention(**common, backend=("flash",)).expected == "flash"
    with pytest.raises(ValueError, match="none of the SDPA kernels"):
        plan_attention(**common, backend=("efficient",))  # a CUDA kernel only
    cuda = dict(common, device_type="cuda", dtype=torch.float16, mask_kind="none")
    assert plan_attention(**cuda, backend=("efficient", "math")).sdpa_backends == ("efficient", "math")
    assert plan_attention(**cuda, backend=("flash", "efficient", "math", "cudnn")).expected == "flash"
    with pytest.raises(ValueError, match="SDPA kernels allowed"):
        plan_attention(**common, backend=("fast",))
    # the same numbers whichever kernel runs
    q, k, v, mask = _inputs(7)
    a, _ = sf.Attend(sdp_kwargs=dict(enable_flash=False, enable_mem_efficient=False))(q, k, v, mask=mask)
    b, _ = sf.Attend()(q, k, v, mask=mask)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


_SMOOTH = sorted(k for k in OPTIONS if "topk" not in k and k != "hard")  # ties may flip a hard choice in half types


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", _SMOOTH)
def test_half_and_single_precision_against_float64(name, dtype):
    """Each option in a lower dtype against the same call in float64 on the same (rounded) inputs, within the
    dtype's attention tolerance; masked content still reaches nothing."""
    from helpers.numerics import ATTEND_TOL, assert_close

    _, ours = _pair(OPTIONS[name])
    q, k, v, mask = _inputs(8)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    k = k.masked_fill(~mask[:, None, :, None], float("nan"))
    low, _ = ours.to(dtype)(q, k, v, mask=mask)
    ref, _ = ours.double()(q.double(), k.double(), v.double(), mask=mask)
    assert_close(low, ref, f"Attend({name})", dtype, table=ATTEND_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_new_attention_keywords_in_half_precision_against_float64(dtype):
    """``on_attn``, ``value_dim_head`` and the deltas in a half type against float64 on the same weights."""
    from helpers.numerics import MODEL_TOL, assert_close

    torch.manual_seed(0)
    attn = sf.Attention(16, heads=2, dim_head=8, on_attn=True, value_dim_head=6, custom_attn_fn=lambda t: t.softmax(-1))
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 5, 16, generator=g).to(dtype)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    d = dict(q_delta=0.1 * torch.randn(2, 5, 16, generator=g), o_delta=0.1 * torch.randn(2, 5, 12, generator=g))
    low = attn.to(dtype)(x, mask=mask, **{k: t.to(dtype) for k, t in d.items()})
    ref = attn.double()(x.double(), mask=mask, **{k: t.to(dtype).double() for k, t in d.items()})
    assert_close(low[mask], ref[mask], "Attention(on_attn, value_dim_head, deltas)", dtype, table=MODEL_TOL)
