"""Tests for safeformer/wrappers.py: TransformerWrapper, ContinuousTransformerWrapper, XTransformer.

Logits and losses are compared with float64 references built from the weights (``ref_stack`` plus the
embedding, positions and output projection written out here); generation from a left-padded prompt
batch is compared with generation from each prompt alone.

Shape legend: b batch, n positions, j source / context positions, c model width, v vocabulary.
"""

from __future__ import annotations

import math

import helpers as hp
import pytest
import torch
from helpers import CTX_DIM, DIM, DIM_HEAD, HEADS, MAX_SEQ, NAN, VOCAB
from torch import Tensor

import safeformer as sf


@pytest.fixture(autouse=True)
def _one_thread():
    with hp.single_thread():
        yield


def layers_of(kind: str, **kw) -> sf.AttentionLayers:
    base = dict(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD)
    if kind == "abs":
        return sf.Decoder(**base, cross_attend=True, dim_context=CTX_DIM, **kw)
    if kind == "rotary":
        return sf.Decoder(**base, cross_attend=True, dim_context=CTX_DIM, rotary_pos_emb=True, kv_heads=1, **kw)
    if kind == "alibi":
        return sf.Decoder(**base, alibi_pos_bias=True, ff_glu=True, **kw)
    if kind == "encoder":
        return sf.Encoder(**base, cross_attend=True, dim_context=CTX_DIM, **kw)
    raise KeyError(kind)


def tw(kind: str = "abs", **kw) -> sf.TransformerWrapper:
    return hp.seeded_module(lambda: sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=MAX_SEQ, attn_layers=layers_of(kind), **kw))


MASK = torch.tensor([
    [False, False, True, True, True],
    [True, True, True, False, False],
    [True, True, True, True, True],
    [False] * 5,
])
CTX_MASK = torch.tensor([
    [True, True, False, True],
    [False] * 4,
    [True, True, True, True],
    [True, False, False, False],
])


def data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, MASK.shape, generator=g)
    ctx = torch.randn(CTX_MASK.shape[0], CTX_MASK.shape[1], CTX_DIM, generator=g, dtype=torch.float64)
    return ids, ctx


def ctx_kwargs(model, ctx):
    return dict(context=ctx, context_mask=CTX_MASK) if model.attn_layers.has_cross else {}


# ----------------------------------------------------------------------------------------------------
# TransformerWrapper
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["abs", "rotary", "alibi"])
@pytest.mark.parametrize("tie", [False, True])
def test_transformer_wrapper_matches_float64_reference(kind, tie):
    model = tw(kind, tie_embedding=tie).double()
    assert (model.pos_emb is None) == (kind == "rotary")  # rotary replaces it; ALiBi keeps it (x-transformers)
    assert (model.to_logits is None) == tie
    ids, ctx = data()
    logits = model(ids, mask=MASK, **ctx_kwargs(model, ctx))
    assert logits.shape == (*MASK.shape, VOCAB)
    want = hp.ref_wrapper(model, ids, MASK, **ctx_kwargs(model, ctx))
    tol = torch.float32 if kind == "rotary" else torch.float64  # rotary angles are float32 inside
    hp.assert_close(logits[MASK], want[MASK], f"{kind} logits", tol)


def test_embeddings_and_pooled_outputs():
    model = tw("abs").double()
    ids, ctx = data()
    kw = dict(mask=MASK, context=ctx, context_mask=CTX_MASK)
    emb = model(ids, return_embeddings=True, **kw)
    hp.assert_close(emb, model.attn_layers(model.token_emb(torch.where(MASK, ids, 0)) + model.pos_emb.embed_positions(sf.positions_from_mask(MASK, 5, "cpu")), **kw),
                    "return_embeddings = the stack's output", torch.float64)
    pooled = model(ids, return_pooled=True, **kw)
    assert pooled.shape == (4, DIM)
    for s in range(4):
        if MASK[s].any():
            hp.assert_close(pooled[s], emb[s, MASK[s]].mean(0), f"pooled sample {s}", torch.float64)
    hp.assert_zero(pooled[3], "pooled fully padded sample")
    logits = model(ids, mask=MASK, context=ctx, context_mask=CTX_MASK)
    hp.assert_close(logits, emb @ model.to_logits.weight.T, "logits = head(embeddings)", torch.float64)


