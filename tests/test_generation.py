"""Tests of ``safeformer.decoding.generation``: the autoregressive wrapper, generation, the logit filters and
classifier-free guidance (training with dropped conditions, batched guided sampling).

References are written plainly: a float64 copy of the model decoded one sample at a time without a
KV cache, the guidance formula written out by hand, the filters as Python loops over sorted values.

Shape legend: b batch, n prompt positions, t generated tokens, j context length, c context width,
v vocabulary size.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import ATTEND_TOL, NaNKernel, assert_bitwise, assert_close, assert_finite, assert_zero, ref_guidance

from safeformer import ContinuousTransformerWrapper, Decoder, TransformerWrapper, XTransformer
from safeformer.core.conditions import drop_condition
from safeformer.decoding.generation import (
    AutoregressiveWrapper,
    generate_tokens,
    guided_logits,
    min_p,
    sample_logits,
    top_k,
    top_p,
)
from safeformer.testing import substitute_kernel

V, C, DIM = 24, 8, 32  # vocabulary, context width, model width
NAN = float("nan")


def make_net(pos: str = "abs", cross: bool = True, seed: int = 0) -> TransformerWrapper:
    torch.manual_seed(seed)
    layers = Decoder(
        dim=DIM, depth=2, heads=2, dim_head=16, cross_attend=cross, dim_context=C if cross else None,
        rotary_pos_emb=pos == "rotary", alibi_pos_bias=pos == "alibi",
    )
    return TransformerWrapper(num_tokens=V, max_seq_len=64, attn_layers=layers)


def make_context(b: int, j: int, seed: int = 1, lengths=None):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(b, j, C, generator=g) * 2  # (b, j, c)
    lengths = lengths or [j] * b
    mask = torch.arange(j)[None, :] < torch.tensor(lengths)[:, None]  # (b, j), right padding
    return ctx, mask


def left_pad(prompts: list[list[int]], garbage: int = 7):
    """Left-pad token lists; padded positions hold a real-looking id, which the mask must hide."""
    n = max(len(p) for p in prompts)
    tokens = torch.tensor([[garbage] * (n - len(p)) + p for p in prompts])
    mask = torch.tensor([[False] * (n - len(p)) + [True] * len(p) for p in prompts])
    return tokens, mask


def argmax_clear(logits64: torch.Tensor) -> torch.Tensor:
    """Greedy choice of a float64 reference, refusing near-ties (float32 may break them either way)."""
    top2 = logits64.topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).min())
    assert margin > 1e-4, f"reference has a near-tie (margin {margin:.2e}); pick another seed for this test"
    return logits64.argmax(-1)


def reference_greedy(net, prompt: list[int], steps: int, ctx=None, ctx_mask=None, uctx=None, uctx_mask=None,
                     scale: float = 1.0, phi: float = 0.0, eos: int | None = None, pad: int = 0):
    """One prompt alone, float64, no cache, no batching: the whole sequence is recomputed each step.

    With ``scale != 1`` the conditional and unconditional logits come from two separate forwards.
    """
    net64 = copy.deepcopy(net).double().eval()
    d = lambda t: None if t is None or not t.is_floating_point() else t.double()
    seq = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(steps):
            cond = net64(seq, context=d(ctx), context_mask=ctx_mask)[:, -1]
            logits = cond
            if scale != 1.0:
                uncond = net64(seq, context=d(uctx), context_mask=uctx_mask)[:, -1]
                logits = ref_guidance(cond, uncond, scale, phi)
            tok = int(argmax_clear(logits)[0])
            out.append(tok)
            if eos is not None and tok == eos:
                break
            seq = torch.cat((seq, torch.tensor([[tok]])), dim=1)
    return out + [pad] * (steps - len(out))


# ----------------------------------------------------------------------------------------------------
# cond_scale = 1 and 0
# ----------------------------------------------------------------------------------------------------


def test_cond_scale_one_is_exactly_plain_conditional_generation():
    net = make_net()
    model = AutoregressiveWrapper(net)
    prompts = torch.tensor([[3, 5, 1], [2, 2, 9]])
    ctx, ctx_mask = make_context(2, 5, lengths=[5, 3])
    neg, neg_mask = make_context(2, 4, seed=9, lengths=[2, 4])
    guided = model.generate(prompts, 10, context=ctx, context_mask=ctx_mask, temperature=0.0, cond_scale=1.0,
                            guidance_rescale=0.7, negative_context=neg, negative_context_mask=neg_mask)
    plain = model.generate(prompts, 10, context=ctx, context_mask=ctx_mask, temperature=0.0)
    assert torch.equal(guided, plain)
    for i in range(2):
        ref = reference_greedy(net, prompts[i].tolist(), 10, ctx[i : i + 1], ctx_mask[i : i + 1])
        assert guided[i].tolist() == ref, f"sample {i}"

    # sampling with a fixed seed: the unconditional branch never runs, so not even the RNG stream moves
    torch.manual_seed(123)
    sampled_guided = model.generate(prompts, 10, context=ctx, context_mask=ctx_mask, cond_scale=1.0,
                                    negative_context=neg, negative_context_mask=neg_mask, filter_logits_fn=top_k,
                                    filter_kwargs={"k": 5})
    torch.manual_seed(123)
    sampled_plain = model.generate(prompts, 10, context=ctx, context_mask=ctx_mask, filter_logits_fn=top_k,
                                   filter_kwargs={"k": 5})
    assert torch.equal(sampled_guided, sampled_plain)


@pytest.mark.parametrize("null_context", ["empty", "learned"])
def test_cond_scale_zero_is_exactly_unconditional_generation(null_context):
    net = make_net(seed=3)
    model = AutoregressiveWrapper(net, null_context=null_context)
    prompts, mask = left_pad([[4, 1, 8], [6], [2, 2, 3, 11]])
    ctx, ctx_mask = make_context(3, 6, lengths=[6, 2, 4])
    guided = model.generate(prompts, 9, mask=mask, context=ctx, context_mask=ctx_mask, temperature=0.0, cond_scale=0.0)
    if null_context == "empty":  # the null condition is the empty context: generation with context=None
        uncond = model.generate(prompts, 9, mask=mask, temperature=0.0)
        uctx = lambda i: (None, None)
    else:  # the learned null token is the unconditional model's whole context
        null = model.null_token.detach()[None].expand(3, -1, -1)
        uncond = model.generate(prompts, 9, mask=mask, context=null, temperature=0.0)
        uctx = lambda i: (null[i : i + 1], None)
    assert torch.equal(guided, uncond)
    for i, p in enumerate([[4, 1, 8], [6], [2, 2, 3, 11]]):
        assert guided[i].tolist() == reference_greedy(net, p, 9, *uctx(i)), f"sample {i}"

    # the logits themselves: the float64 unconditional model's
    logits = model.next_token_logits(prompts, mask=mask, context=ctx, context_mask=ctx_mask, cond_scale=0.0)
    net64 = copy.deepcopy(net).double().eval()
    for i, p in enumerate([[4, 1, 8], [6], [2, 2, 3, 11]]):
        c, _ = uctx(i)
        ref = net64(torch.tensor([p]), context=None if c is None else c.double())[:, -1]
        assert_close(logits[i : i + 1], ref, f"unconditional logits of sample {i}", torch.float32, table=ATTEND_TOL)


# ----------------------------------------------------------------------------------------------------
# Batched CFG == the two-pass formula
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale, phi", [(3.0, 0.0), (2.5, 0.7), (-0.5, 0.0)])
@pytest.mark.parametrize("negative", [False, True])
def test_batched_cfg_equals_two_pass_formula(scale, phi, negative):
    net = make_net(seed=7)
    model = AutoregressiveWrapper(net)
    prompt_lists = [[1, 2, 3], [9, 4], [5, 5, 6, 7]]
    prompts, mask = left_pad(prompt_lists)
    ctx, ctx_mask = make_context(3, 5, lengths=[5, 1, 3])
    if negative:  # a negative prompt of another length: padded to a common length inside, masked
        uctx, uctx_mask = make_context(3, 7, seed=4, lengths=[7, 2, 5])
        kw = dict(negative_context=uctx, negative_context_mask=uctx_mask)
    else:
        uctx, uctx_mask = ctx, torch.zeros_like(ctx_mask)
        kw = {}

    # one step of logits, against two separate float64 forwards and the formula by hand
    logits = model.next_token_logits(prompts, mask=mask, context=ctx, context_mask=ctx_mask, cond_scale=scale,
                                     guidance_rescale=phi, **kw)
    net64 = copy.deepcopy(net).double().eval()
    for i, p in enumerate(prompt_lists):
        seq = torch.tensor([p])
        cond = net64(seq, context=ctx[i : i + 1].double(), context_mask=ctx_mask[i : i + 1])[:, -1]
        uncond = net64(seq, context=uctx[i : i + 1].double(), context_mask=uctx_mask[i : i + 1])[:, -1]
        assert_close(logits[i : i + 1], ref_guidance(cond, uncond, scale, phi), f"guided logits of sample {i}",
                     torch.float32, table=ATTEND_TOL)

    # the generated tokens: batched (one forward of 2b, one cache) == two passes == float64 by hand
    tokens = model.generate(prompts, 8, mask=mask, context=ctx, context_mask=ctx_mask, temperature=0.0,
                            cond_scale=scale, guidance_rescale=phi, **kw)
    two_pass = generate_tokens(net, prompts, 8, mask=mask, context=ctx, context_mask=ctx_mask,
                               negative_context=uctx if negative else None,
                               negative_context_mask=uctx_mask if negative else None,
                               temperature=0.0, cond_scale=scale, guidance_rescale=phi, _two_pass=True)
    assert torch.equal(tokens, two_pass)
    for i, p in enumerate(prompt_lists):
        ref = reference_greedy(net, p, 8, ctx[i : i + 1], ctx_mask[i : i + 1], uctx[i : i + 1],
                               uctx_mask[i : i + 1], scale=scale, phi=phi)
        assert tokens[i].tolist() == ref, f"sample {i}"


def test_batched_cfg_with_learned_null_token_equals_formula():
    net = make_net(seed=6)
    model = AutoregressiveWrapper(net, null_context="learned")
    with torch.no_grad():
        model.null_token.normal_(0, 1.0)  # a trained-looking null token, far from the init
    prompts = torch.tensor([[3, 4], [8, 1]])
    ctx, ctx_mask = make_context(2, 4, lengths=[4, 2])
    logits = model.next_token_logits(prompts, context=ctx, context_mask=ctx_mask, cond_scale=4.0)
    net64 = copy.deepcopy(net).double().eval()
    null = model.null_token.detach().double()[None].expand(2, -1, -1)
    cond = net64(prompts, context=ctx.double(), context_mask=ctx_mask)[:, -1]
    uncond = net64(prompts, context=null)[:, -1]
    assert_close(logits, ref_guidance(cond, uncond, 4.0, 0.0), "guided logits", torch.float32, table=ATTEND_TOL)


# ----------------------------------------------------------------------------------------------------
# CFG training
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("null_context", ["empty", "learned"])
def test_training_with_cond_drop_prob_one_gives_finite_loss_and_grads(null_context):
    net = make_net(seed=7)
    model = AutoregressiveWrapper(net, cond_drop_prob=1.0, null_context=null_context).train()
    x = torch.randint(0, V, (3, 9), generator=torch.Generator().manual_seed(2))
    ctx, ctx_mask = make_context(3, 5, lengths=[5, 0, 2])  # one sample's context is all padding already
    ctx = torch.where(ctx_mask[..., None], ctx, NAN)  # garbage in padding must not matter
    loss = model(x, context=ctx, context_mask=ctx_mask)
    loss.backward()
    assert_finite(loss, "loss")
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert_finite(p.grad, f"grad of {name}")

    # every condition was dropped: the loss is the unconditional model's, computed in float64
    net64 = copy.deepcopy(net).double().eval()
    null = None if null_context == "empty" else model.null_token.detach().double()[None].expand(3, -1, -1)
    logits = net64(x[:, :-1], context=null)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1))
    assert_close(loss.detach(), ref, "loss with every condition dropped", torch.float32, table=ATTEND_TOL)
    if null_context == "learned":
        assert model.null_token.grad is not None and bool(model.null_token.grad.abs().sum() > 0)


def test_cond_drop_prob_drops_about_that_share_of_samples():
    ctx = torch.randn(4000, 3, C)
    _, mask = drop_condition(None, 0.3, context=ctx)
    dropped = ~mask.any(1)
    assert 0.27 < float(dropped.float().mean()) < 0.33
    assert bool(mask[~dropped].all())  # a kept sample keeps its whole mask


def test_xtransformer_cond_drop_prob_one_is_the_unconditioned_decoder():
    torch.manual_seed(0)
    xt = XTransformer(dim=DIM, enc_num_tokens=V, enc_max_seq_len=16, dec_num_tokens=V, dec_max_seq_len=16,
                      enc_depth=1, dec_depth=1, enc_heads=2, dec_heads=2, dim_head=16, cond_drop_prob=1.0)
    assert xt.get_config()["cond_drop_prob"] == 1.0
    src, tgt = torch.randint(0, V, (2, 5)), torch.randint(0, V, (2, 7))
    loss = xt.train()(src, tgt)
    loss.backward()
    assert_finite(loss, "loss")
    for name, p in xt.named_parameters():
        if p.grad is not None:
            assert_finite(p.grad, f"grad of {name}")
    dec64 = copy.deepcopy(xt.decoder.net).double().eval()
    ref = torch.nn.functional.cross_entropy(dec64(tgt[:, :-1]).reshape(-1, V), tgt[:, 1:].reshape(-1))
    assert_close(loss.detach(), ref, "XTransformer loss with every source dropped", torch.float32, table=ATTEND_TOL)
    # the encoder got no gradient path: every source was dropped (exactly zero, not NaN)
    assert_zero(xt.encoder.token_emb.weight.grad, "encoder embedding grad")


def test_continuous_wrapper_with_condition_dropout():
    torch.manual_seed(0)
    model = ContinuousTransformerWrapper(
        dim_in=6, dim_out=6, max_seq_len=32,
        attn_layers=Decoder(dim=DIM, depth=2, heads=2, dim_head=16, cross_attend=True, dim_context=C),
    )
    x = torch.randn(4, 5, 6)
    ctx, ctx_mask = make_context(4, 3, lengths=[3, 1, 2, 3])
    ctx = torch.where(ctx_mask[..., None], ctx, NAN)
    dropped = torch.tensor([True, False, True, False])

    # default null condition: dropped samples equal the model without context, kept ones are unchanged
    c2, m2 = drop_condition(ctx_mask, dropped=dropped, context=ctx)
    out = model(x, context=c2, context_mask=m2)
    model64 = copy.deepcopy(model).double()
    no_ctx = model64(x.double())
    with_ctx = model64(x.double(), context=torch.where(ctx_mask[..., None], ctx, 0).double(), context_mask=ctx_mask)
    assert_close(out[dropped], no_ctx[dropped], "dropped samples", torch.float32, table=ATTEND_TOL)
    assert_close(out[~dropped], with_ctx[~dropped], "kept samples", torch.float32, table=ATTEND_TOL)

    # learned null token: dropped samples see exactly that one token; it gets a finite gradient
    null = torch.nn.Parameter(torch.randn(1, C))
    c3, m3 = drop_condition(ctx_mask, 1.0, context=ctx, null_context=null)
    out = model(x, context=c3, context_mask=m3)
    ref = model64(x.double(), context=null.detach().double()[None].expand(4, -1, -1))
    assert_close(out, ref, "null-token outputs", torch.float32, table=ATTEND_TOL)
    out.square().mean().backward()
    assert_finite(null.grad, "null token grad")
    assert bool(null.grad.abs().sum() > 0)
    for name, p in model.named_parameters():
        assert_finite(p.grad, f"grad of {name}")


@pytest.mark.parametrize("how", ["ignore_index", "mask"])
def test_all_ignored_loss_is_exactly_zero_with_zero_grads(how):
    net = make_net(seed=8)
    model = AutoregressiveWrapper(net, cond_drop_prob=0.5, null_context="learned").train()
    x = torch.randint(0, V, (2, 6))
    mask = None
    if how == "ignore_index":
        x = torch.full((2, 6), -100)
    else:
        mask = torch.zeros(2, 6, dtype=torch.bool)
    ctx, ctx_mask = make_context(2, 3)
    loss = model(x, mask=mask, context=ctx, context_mask=ctx_mask)
    loss.backward()
    assert loss.item() == 0.0 and not torch.isnan(loss)
    assert_zero(net.token_emb.weight.grad, "token embedding grad")
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert_zero(p.grad, f"grad of {name}")


# ----------------------------------------------------------------------------------------------------
# Padding, cache, NaN, eos
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pos", ["abs", "rotary", "alibi"])
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_left_padded_prompt_batch_generates_what_each_prompt_generates_alone(pos, scale):
    net = make_net(pos, seed=11)
    model = AutoregressiveWrapper(net)
    prompt_lists = [[5, 1], [3, 3, 9, 14, 2], [17], [8, 6, 4]]
    prompts, mask = left_pad(prompt_lists)
    ctx, ctx_mask = make_context(4, 4, lengths=[4, 2, 0, 3])
    batch = model.generate(prompts, 7, mask=mask, context=ctx, context_mask=ctx_mask, temperature=0.0, cond_scale=scale)
    for i, p in enumerate(prompt_lists):
        alone = model.generate(torch.tensor([p]), 7, context=ctx[i : i + 1], context_mask=ctx_mask[i : i + 1],
                               temperature=0.0, cond_scale=scale)
        assert batch[i].tolist() == alone[0].tolist(), f"sample {i}"
        uctx, umask = ctx[i : i + 1], torch.zeros_like(ctx_mask[i : i + 1])
        ref = reference_greedy(net, p, 7, ctx[i : i + 1], ctx_mask[i : i + 1], uctx, umask, scale=scale)
        assert alone[0].tolist() == ref, f"sample {i} vs float64 reference"


@pytest.mark.parametrize("cache_kv", [True, False])
def test_right_or_middle_padded_prompts_generate_what_each_prompt_generates_alone(cache_kv):
    net = make_net("rotary", seed=17)
    model = AutoregressiveWrapper(net)
    prompts = torch.tensor([[5, 1, 0, 0], [3, 0, 9, 0], [8, 6, 4, 2]])  # padding at the end / in the middle
    mask = torch.tensor([[True, True, False, False], [True, False, True, False], [True] * 4])
    ctx, ctx_mask = make_context(3, 3, lengths=[3, 1, 2])
    batch = model.generate(prompts, 6, mask=mask, context=ctx, context_mask=ctx_mask, temperature=0.0,
                           cond_scale=2.0, cache_kv=cache_kv)
    for i, p in enumerate([[5, 1], [3, 9], [8, 6, 4, 2]]):
        ref = reference_greedy(net, p, 6, ctx[i : i + 1], ctx_mask[i : i + 1], ctx[i : i + 1],
                               torch.zeros_like(ctx_mask[i : i + 1]), scale=2.0)
        assert batch[i].tolist() == ref, f"sample {i}"


@pytest.mark.parametrize("pos", ["abs", "rotary", "alibi"])
def test_cached_generation_equals_uncached(pos):
    net = make_net(pos, seed=12)
    model = AutoregressiveWrapper(net)
    prompts, mask = left_pad([[5, 1, 2], [3], [7, 7]])
    ctx, ctx_mask = make_context(3, 5, lengths=[5, 2, 0])
    for scale, phi in [(1.0, 0.0), (2.0, 0.5)]:
        common = dict(mask=mask, context=ctx, context_mask=ctx_mask, cond_scale=scale, guidance_rescale=phi)
        cached = model.generate(prompts, 12, temperature=0.0, cache_kv=True, **common)
        uncached = model.generate(prompts, 12, temperature=0.0, cache_kv=False, **common)
        assert torch.equal(cached, uncached), f"greedy, cond_scale={scale}"
        # the first token's logits agree too (the cached and uncached paths both start from the prompt)
        torch.manual_seed(5)
        sampled_cached = model.generate(prompts, 12, temperature=1.0, cache_kv=True, **common)
        torch.manual_seed(5)
        sampled_uncached = model.generate(prompts, 12, temperature=1.0, cache_kv=False, **common)
        assert torch.equal(sampled_cached, sampled_uncached), f"sampled, cond_scale={scale}"


@pytest.mark.parametrize("value", [NAN, float("inf"), -1e30])
def test_nan_planted_in_padded_context_changes_no_generated_token(value):
    net = make_net(seed=13)
    model = AutoregressiveWrapper(net)
    prompts, mask = left_pad([[2, 4, 6], [1, 3]])
    ctx, ctx_mask = make_context(2, 6, lengths=[4, 1])
    neg, neg_mask = make_context(2, 3, seed=3, lengths=[1, 2])
    bad_ctx = torch.where(ctx_mask[..., None], ctx, value)
    bad_neg = torch.where(neg_mask[..., None], neg, value)
    for kw in [dict(cond_scale=1.0), dict(cond_scale=3.0, guidance_rescale=0.5),
               dict(cond_scale=2.0, negative_context_mask=neg_mask)]:
        clean_kw = dict(kw, negative_context=neg) if "negative_context_mask" in kw else kw
        bad_kw = dict(kw, negative_context=bad_neg) if "negative_context_mask" in kw else kw
        clean = model.generate(prompts, 10, mask=mask, context=ctx, context_mask=ctx_mask, temperature=0.0, **clean_kw)
        dirty = model.generate(prompts, 10, mask=mask, context=bad_ctx, context_mask=ctx_mask, temperature=0.0, **bad_kw)
        assert torch.equal(clean, dirty), f"{kw}"
        logits_clean = model.next_token_logits(prompts, mask=mask, context=ctx, context_mask=ctx_mask, **clean_kw)
        logits_dirty = model.next_token_logits(prompts, mask=mask, context=bad_ctx, context_mask=ctx_mask, **bad_kw)
        assert_bitwise(logits_dirty, logits_clean, f"next-token logits with {kw}")


def test_guided_generation_does_not_trust_the_kernel_on_empty_contexts():
    """S6 for guidance: a kernel that writes NaN for every sample whose keys are all masked (the
    unconditional half of the CFG batch) changes no logit and no token."""
    empties = []

    def empty_samples(q, k, v, attn_mask):  # (b, 1, 1): every key masked (attend selects masked keys to 0)
        empty = (k == 0).flatten(1).all(1)
        empties.append(int(empty.sum()))
        return empty[:, None, None]

    kernel = NaNKernel(empty_samples)

    model = AutoregressiveWrapper(make_net(seed=18))
    prompts, mask = left_pad([[2, 4, 6], [1, 3]])
    ctx, ctx_mask = make_context(2, 4, lengths=[4, 0])  # sample 1 has an empty context in both branches
    kw = dict(mask=mask, context=ctx, context_mask=ctx_mask, cond_scale=3.0, guidance_rescale=0.3)
    clean_logits = model.next_token_logits(prompts, **kw)
    clean_tokens = model.generate(prompts, 8, temperature=0.0, **kw)
    with substitute_kernel(kernel):
        logits = model.next_token_logits(prompts, **kw)
        tokens = model.generate(prompts, 8, temperature=0.0, **kw)
    assert sum(empties) > 0, "the kernel never saw an empty context: the test would prove nothing"
    assert_bitwise(logits, clean_logits, "guided logits under a NaN kernel")
    assert torch.equal(tokens, clean_tokens)


def test_each_sample_stops_at_its_own_eos_token():
    net = make_net(seed=17)
    model = AutoregressiveWrapper(net, pad_value=V - 1)
    prompts, mask = left_pad([[1, 2], [3, 4, 5], [6]])
    ctx, ctx_mask = make_context(3, 3)
    free = model.generate(prompts, 12, mask=mask, context=ctx, context_mask=ctx_mask, temperature=0.0)
    k = next(k for k in range(2, 12) if int(free[0, k]) not in free[0, :k].tolist())  # a token sample 0 first
    eos = int(free[0, k])  # produces mid-way (at step k)
    stopped = model.generate(prompts, 12, mask=mask, context=ctx, context_mask=ctx_mask, temperature=0.0,
                             eos_token=eos)
    assert stopped.shape == (3, 12)
    for i in range(3):
        row = free[i].tolist()
        cut = row.index(eos) + 1 if eos in row else len(row)
        expected = row[:cut] + [V - 1] * (12 - cut)
        assert stopped[i].tolist() == expected, f"sample {i}"
    assert int(stopped[0, k]) == eos and (stopped[0, k + 1:] == V - 1).all()

    # every sample stops on its first token: generation ends at once, the rest is padding
    first = int(free[0, 0])
    one = model.generate(prompts[:1], 12, mask=mask[:1], context=ctx[:1], context_mask=ctx_mask[:1],
                         temperature=0.0, eos_token=first)
    assert one.tolist() == [[first] + [V - 1] * 11]


def test_checkpoint_round_trip_generates_the_same_tokens(tmp_path):
    model = AutoregressiveWrapper(make_net(seed=15), null_context="learned", cond_drop_prob=0.2, pad_value=3)
    model.save_pretrained(tmp_path)
    loaded = AutoregressiveWrapper.from_pretrained(tmp_path)
    assert loaded.null_context == "learned" and loaded.cond_drop_prob == 0.2 and loaded.pad_value == 3
    prompts = torch.tensor([[1, 2, 3]])
    ctx, ctx_mask = make_context(1, 2)
    a = model.generate(prompts, 6, context=ctx, context_mask=ctx_mask, temperature=0.0, cond_scale=2.0)
    b = loaded.generate(prompts, 6, context=ctx, context_mask=ctx_mask, temperature=0.0, cond_scale=2.0)
    assert torch.equal(a, b)
    assert_bitwise(loaded.null_token.detach(), model.null_token.detach(), "null token")


def test_xtransformer_generate_with_guidance():
    torch.manual_seed(0)
    xt = XTransformer(dim=DIM, enc_num_tokens=V, enc_max_seq_len=16, dec_num_tokens=V, dec_max_seq_len=16,
                      enc_depth=1, dec_depth=2, enc_heads=2, dec_heads=2, dim_head=16)
    src = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))
    src_mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    start = torch.zeros(2, 1, dtype=torch.long)
    enc = xt.eval().encode(src, src_mask).detach()
    for scale in (1.0, 0.0, 2.5):
        out = xt.generate(src, start, 6, mask=src_mask, cond_scale=scale, temperature=0.0)
        for i in range(2):
            ref = reference_greedy(xt.decoder.net, [0], 6, enc[i : i + 1], src_mask[i : i + 1], enc[i : i + 1],
                                   torch.zeros_like(src_mask[i : i + 1]), scale=scale)
            assert out[i].tolist() == ref, f"cond_scale={scale}, sample {i}"
    # a negative source (one for the whole batch) replaces the empty one in the unconditional branch
    neg = torch.randint(0, V, (1, 4), generator=torch.Generator().manual_seed(2))
    out = xt.generate(src, start, 6, mask=src_mask, cond_scale=2.5, negative_src=neg, temperature=0.0)
    neg_enc = xt.encode(neg).detach()
    for i in range(2):
        ref = reference_greedy(xt.decoder.net, [0], 6, enc[i : i + 1], src_mask[i : i + 1], neg_enc, None, scale=2.5)
        assert out[i].tolist() == ref, f"negative source, sample {i}"


# ----------------------------------------------------------------------------------------------------
# guided_logits and the filters against plain references
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [0.0, 1.0, 3.0, 7.5, -1.0])
@pytest.mark.parametrize("phi", [0.0, 0.3, 0.7, 1.0])
def test_guided_logits_matches_float64_hand_formula(scale, phi):
    g = torch.Generator().manual_seed(int(scale * 10) + int(phi * 100))
    cond = torch.randn(5, 17, generator=g, dtype=torch.float64) * 3
    uncond = torch.randn(5, 17, generator=g, dtype=torch.float64)
    ref = []  # row by row, with Python floats
    for c_row, u_row in zip(cond.tolist(), uncond.tolist()):
        guided = [u + scale * (c - u) for c, u in zip(c_row, u_row)]
        if phi > 0:
            sd = lambda xs: math.sqrt(sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / (len(xs) - 1))
            ratio = sd(c_row) / sd(guided)
            guided = [phi * x * ratio + (1 - phi) * x for x in guided]
        ref.append(guided)
    ref = torch.tensor(ref, dtype=torch.float64)
    assert_close(guided_logits(cond, uncond, scale, phi), ref, "guided logits (float64)", torch.float64, table=ATTEND_TOL)
    assert_close(guided_logits(cond.float(), uncond.float(), scale, phi), ref, "guided logits (float32)",
                 torch.float32, table=ATTEND_TOL)


def test_guided_logits_rescale_of_flat_rows_stays_finite():
    cond = torch.zeros(2, 5)
    uncond = torch.zeros(2, 5)
    out = guided_logits(cond, uncond, 3.0, 0.7)  # std(guided) = 0: left as guided, not 0/0
    assert_bitwise(out, torch.zeros(2, 5), "flat rows")


def _reference_filters(row: list[float], kind: str, arg: float) -> list[bool]:
    """Which entries a filter keeps, by sorting a Python list."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    m = max(row)
    exps = [math.exp(x - m) for x in row]
    total = sum(exps)
    probs = [e / total for e in exps]
    keep = [False] * len(row)
    if kind == "top_k":
        for i in order[: int(arg)]:
            keep[i] = True
    elif kind == "top_p":
        mass = 0.0
        for i in order:
            if mass < arg or i == order[0]:
                keep[i] = True
            mass += probs[i]
    else:
        top = max(probs)
        keep = [p >= arg * top for p in probs]
    return keep


