"""Named regression tests for the doors an adversarial review found open (one test per finding).

Each test states the finding it guards; each failed on the code before the fix. The clause-by-clause
suites (test_doors.py, test_contract_models.py, test_contract_guidance.py) cover the same doors with
drawn inputs; these pin the exact cases that were reported.

Shape legend: b batch, h heads, i queries, j keys, d head dim, n positions, c width, v vocabulary.
"""

from __future__ import annotations

import helpers as hp
import pytest
import torch

import safeformer as sf

NAN, INF = float("nan"), float("inf")


def _leaf(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_()


# ----------------------------------------------------------------------------------------------------
# 1. attend with a bias that alone masks a row
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "reference", "math", "flash"])
@pytest.mark.parametrize(("dtype", "neg"), [(torch.float32, -INF), (torch.float16, -1e9), (torch.bfloat16, -INF)],
                         ids=["fp32-inf", "fp16-1e9", "bf16-inf"])
def test_attend_row_masked_only_by_the_bias_is_dead(backend, dtype, neg):
    """A row whose bias is -inf everywhere (or -1e9, which is -inf in float16) is a dead row: exactly 0
    with zero gradient, on every backend, and also under a kernel that returns NaN for it."""
    q, k, v = _leaf(2, 2, 3, 8, dtype=dtype), _leaf(2, 2, 4, 8, dtype=dtype, seed=1), _leaf(2, 2, 4, 8, dtype=dtype, seed=2)
    bias = torch.zeros(2, 2, 3, 4)
    bias[0, :, 1] = neg
    bias[1, :, :, 2] = neg  # key 2 of sample 1 masked for every query by the bias alone
    v_dirty = v.detach().clone()
    v_dirty[1, :, 2] = NAN
    v_dirty.requires_grad_()
    for kernel in (None, hp.NaNKernel(torch.tensor([[False, True, False], [False] * 3])[:, None, :])):
        ctx = sf.testing.substitute_kernel(kernel) if kernel else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with ctx:
            out = sf.attend(q, k, v_dirty, bias=bias.to(dtype), backend=backend)
            gq, gk, gv = torch.autograd.grad((out.float() * torch.randn(out.shape)).sum(), (q, k, v_dirty))
        hp.assert_zero(out[0, :, 1], "row masked by the bias")
        hp.assert_zero(gq[0, :, 1], "grad of q at that row")
        hp.assert_zero(gv[1, :, 2], "grad of v at the key masked by the bias")
        for name, t in (("out", out), ("grad q", gq), ("grad k", gk), ("grad v", gv)):
            hp.assert_finite(t, name)


def test_attention_module_bias_masks_like_a_mask():
    """``Attention`` given a -inf bias and no bool mask: NaN in x at a key masked only by the bias reaches
    nothing, and (with projection biases) the dead row is exactly 0."""
    torch.manual_seed(0)
    attn = sf.Attention(16, heads=2, dim_head=8, bias=True)
    x = torch.randn(2, 4, 16)
    bias = torch.zeros(1, 2, 4, 4)
    bias[..., 3] = -INF  # key 3 masked for every query
    bias[..., 0, :] = -INF  # query 0 dead
    bias[..., 3, :] = -INF  # query 3 dead: position 3 is then neither key nor query
    out = attn(x.clone().requires_grad_(), bias=bias)
    out.backward(torch.ones_like(out))
    want = {n: p.grad.clone() for n, p in attn.named_parameters()}
    attn.zero_grad()
    dirty = x.clone()
    dirty[:, 3] = NAN
    dirty.requires_grad_()
    out2 = attn(dirty, bias=bias)
    hp.assert_zero(out2[:, 0], "the row dead by the bias (with projection biases)")
    hp.assert_zero(out2[:, 3], "the other row dead by the bias")
    hp.assert_bitwise(out2, out, "outputs with NaN at a position the bias masks")
    out2.backward(torch.ones_like(out2))
    for n, p in attn.named_parameters():
        hp.assert_bitwise(p.grad, want[n], f"grad of {n}")
    hp.assert_zero(dirty.grad[:, 3], "grad of x at the masked position")