@pytest.mark.parametrize("kind", ["abs", "rotary", "alibi"])
def test_left_and_right_padding_equal_each_sample_alone(kind):
    """Absolute, rotary and ALiBi positions count real tokens: left/right padding shift nothing."""
    model = tw(kind).double()
    ids, ctx = data(1)
    logits = model(ids, mask=MASK, **ctx_kwargs(model, ctx))
    for s in range(3):
        kw = dict(context=ctx[s : s + 1, CTX_MASK[s]]) if model.attn_layers.has_cross else {}
        alone = model(ids[s : s + 1, MASK[s]], **kw)
        tol = torch.float32 if kind == "rotary" else torch.float64
        hp.assert_close(logits[s, MASK[s]], alone[0], f"{kind}: sample {s}", tol)


def test_per_sample_empty_context_equals_no_context():
    model = tw("abs").double()
    ids, ctx = data(2)
    logits = model(ids, mask=MASK, context=ctx, context_mask=CTX_MASK)
    s = 1  # all-False context mask
    alone = model(ids[s : s + 1], mask=MASK[s : s + 1])
    hp.assert_close(logits[s, MASK[s]], alone[0, MASK[s]], "all-False context vs context=None", torch.float64)
    empty = model(ids[s : s + 1], mask=MASK[s : s + 1], context=ctx[s : s + 1, :0])
    hp.assert_close(empty[0, MASK[s]], alone[0, MASK[s]], "zero-length context vs context=None", torch.float64)


@pytest.mark.parametrize("kind", ["abs", "rotary", "alibi"])
def test_greedy_generation_left_padded_batch_equals_each_prompt_alone(kind):
    """Greedy decoding with the KV cache from a left-padded prompt batch, the context cached (some
    samples without one), gives each prompt the tokens it gets alone, and the tokens that decoding
    without a cache (recomputing everything each step) gives."""
    model = tw(kind).double().eval()
    ids, ctx = data(3)
    mask = torch.tensor([[False, False, True, True, True], [False, True, True, True, True], [True] * 5])
    ids, cm, ctx = ids[:3], CTX_MASK[:3], ctx[:3]
    kw = dict(context=ctx, context_mask=cm) if model.attn_layers.has_cross else {}
    steps = 6
    with torch.no_grad():
        batch = hp.greedy_generate(model, ids, mask, steps, **kw)
        assert batch.shape == (3, steps)
        for s in range(3):
            alone_kw = dict(context=ctx[s : s + 1, cm[s]]) if kw else {}
            alone = hp.greedy_generate(model, ids[s : s + 1, mask[s]], None, steps, **alone_kw)
            assert batch[s].tolist() == alone[0].tolist(), f"sample {s}: batch {batch[s].tolist()} vs alone {alone[0].tolist()}"
        # without a cache: the whole sequence again at every step
        seq, m = ids, mask
        for t in range(steps):
            nxt = model(seq, mask=m, **kw)[:, -1].argmax(-1)
            assert nxt.tolist() == batch[:, t].tolist(), f"step {t}"
            seq = torch.cat((seq, nxt[:, None]), 1)
            m = torch.cat((m, torch.ones(3, 1, dtype=torch.bool)), 1)


def test_cache_longer_than_max_seq_len_is_an_error():
    model = tw("abs")
    ids = torch.randint(0, VOCAB, (1, MAX_SEQ))
    _, cache = model(ids, return_cache=True)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        model(ids[:, :1], cache=cache)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.randint(0, VOCAB, (1, MAX_SEQ + 1)))


def test_transformer_wrapper_errors():
    model = tw("abs")
    ids = torch.randint(0, VOCAB, (2, 3))
    for call, exc, match in [
        (lambda: model(ids.float() + 0.5), TypeError, r"^x must hold integer token ids"),
        (lambda: model(ids.bool()), TypeError, r"^x must hold integer token ids"),
        (lambda: model(ids[..., None]), ValueError, r"^x must be token ids of shape \(b, n\)"),
        (lambda: model(ids, mask=torch.ones(2, 3, dtype=torch.long)), TypeError, r"^mask must have dtype torch.bool"),
        (lambda: model(ids, mask=torch.ones(2, 2, dtype=torch.bool)), ValueError, r"^mask must have shape \(2, 3\)"),
        (lambda: sf.TransformerWrapper(num_tokens=0, max_seq_len=4, attn_layers=sf.Encoder(dim=DIM, depth=1)), ValueError, "num_tokens"),
        (lambda: sf.TransformerWrapper(num_tokens=5, max_seq_len=-1, attn_layers=sf.Encoder(dim=DIM, depth=1)), ValueError, "max_seq_len"),
        (lambda: sf.TransformerWrapper(num_tokens=5, max_seq_len=2.0, attn_layers=sf.Encoder(dim=DIM, depth=1)), ValueError, "max_seq_len"),
        (lambda: sf.TransformerWrapper(num_tokens=5, max_seq_len=4, attn_layers=torch.nn.Linear(2, 2)), TypeError, "attn_layers"),
        (lambda: sf.TransformerWrapper(num_tokens=5, max_seq_len=4, attn_layers=sf.Encoder(dim=DIM, depth=1), tie_embedding=True, logits_dim=3), ValueError, "tie_embedding"),
    ]:
        with pytest.raises(exc, match=match):
            call()