@pytest.mark.parametrize("kind, fn, kwargs", [
    ("top_k", top_k, [1, 3, 10, 100]),
    ("top_p", top_p, [0.05, 0.5, 0.9, 0.999]),
    ("min_p", min_p, [0.0, 0.05, 0.3, 1.0]),
])
def test_filters_match_a_plain_reference(kind, fn, kwargs):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 20, generator=g, dtype=torch.float64) * 2
    name = {"top_k": "k", "top_p": "p", "min_p": "min_p"}[kind]
    for arg in kwargs:
        out = fn(logits, **{name: arg})
        for r in range(6):
            keep = _reference_filters(logits[r].tolist(), kind, arg)
            for i in range(20):
                if keep[i]:
                    assert out[r, i] == logits[r, i], f"{kind}({arg}) row {r} col {i} should be kept"
                else:
                    assert out[r, i] == float("-inf"), f"{kind}({arg}) row {r} col {i} should be removed"


def test_sampling_draws_only_kept_tokens_with_the_right_frequencies():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(20000, -1)
    torch.manual_seed(0)
    toks = sample_logits(logits, temperature=0.5, filter_logits_fn="top_k", filter_kwargs={"k": 3})
    counts = torch.bincount(toks, minlength=6).double() / toks.numel()
    expected = torch.softmax(logits[0, :3].double() / 0.5, -1)
    assert counts[3:].sum() == 0
    assert float((counts[:3] - expected).abs().max()) < 0.015
    assert torch.equal(sample_logits(logits[:3], temperature=0.0), torch.zeros(3, dtype=torch.long))