# ----------------------------------------------------------------------------------------------------
# 2, 3. Attention alone: padding of x, and keys/values handed in
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_attention_alone_with_padding_mask_and_nan_in_padded_x(causal):
    """The documented (b, j) padding mask in self-attention pads x itself: NaN at padded positions gives
    no NaN in any weight gradient or in x.grad, and padded outputs are exactly 0."""
    torch.manual_seed(0)
    attn = sf.Attention(16, heads=2, dim_head=8, qk_norm=True, bias=True)
    mask = torch.tensor([[True, True, True, False, False], [False, True, True, True, True]])
    x = torch.randn(2, 5, 16)
    x[~mask] = NAN
    x.requires_grad_()
    out = attn(x, mask=mask, causal=causal)
    out.backward(torch.randn(out.shape))
    hp.assert_finite(out, "output")
    hp.assert_zero(out[~mask], "padded outputs")
    hp.assert_zero(x.grad[~mask], "grad of x at padding")
    for n, p in attn.named_parameters():
        hp.assert_finite(p.grad, f"grad of {n}")


def test_attention_kv_and_past_kv_with_nan_at_masked_keys():
    """Keys/values handed to ``Attention`` (``kv=`` for cross-attention, ``past_kv=`` for a cache) are
    input: NaN at their masked positions changes nothing."""
    torch.manual_seed(0)
    attn = sf.Attention(16, heads=2, dim_head=8)
    ctx, cm = torch.randn(2, 4, 16), torch.tensor([[True, True, False, False], [True, False, False, False]])
    x = torch.randn(2, 3, 16)
    ref = attn(x, ctx, mask=cm)
    k, v = (t.detach().clone() for t in attn.project_kv(ctx))
    k[~cm[:, None, :, None].expand_as(k)] = NAN
    v[~cm[:, None, :, None].expand_as(v)] = INF
    out = attn(x, mask=cm, kv=(k, v))
    hp.assert_bitwise(out, ref, "cross-attention from kv with NaN at masked keys")
    past_mask = torch.tensor([[False, True, True], [True, True, True]])
    pk, pv = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    step = torch.randn(2, 1, 16)
    full_mask = torch.cat((past_mask, torch.ones(2, 1, dtype=torch.bool)), 1)
    ref = attn(step, mask=full_mask, past_kv=(pk, pv))
    pk[0, :, 0], pv[0, :, 0] = NAN, -INF
    out = attn(step, mask=full_mask, past_kv=(pk, pv))
    hp.assert_bitwise(out, ref, "past_kv with NaN at a masked slot")


# ----------------------------------------------------------------------------------------------------
# 4. caches and contexts
# ----------------------------------------------------------------------------------------------------


def _decoder():
    torch.manual_seed(0)
    return sf.Decoder(dim=16, depth=2, heads=2, dim_head=8, cross_attend=True)


def test_cache_keeps_its_context_mask_and_refuses_another_context():
    """A dropped condition (all-False context_mask row) stays dropped on cached steps, also when the very
    same context and mask are passed again; a different context, or the context without its mask, is
    an error (never silently ignored)."""
    dec = _decoder()
    x = torch.randn(2, 3, 16)
    ctx = torch.randn(2, 2, 16)
    cm = torch.tensor([[True, True], [False, False]])  # sample 1: condition dropped
    _, cache = dec(x, context=ctx, context_mask=cm, return_cache=True)
    step = torch.randn(2, 1, 16)
    cached = dec(step, cache=cache)
    again = dec(step, cache=cache, context=ctx, context_mask=cm)
    hp.assert_bitwise(again, cached, "the same context passed again")
    full = dec(torch.cat((x, step), 1), context=ctx, context_mask=cm)[:, -1:]
    hp.assert_close(cached, full, "cached step vs full forward", torch.float32)
    with pytest.raises(ValueError, match="context"):
        dec(step, cache=cache, context=ctx)  # the mask dropped: sample 1 would be conditioned again
    with pytest.raises(ValueError, match="context"):
        dec(step, cache=cache, context=torch.randn(2, 2, 16), context_mask=cm)
    _, plain = dec(x, return_cache=True)
    with pytest.raises(ValueError, match="context"):
        dec(step, cache=plain, context=ctx)  # earlier positions never saw this context


def test_cache_of_another_batch_or_depth_is_a_clear_error():
    dec = _decoder()
    _, cache = dec(torch.randn(2, 3, 16), context=torch.randn(2, 2, 16), return_cache=True)
    with pytest.raises(ValueError, match="batch"):
        dec(torch.randn(3, 1, 16), cache=cache)
    torch.manual_seed(0)
    shallow = sf.CrossAttender(dim=16, depth=1, heads=2, dim_head=8)
    deep = sf.CrossAttender(dim=16, depth=2, heads=2, dim_head=8)
    _, c2 = deep(torch.randn(2, 3, 16), context=torch.randn(2, 2, 16), return_cache=True)
    with pytest.raises(ValueError, match="cross-attention layers"):
        shallow(torch.randn(2, 1, 16), cache=c2)