def test_logits_dim_and_token_ids_at_padding_are_never_looked_up():
    model = hp.seeded_module(lambda: sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=MAX_SEQ, logits_dim=3, attn_layers=layers_of("alibi")))
    ids, _ = data(4)
    out = model(ids, mask=MASK)
    assert out.shape == (*MASK.shape, 3)
    junk = torch.where(MASK, ids, torch.tensor([-5, 10**9, VOCAB, -1]).repeat(2)[:5])  # out of range at padding
    hp.assert_bitwise(model(junk, mask=MASK), out, "logits with out-of-range ids at padded positions")


def test_check_finite_reports_real_positions_only():
    model = tw("abs", check_finite=True)
    ids, ctx = data(5)
    ctx = ctx.float()
    dirty = torch.where(CTX_MASK[..., None], ctx, NAN)  # garbage only at padding: fine
    clean = model(ids, mask=MASK, context=ctx, context_mask=CTX_MASK)
    hp.assert_bitwise(model(ids, mask=MASK, context=dirty, context_mask=CTX_MASK), clean, "NaN at masked context")
    bad = ctx.clone()
    bad[2, 1, 3] = math.inf
    with pytest.raises(ValueError, match=r"^context holds a non-finite value .* at real position \(2, 1\)"):
        model(ids, mask=MASK, context=bad, context_mask=CTX_MASK)
    out = model(ids, mask=MASK, context=bad, context_mask=CTX_MASK, check_finite=False)  # the per-call override
    assert torch.isinf(out[2]).any() or torch.isnan(out[2]).any()  # the user's own inf, unchecked, shows up
    hp.assert_bitwise(out[0], clean[0], "other samples are untouched by sample 2's inf")




@pytest.mark.parametrize("bad_mask,exc", [(torch.ones(4, 4), TypeError), (torch.ones(4, 4, dtype=torch.bool, device="meta"), ValueError)])
def test_check_finite_validates_context_mask_first(bad_mask, exc):
    model = tw("abs", check_finite=True)
    ids, ctx = data(6)
    with pytest.raises(exc, match="context_mask"):
        model(ids, mask=MASK, context=ctx.float(), context_mask=bad_mask)


# ----------------------------------------------------------------------------------------------------
# ContinuousTransformerWrapper
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim_in,dim_out", [(5, 7), (None, None)])
def test_continuous_wrapper_matches_float64_reference(dim_in, dim_out):
    model = hp.seeded_module(lambda: sf.ContinuousTransformerWrapper(max_seq_len=MAX_SEQ, dim_in=dim_in, dim_out=dim_out,
                                                                     attn_layers=layers_of("encoder"))).double()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 5, dim_in or DIM, generator=g, dtype=torch.float64)
    _, ctx = data(7)
    out = model(x, mask=MASK, context=ctx, context_mask=CTX_MASK)
    assert out.shape == (4, 5, dim_out or DIM)
    h = x if dim_in is None else x @ model.project_in.weight.detach().T  # no bias (x-transformers')
    h = h + model.pos_emb.emb.weight.detach()[hp.ref_positions(MASK, 4, 5)] * DIM**-0.5
    h = hp.ref_stack(model.attn_layers, h, mask=MASK, context=ctx, context_mask=CTX_MASK)
    if dim_out is not None:
        h = h @ model.project_out.weight.detach().T
    hp.assert_close(out[MASK], h[MASK], "continuous wrapper", torch.float64)
    pooled = model(x, mask=MASK, context=ctx, context_mask=CTX_MASK, return_pooled=True)
    hp.assert_zero(pooled[3], "pooled fully padded sample")