# ----------------------------------------------------------------------------------------------------
# Errors (S9)
# ----------------------------------------------------------------------------------------------------


def test_bad_arguments_raise_clear_errors():
    net = make_net(seed=16)
    model = AutoregressiveWrapper(net)
    p = torch.tensor([[1, 2]])
    ctx, ctx_mask = make_context(1, 2)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(p, 3, temperature=-1.0)
    with pytest.raises(TypeError, match="mask"):
        model.generate(p, 3, mask=torch.ones(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one real token"):
        model.generate(p, 3, mask=torch.zeros(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="max_seq_len"):
        model.generate(p, 100)
    with pytest.raises(ValueError, match="negative_context_mask"):
        model.generate(p, 3, context=ctx, negative_context_mask=ctx_mask)
    with pytest.raises(ValueError, match="guidance_rescale"):
        model.generate(p, 3, context=ctx, cond_scale=2.0, guidance_rescale=1.5)
    with pytest.raises(ValueError, match="filter_logits_fn"):
        model.generate(p, 3, filter_logits_fn="top_q")
    with pytest.raises(ValueError, match="cond_drop_prob"):
        AutoregressiveWrapper(make_net(), cond_drop_prob=1.5)
    with pytest.raises(ValueError, match="null_context"):
        AutoregressiveWrapper(make_net(), null_context="zeros")
    with pytest.raises(ValueError, match="context"):  # a net without cross-attention takes no context
        AutoregressiveWrapper(make_net(cross=False), cond_drop_prob={"context": 0.1})
    with pytest.raises(ValueError, match="cross-attention"):
        AutoregressiveWrapper(make_net(cross=False), null_context="learned")
    with pytest.raises(ValueError, match="top_k needs"):
        top_k(torch.zeros(2, 3), k=0)
    with pytest.raises(ValueError, match="top_p needs"):
        top_p(torch.zeros(2, 3), p=0.0)
    with pytest.raises(ValueError, match="min_p needs"):
        min_p(torch.zeros(2, 3), min_p=2.0)
    with pytest.raises(ValueError, match="cond_drop_prob"):
        XTransformer(dim=16, enc_num_tokens=5, enc_max_seq_len=4, dec_num_tokens=5, dec_max_seq_len=4,
                     cond_drop_prob=-0.1)


def _tensors(x):
    """Every tensor inside ``x`` (tensors, lists, tuples, dicts, dataclasses such as a ``KVCache``)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif hasattr(x, "__dataclass_fields__"):
        for name in x.__dataclass_fields__:
            yield from _tensors(getattr(x, name))


@pytest.mark.parametrize("static_cache", [True, False])
def test_generate_returns_ordinary_tensors(static_cache):
    """The decode loop runs in ``torch.inference_mode`` for speed; what ``generate`` hands back (the tokens, and
    with ``return_intermediates`` the KV cache) are ordinary tensors: a training step on the generated tokens
    works (an embedding saves its indices for the backward, which an inference tensor refuses), and so does a
    forward continuing from the returned cache with gradients."""
    net = make_net(cross=False)
    wrapper = AutoregressiveWrapper(net)
    prompts = torch.randint(0, V, (2, 4))
    mask = torch.tensor([[False, True, True, True], [True] * 4])
    out = wrapper.generate(prompts, 5, mask=mask, temperature=0.0, static_cache=static_cache)
    assert not out.is_inference()
    logits = net(torch.cat((prompts, out), 1), mask=torch.cat((mask, torch.ones(2, 5, dtype=torch.bool)), 1))
    logits.float().logsumexp(-1).mean().backward()
    assert net.token_emb.weight.grad is not None and bool(torch.isfinite(net.token_emb.weight.grad).all())
    out2, inter = wrapper.generate(prompts, 5, mask=mask, temperature=0.0, static_cache=static_cache,
                                   return_intermediates=True)
    assert torch.equal(out, out2)
    found = list(_tensors(inter.cache))
    assert found and not any(t.is_inference() for t in found)
    beams, scores = wrapper.beam_search(prompts, 3, beams=2, mask=mask, return_beams_and_scores=True)
    assert not beams.is_inference() and not scores.is_inference()


@pytest.mark.parametrize("static_cache", [True, False])
def test_a_callable_filter_applies_under_greedy_decoding(static_cache):
    """Greedy decoding applies a callable filter before the argmax (it may remove the model's best token); the
    built-in filters keep each row's best token, so greedy tokens are the same with or without them."""
    net = make_net(cross=False)
    wrapper = AutoregressiveWrapper(net)
    prompts = torch.randint(0, V, (2, 3))

    def only_three(logits):
        return torch.where(torch.arange(logits.shape[-1]) == 3, logits, float("-inf"))

    out = wrapper.generate(prompts, 4, temperature=0.0, filter_logits_fn=only_three, static_cache=static_cache)
    assert torch.equal(out, torch.full_like(out, 3))
    plain = wrapper.generate(prompts, 4, temperature=0.0, static_cache=static_cache)
    for name, kw in (("top_k", {"k": 1}), ("top_p", {"p": 0.1}), ("min_p", {"min_p": 1.0}), ("top_a", {})):
        assert torch.equal(wrapper.generate(prompts, 4, temperature=0.0, filter_logits_fn=name, filter_kwargs=kw,
                                            static_cache=static_cache), plain)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_token_left_to_draw_is_a_clear_error(temperature):
    """A callable filter that bans every token (or sampling from a row with nothing finite) raises a ValueError
    naming the logits at the next check, not a RuntimeError from inside ``torch.multinomial``; a built-in
    filter's bad keyword is refused before the first step, greedy or not."""
    wrapper = AutoregressiveWrapper(make_net(cross=False))
    prompts = torch.randint(0, V, (2, 3))
    with pytest.raises(ValueError, match="no token to draw"):
        wrapper.generate(prompts, 3, temperature=temperature, filter_logits_fn=lambda t: torch.full_like(t, float("-inf")))
    with pytest.raises(ValueError, match="k >= 1"):
        wrapper.generate(prompts, 3, temperature=temperature, filter_logits_fn="top_k", filter_kwargs={"k": 0})