def test_context_of_another_dtype_is_a_clear_error():
    dec = _decoder()
    with pytest.raises(TypeError, match="context"):
        dec(torch.randn(2, 3, 16), context=torch.randn(2, 2, 16, dtype=torch.float64))


# ----------------------------------------------------------------------------------------------------
# 5. half-precision reductions
# ----------------------------------------------------------------------------------------------------


def test_masked_mean_float16_accumulates_in_float32():
    x = torch.full((1, 8000, 1), 10.0, dtype=torch.float16)
    mask = torch.ones(1, 8000, dtype=torch.bool)
    assert sf.masked_mean(x, mask).item() == 10.0
    assert sf.masked_mean(x, None).item() == 10.0


def test_return_pooled_of_a_half_encoder_over_1024_tokens_is_accurate():
    torch.manual_seed(0)
    model = sf.TransformerWrapper(num_tokens=7, max_seq_len=1024,
                                  attn_layers=sf.Encoder(dim=16, depth=1, heads=2, dim_head=8))
    model.attn_layers.final_norm = sf.nn.modules.LayerNorm(16, unit_offset=True, bias=True)  # a shift to set
    model = model.half()
    with torch.no_grad():
        model.attn_layers.final_norm.bias.fill_(100.0)  # large hidden states: a float16 sum of 1024 overflows
    ids = torch.randint(0, 7, (2, 1024))
    mask = torch.ones(2, 1024, dtype=torch.bool)
    mask[1, 700:] = False
    with torch.no_grad():
        pooled = model(ids, mask=mask, return_pooled=True)
        h = model(ids, mask=mask, return_embeddings=True).double()
    want = torch.stack([h[s, mask[s]].mean(0) for s in range(2)])
    hp.assert_close(pooled.double(), want, "pooled float16 vs float64 mean", torch.float16)


# ----------------------------------------------------------------------------------------------------
# 6. guided_logits in half precision and with banned tokens
# ----------------------------------------------------------------------------------------------------


def test_guided_logits_half_inputs_large_scale_and_banned_tokens():
    cond = torch.tensor([[30000.0, -30000.0, 1.0, -INF]], dtype=torch.float16)
    uncond = torch.tensor([[-30000.0, 30000.0, 2.0, -INF]], dtype=torch.float16)
    out = sf.guided_logits(cond, uncond, 7.5)
    assert out.dtype == torch.float32
    want = uncond[0, :3].double() + 7.5 * (cond[0, :3].double() - uncond[0, :3].double())
    hp.assert_close(out[0, :3].double(), want, "guided logits vs float64", torch.float32)
    assert out[0, 3].item() == -INF, "a token banned in both branches must stay -inf, not NaN"
    resc = sf.guided_logits(cond, uncond, 7.5, guidance_rescale=0.7)
    assert torch.isfinite(resc[0, :3]).all() and resc[0, 3].item() == -INF


# ----------------------------------------------------------------------------------------------------
# 7. positions
# ----------------------------------------------------------------------------------------------------


def test_positions_one_dimensional_are_shared_and_wrong_shapes_refused():
    """1-D ``positions`` (n,) mean the same positions for every sample (they used to fail inside rotary,
    and when heads == n run silently with the wrong output)."""
    torch.manual_seed(0)
    n = 4
    dec = sf.Decoder(dim=16, depth=1, heads=n, dim_head=4, rotary_pos_emb=True)
    x = torch.randn(2, n, 16)
    pos = torch.tensor([3, 4, 5, 6])
    hp.assert_bitwise(dec(x, positions=pos), dec(x, positions=pos[None].expand(2, n)), "(n,) vs (b, n) positions")
    for bad, exc in ((torch.zeros(2, n, 1, dtype=torch.long), ValueError), (torch.zeros(n + 1, dtype=torch.long), ValueError),
                     (torch.zeros(3, n, dtype=torch.long), ValueError), (torch.zeros(2, n), TypeError)):
        with pytest.raises(exc, match="positions"):
            dec(x, positions=bad)


# ----------------------------------------------------------------------------------------------------
# clear errors
# ----------------------------------------------------------------------------------------------------


def _net(vocab=11):
    torch.manual_seed(0)
    return sf.TransformerWrapper(num_tokens=vocab, max_seq_len=16,
                                 attn_layers=sf.Decoder(dim=16, depth=1, heads=2, dim_head=8, cross_attend=True))