def test_continuous_wrapper_check_finite_and_errors():
    model = hp.seeded_module(lambda: sf.ContinuousTransformerWrapper(max_seq_len=MAX_SEQ, dim_in=5, attn_layers=layers_of("encoder")))
    x = torch.randn(4, 5, 5)
    clean = model(x, mask=MASK)
    dirty = torch.where(MASK[..., None], x, NAN)
    hp.assert_bitwise(model(dirty, mask=MASK, check_finite=True), clean, "NaN at padded x with check_finite=True")
    with pytest.raises(ValueError, match=r"^x holds a non-finite value"):
        model(dirty, check_finite=True)  # no mask: every position is real
    for call, exc, match in [
        (lambda: model(x[..., :4]), ValueError, r"^x must have shape \(b, n, dim_in=5\)"),
        (lambda: model(x.long()), TypeError, r"^x must be a floating-point tensor"),
        (lambda: model(x, mask=MASK.float()), TypeError, r"^mask must have dtype"),
        (lambda: model(x, context_mask=CTX_MASK), ValueError, "context_mask was given without a context"),
    ]:
        with pytest.raises(exc, match=match):
            call()


# ----------------------------------------------------------------------------------------------------
# XTransformer
# ----------------------------------------------------------------------------------------------------

SRC_V, TGT_V = 11, 13


def xt(**kw) -> sf.XTransformer:
    return hp.seeded_module(lambda: sf.XTransformer(
        dim=DIM, enc_num_tokens=SRC_V, enc_max_seq_len=MAX_SEQ, dec_num_tokens=kw.pop("dec_num_tokens", TGT_V),
        dec_max_seq_len=MAX_SEQ, enc_depth=1, dec_depth=2, enc_heads=HEADS, dec_heads=HEADS, dim_head=DIM_HEAD, **kw))


def ref_xt_loss(model: sf.XTransformer, src, tgt, src_mask, tgt_mask, ignore_index=-100) -> Tensor:
    """float64 next-token loss: mean over counted targets of -log softmax(logits)[target]."""
    enc_h = hp.ref_wrapper(model.encoder, src, src_mask, head=False)  # the encoder's hidden states
    real = (tgt != ignore_index) & (tgt_mask if tgt_mask is not None else True)
    inp = torch.where(real[:, :-1], tgt[:, :-1], 0)
    logits = hp.ref_wrapper(model.decoder.net, inp, real[:, :-1] if tgt_mask is not None else None, context=enc_h,
                            context_mask=src_mask)
    return hp.ref_cross_entropy(logits, torch.where(real[:, 1:], tgt[:, 1:], ignore_index), ignore_index=ignore_index)


def xt_data(seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, SRC_V, (4, 4), generator=g)
    tgt = torch.randint(0, TGT_V, (4, 5), generator=g)
    tgt_mask = torch.tensor([[True] * 5, [True, True, True, False, False], [True, True, False, False, False], [True] * 5])
    return src, tgt, CTX_MASK, tgt_mask


def test_xtransformer_loss_matches_float64_reference():
    model = xt().double()
    src, tgt, src_mask, tgt_mask = xt_data()
    loss = model(src, tgt, mask=src_mask, tgt_mask=tgt_mask)
    hp.assert_close(loss, ref_xt_loss(model, src, tgt, src_mask, tgt_mask), "loss", torch.float32)  # the loss is float32
    tgt_ign = torch.where(tgt_mask, tgt, -100)  # the same padding through ignore_index
    hp.assert_close(model(src, tgt_ign, mask=src_mask), ref_xt_loss(model, src, tgt_ign, src_mask, None), "ignore_index", torch.float32)
    loss.backward()
    for name, p in model.named_parameters():
        if name != "encoder.to_logits.weight":  # unused: see the next test
            hp.assert_finite(p.grad, f"grad of {name}")


def test_xtransformer_every_parameter_gets_a_gradient():
    model = xt()
    src, tgt, src_mask, tgt_mask = xt_data()
    model(src, tgt, mask=src_mask, tgt_mask=tgt_mask).backward()
    unused = [name for name, p in model.named_parameters() if p.grad is None]
    assert not unused, f"parameters without a gradient: {unused}"


def test_xtransformer_encode_and_tied_embeddings():
    model = xt(tie_token_emb=True, dec_num_tokens=SRC_V).double()
    assert model.decoder.net.token_emb is model.encoder.token_emb
    src, _, src_mask, _ = xt_data()
    enc = model.encode(src, src_mask)
    hp.assert_close(enc[src_mask], hp.ref_wrapper(model.encoder, src, src_mask, head=False)[src_mask], "encode", torch.float64)
    with pytest.raises(ValueError, match="tie_token_emb"):
        xt(tie_token_emb=True)


def test_xtransformer_empty_source_equals_no_source():
    """A sample whose source is fully masked gets the loss of the decoder without any context."""
    model = xt().double()
    src, tgt, _, tgt_mask = xt_data(1)
    none = torch.zeros(4, 4, dtype=torch.bool)
    loss = model(src, tgt, mask=none, tgt_mask=tgt_mask)
    real = tgt_mask
    logits = model.decoder.net(torch.where(real[:, :-1], tgt[:, :-1], 0), mask=real[:, :-1])
    want = sf.safe_cross_entropy(logits, torch.where(real[:, 1:], tgt[:, 1:], -100))
    hp.assert_bitwise(loss, want, "all-False source mask vs no context")
    hp.assert_bitwise(model(src[:, :0], tgt, mask=none[:, :0], tgt_mask=tgt_mask), want, "zero-length source vs no context")


@pytest.mark.parametrize("via", ["tgt_mask", "ignore_index"])
def test_xtransformer_left_padded_targets_equal_unpadded(via):
    model = xt().double()
    src, tgt, _, _ = xt_data(2)
    src, tgt = src[:1], tgt[:1, :4]
    alone = model(src, tgt)
    padded = torch.cat((torch.zeros(1, 2, dtype=torch.long), tgt), 1)
    real = torch.cat((torch.zeros(1, 2, dtype=torch.bool), torch.ones(1, 4, dtype=torch.bool)), 1)
    loss = model(src, padded, tgt_mask=real) if via == "tgt_mask" else model(src, torch.where(real, padded, -100))
    hp.assert_close(loss, alone, "left-padded targets vs unpadded", torch.float32)


def test_xtransformer_right_padded_targets_equal_unpadded():
    model = xt().double()
    src, tgt, _, _ = xt_data(2)
    src, tgt = src[:1], tgt[:1, :4]
    padded = torch.cat((tgt, torch.zeros(1, 2, dtype=torch.long)), 1)
    real = torch.cat((torch.ones(1, 4, dtype=torch.bool), torch.zeros(1, 2, dtype=torch.bool)), 1)
    hp.assert_close(model(src, padded, tgt_mask=real), model(src, tgt), "right-padded targets vs unpadded", torch.float32)


def test_xtransformer_errors_name_its_arguments():
    model = xt()
    src, tgt, src_mask, tgt_mask = xt_data()
    with pytest.raises(TypeError, match=r"\btgt_mask\b"):
        model(src, tgt, mask=src_mask, tgt_mask=tgt_mask.long())
    with pytest.raises(ValueError, match=r"\btgt_mask\b"):
        model(src, tgt, mask=src_mask, tgt_mask=tgt_mask[:, :2])
    with pytest.raises(TypeError, match=r"\bsrc\b"):
        model(src.float(), tgt)
    with pytest.raises(ValueError, match=r"\btgt\b"):
        model(src, tgt[..., None])


def test_xtransformer_source_mask_errors():
    model = xt()
    src, tgt, src_mask, _ = xt_data()
    with pytest.raises(TypeError, match=r"^mask must have dtype torch.bool"):
        model(src, tgt, mask=src_mask.long())
    with pytest.raises(ValueError, match=r"^mask must have shape \(4, 4\)"):
        model(src, tgt, mask=src_mask[:, :3])


def test_xtransformer_condition_dropout_is_the_empty_source():
    """cond_drop_prob=1 in training drops every sample's source: the loss is the all-False-mask loss;
    at evaluation (or with probability 0) nothing is dropped."""
    src, tgt, src_mask, tgt_mask = xt_data(3)
    always = xt(cond_drop_prob=1.0).double()
    never = hp.copy_weights(xt(cond_drop_prob=0.0).double(), always)
    empty = never(src, tgt, mask=torch.zeros_like(src_mask), tgt_mask=tgt_mask)
    full = never(src, tgt, mask=src_mask, tgt_mask=tgt_mask)
    assert float((empty - full).detach().abs()) > 1e-6  # the source matters, so the comparison below means something
    always.train()
    hp.assert_bitwise(always(src, tgt, mask=src_mask, tgt_mask=tgt_mask), empty, "training with cond_drop_prob=1")
    always.eval()
    hp.assert_bitwise(always(src, tgt, mask=src_mask, tgt_mask=tgt_mask), full, "evaluation ignores cond_drop_prob")
    never.train()
    hp.assert_bitwise(never(src, tgt, mask=src_mask, tgt_mask=tgt_mask), full, "cond_drop_prob=0 in training")
    with pytest.raises(ValueError, match="cond_drop_prob"):
        xt(cond_drop_prob=1.5)