def test_pad_value_only_fills_outputs_so_any_int_is_allowed():
    """pad_value marks positions after EOS in the output (x-transformers' code often uses -1); it is never
    embedded: a finished sample is fed its sampled token, and ignored inputs are masked before the lookup."""
    torch.manual_seed(0)
    net = _net(11)
    for pad in (-1, 11, 10):
        ar = sf.AutoregressiveWrapper(net, pad_value=pad, ignore_index=-1)
        prompts = torch.randint(0, 11, (4, 3))
        for cache_kv in (True, False):
            out = ar.generate(prompts, 12, eos_token=3, temperature=1.0, cache_kv=cache_kv)
            after = (out == 3).long().cumsum(1) - (out == 3).long() > 0  # positions after each sample's EOS
            assert bool((out[after] == pad).all()) and bool(((out[~after] >= 0) & (out[~after] < 11)).all())
        tokens = ar.beam_search(prompts, 4, beams=2, eos_token=3)
        assert tokens.shape == (4, 4)
        x = torch.randint(0, 11, (2, 6))
        x[0, 4:] = -1  # ignored targets, fed back as pad_value at masked positions: never looked up
        assert torch.isfinite(ar(x))
    sf.XTransformer(dim=16, enc_num_tokens=5, enc_max_seq_len=4, dec_num_tokens=5, dec_max_seq_len=4,
                    enc_depth=1, dec_depth=1, pad_value=-1)
    with pytest.raises(TypeError, match="pad_value"):
        sf.AutoregressiveWrapper(net, pad_value=True)
    with pytest.raises(TypeError, match="pad_value"):
        sf.generate_tokens(net, torch.zeros(1, 2, dtype=torch.long), 2, pad_value=0.5)


def test_generation_with_batch_size_zero_gives_empty_out():
    torch.manual_seed(0)
    wrapper = sf.AutoregressiveWrapper(_net())
    empty = torch.zeros(0, 3, dtype=torch.long)
    assert wrapper.generate(empty, 2).shape == (0, 2)
    assert wrapper.generate(empty, 2, context=torch.randn(0, 4, 16), cond_scale=3.0).shape == (0, 2)
    tokens, scores = wrapper.beam_search(empty, 2, beams=3, return_beams_and_scores=True)
    assert tokens.shape == (3, 0, 2) and scores.shape == (3, 0)
    assert sf.generate_tokens(wrapper.net, empty, 4).shape == (0, 4)
    with pytest.raises(TypeError, match="prompts"):  # the checks still run on an empty batch
        wrapper.generate(torch.zeros(0, 3), 2)
    cont = sf.ContinuousAutoregressiveWrapper(sf.ContinuousTransformerWrapper(
        dim_in=4, dim_out=4, max_seq_len=16, attn_layers=sf.Decoder(dim=16, depth=1, heads=2, dim_head=8)))
    assert cont.generate(torch.randn(0, 3, 4), 5).shape == (0, 5, 4)
    nar = sf.NonAutoregressiveWrapper(sf.TransformerWrapper(
        num_tokens=12, max_seq_len=8, attn_layers=sf.Encoder(dim=16, depth=1, heads=2, dim_head=8)), mask_id=11)
    assert nar.generate(batch_size=0).shape == (0, 8)


def test_logits_dim_zero_is_refused_not_replaced():
    with pytest.raises(ValueError, match="logits_dim"):
        sf.TransformerWrapper(num_tokens=5, max_seq_len=4, attn_layers=sf.Encoder(dim=8, depth=1), logits_dim=0)
    model = sf.TransformerWrapper(num_tokens=5, max_seq_len=4, attn_layers=sf.Encoder(dim=8, depth=1), logits_dim=3)
    assert model(torch.zeros(1, 2, dtype=torch.long)).shape == (1, 2, 3)


def test_token_ids_outside_the_vocabulary_at_real_positions_are_refused():
    net = _net(11)
    ids = torch.tensor([[1, 2, 11]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        net(ids)
    net(ids, mask=torch.tensor([[True, True, False]]))  # at a padded position: anything goes


def test_double_backward_works_on_every_backend():
    """A gradient penalty through the default CPU kernel (flash) and through backend='math' works and is
    finite (the default backend's double backward is the reference math's)."""
    torch.manual_seed(0)
    for backend in ("auto", "math"):
        enc = sf.Encoder(dim=16, depth=1, heads=2, dim_head=8, backend=backend)
        x = torch.randn(2, 3, 16, requires_grad=True)
        mask = torch.tensor([[True, True, False], [False, False, False]])
        out = enc(x, mask=mask)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (g.pow(2).sum()).backward()
        reached = {n: p.grad for n, p in enc.named_parameters() if p.grad is not None}
        assert any("layers.0.1.to_q" in n for n in reached), "the penalty's gradient never reached attention"
        for n, gr in reached.items():
            hp.assert_finite(gr, f"double-backward grad of {n}")
