"""Tests of generation as x-transformers users call it: the sliding window past ``max_seq_len``
(``restrict_to_max_seq_len``), ``beam_search``, ``prompt_lens`` and 1-D prompts, and parity with
x-transformers' ``AutoregressiveWrapper`` on converted weights.

References are written plainly: a float64 copy of the model run without a cache on exactly the tokens
a step may see (the last ``max_seq_len`` real positions), one sample at a time; beam search against
a brute-force enumeration of every continuation.

Shape legend: b batch, n prompt positions, t generated tokens, j context length, c context width,
m prefix rows, v vocabulary size, k beams.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from helpers import ATTEND_TOL, assert_bitwise, assert_close, assert_finite
from hypothesis import given, settings
from hypothesis import strategies as st

from safeformer import Decoder, TransformerWrapper
from safeformer.decoding.generation import AutoregressiveWrapper, beam_search_tokens

V, C, DIM = 16, 8, 32  # vocabulary, context width, model width
NAN = float("nan")


def make_net(pos: str = "rotary", *, max_seq_len: int = 6, depth: int = 2, cross: bool = False, vocab: int = V,
             seed: int = 0) -> TransformerWrapper:
    torch.manual_seed(seed)
    layers = Decoder(dim=DIM, depth=depth, heads=2, dim_head=16, rotary_pos_emb=pos == "rotary",
                     alibi_pos_bias=pos == "alibi", cross_attend=cross, dim_context=C if cross else None)
    # ALiBi alone (x-transformers keeps a learned absolute embedding next to it unless told otherwise)
    return TransformerWrapper(num_tokens=vocab, max_seq_len=max_seq_len, attn_layers=layers,
                              use_abs_pos_emb=pos != "alibi")


def prompt_list(lengths, seed: int = 1, vocab: int = V) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def argmax_clear(logits64: torch.Tensor) -> int:
    """Greedy choice of a float64 reference ``(v,)``, refusing near-ties (float32 may break them either way)."""
    top2 = logits64.topk(2).values
    assert float(top2[0] - top2[1]) > 1e-4, "reference has a near-tie; pick another seed for this test"
    return int(logits64.argmax())


class Recorder:
    """An argmax filter for ``filter_logits_fn`` that keeps each step's logits ``(b, v)``: greedy decoding
    whose logits can be compared with a reference."""

    def __init__(self):
        self.steps: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        self.steps.append(logits.detach().clone())
        return logits.masked_fill(logits < logits.amax(dim=-1, keepdim=True), float("-inf"))

    def logits(self) -> torch.Tensor:
        return torch.stack(self.steps)  # (t, b, v)


def window_logits64(net64, prefix, tokens: list[int], window: int | None, ctx=None) -> torch.Tensor:
    """The float64 next-token logits ``(v,)`` of one sample from its last ``window`` real positions (its
    prefix rows ``prefix (m, dim)`` first, then ``tokens``), run without a cache as if they were the whole
    input. ``window=None``: everything."""
    m = 0 if prefix is None else prefix.shape[0]
    drop = 0 if window is None else max(0, m + len(tokens) - window)
    pre = None if prefix is None or drop >= m else prefix[drop:]
    tok = tokens[max(0, drop - m):]
    kw = {} if pre is None else dict(prepend_embeds=pre[None].double(), excise_prepend_embeds=True)
    if ctx is not None:
        kw["context"] = ctx[None].double()
    with torch.no_grad():
        return net64(torch.tensor([tok]), **kw)[0, -1]


# ----------------------------------------------------------------------------------------------------
# (a) the sliding window past max_seq_len
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pos", ["rotary", "alibi"])
@pytest.mark.parametrize("cache_kv", [True, False])
def test_window_equals_rerun_on_the_last_max_seq_len_tokens(pos, cache_kv):
    """Past max_seq_len (6) each token comes from the last 6 real tokens only, as if they were the whole input:
    every step's logits equal a float64 re-run on them, for left-padded prompts (one longer than max_seq_len
    itself), on the cached and the uncached path; a depth-2 model, where trimming a KV cache would differ."""
    net = make_net(pos)
    model = AutoregressiveWrapper(net)
    prompts = prompt_list([8, 2, 4])
    steps = 9
    rec = Recorder()
    tokens = model.generate(prompts, steps, filter_logits_fn=rec, cache_kv=cache_kv)  # restrict_to_max_seq_len=True
    logits = rec.logits()
    net64 = copy.deepcopy(net).double().eval()
    for i, p in enumerate(prompts):
        seq = p.tolist()
        for t in range(steps):
            ref = window_logits64(net64, None, seq, net.max_seq_len)
            assert_close(logits[t, i], ref, f"logits of sample {i} at step {t}", torch.float32, table=ATTEND_TOL)
            assert int(tokens[i, t]) == argmax_clear(ref), f"sample {i} step {t}"
            seq.append(int(tokens[i, t]))

    # not vacuous: without the window the same model gives other logits once the window slides
    rec_full = Recorder()
    model.generate(prompts, steps, filter_logits_fn=rec_full, cache_kv=cache_kv, restrict_to_max_seq_len=False)
    assert float((rec_full.logits()[-1] - logits[-1]).abs().max()) > 1e-3


@pytest.mark.parametrize("beams", [None, 2])
def test_window_counts_real_tokens_not_padded_slots(beams):
    """Right padding (prompt_lens) and a mask with holes put padded slots inside the last max_seq_len slots:
    the window still holds each sample's last max_seq_len real tokens, so each sample equals its prompt alone."""
    net = make_net("rotary", seed=33)
    model = AutoregressiveWrapper(net)
    g = torch.Generator().manual_seed(34)
    prompts = torch.randint(0, V, (3, 7), generator=g)
    holes = torch.tensor([[True, False, True, False, True, True, False],
                          [True, True, False, False, False, False, False],
                          [False, True, True, True, True, True, True]])
    lens = torch.tensor([7, 2, 5])

    def run(p, **kw):  # (b, 6): the greedy tokens, or the best beam's
        if beams is None:
            return model.generate(p, 6, temperature=0.0, **kw)
        return model.beam_search(p, 6, beams=beams, **kw)

    for kw in (dict(prompt_lens=lens), dict(mask=holes)):
        batch = run(prompts, **kw)
        real = kw.get("mask", torch.arange(7)[None] < lens[:, None])
        for i in range(3):
            assert torch.equal(batch[i], run(prompts[i][real[i]][None])[0]), f"sample {i} with {list(kw)}"


def test_window_off_keeps_the_whole_sequence():
    """restrict_to_max_seq_len=False: every token sees the whole sequence (today's behaviour)."""
    net = make_net("rotary", seed=2)
    model = AutoregressiveWrapper(net)
    prompts = prompt_list([5, 3], seed=3)
    rec = Recorder()
    tokens = model.generate(prompts, 6, filter_logits_fn=rec, restrict_to_max_seq_len=False)
    net64 = copy.deepcopy(net).double().eval()
    for i, p in enumerate(prompts):
        seq = p.tolist()
        for t in range(6):
            ref = window_logits64(net64, None, seq, None)
            assert_close(rec.logits()[t, i], ref, f"logits of sample {i} at step {t}", torch.float32, table=ATTEND_TOL)
            seq.append(int(tokens[i, t]))


def test_window_counts_prefix_rows_and_keeps_the_context():
    """A prefix's real rows are the oldest positions (they leave the window first; padded rows never count);
    the cross-attention context is never cut. Against the float64 re-run, with NaN in the padded prefix rows
    and context positions; the cached path equals the uncached one."""
    net = make_net("rotary", cross=True, seed=4)
    model = AutoregressiveWrapper(net)
    g = torch.Generator().manual_seed(5)
    prompts = prompt_list([3, 1, 5], seed=6)
    pre = torch.randn(3, 3, DIM, generator=g) * 0.5
    pre_mask = torch.tensor([[True, True, True], [False, True, True], [False, False, False]])
    ctx = torch.randn(3, 4, C, generator=g)
    ctx_mask = torch.tensor([[True, True, True, True], [True, True, False, False], [True, False, False, False]])
    dirty_pre = pre.masked_fill(~pre_mask[..., None], NAN)
    dirty_ctx = ctx.masked_fill(~ctx_mask[..., None], NAN)
    steps = 6
    out = {}
    for cache_kv in (True, False):
        rec = Recorder()
        out[cache_kv] = (model.generate(prompts, steps, prepend_embeds=dirty_pre, prepend_mask=pre_mask, context=dirty_ctx,
                                        context_mask=ctx_mask, filter_logits_fn=rec, cache_kv=cache_kv), rec.logits())
    assert torch.equal(out[True][0], out[False][0])
    tokens, logits = out[True]
    net64 = copy.deepcopy(net).double().eval()
    for i, p in enumerate(prompts):
        seq, prefix, c = p.tolist(), pre[i][pre_mask[i]], ctx[i][ctx_mask[i]]
        for t in range(steps):
            ref = window_logits64(net64, prefix if prefix.shape[0] else None, seq, net.max_seq_len, c)
            assert_close(logits[t, i], ref, f"logits of sample {i} at step {t}", torch.float32, table=ATTEND_TOL)
            assert int(tokens[i, t]) == argmax_clear(ref), f"sample {i} step {t}"
            seq.append(int(tokens[i, t]))


def test_window_with_guidance_cached_equals_uncached_and_padded_equals_alone():
    net = make_net("alibi", cross=True, seed=7)
    model = AutoregressiveWrapper(net)
    prompts = prompt_list([7, 2], seed=8)
    ctx = torch.randn(2, 3, C, generator=torch.Generator().manual_seed(9))
    kw = dict(context=ctx, cond_scale=2.5, temperature=0.0)
    batch = model.generate(prompts, 8, **kw)
    assert torch.equal(batch, model.generate(prompts, 8, cache_kv=False, **kw))
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], 8, context=ctx[i : i + 1], cond_scale=2.5, temperature=0.0)
        assert torch.equal(batch[i], alone[0]), f"sample {i}"


def test_window_of_one_position():
    """max_seq_len=1: each token is predicted from the last token alone."""
    net = make_net("rotary", max_seq_len=1, seed=10)
    model = AutoregressiveWrapper(net)
    prompts = prompt_list([3, 1], seed=11)
    tokens = model.generate(prompts, 5, temperature=0.0)
    assert torch.equal(tokens, model.generate(prompts, 5, temperature=0.0, cache_kv=False))
    net64 = copy.deepcopy(net).double().eval()
    for i, p in enumerate(prompts):
        seq = p.tolist()
        for t in range(5):
            assert int(tokens[i, t]) == argmax_clear(window_logits64(net64, None, seq, 1)), f"sample {i} step {t}"
            seq.append(int(tokens[i, t]))


@pytest.mark.parametrize("restrict", [True, False])
def test_absolute_positions_past_max_seq_len_raise(restrict):
    net = make_net("abs", max_seq_len=6)
    model = AutoregressiveWrapper(net)
    prompt = torch.tensor([[1, 2, 3]])
    assert model.generate(prompt, 4, temperature=0.0, restrict_to_max_seq_len=restrict).shape == (1, 4)  # 6 positions
    for call in (lambda: model.generate(prompt, 5, restrict_to_max_seq_len=restrict),
                 lambda: model.beam_search(prompt, 5, restrict_to_max_seq_len=restrict)):
        with pytest.raises(ValueError, match=r"max_seq_len=6(.|\n)*rotary_pos_emb=True(.|\n)*alibi_pos_bias=True"):
            call()


def test_restrict_to_max_seq_len_must_be_a_bool():
    model = AutoregressiveWrapper(make_net())
    with pytest.raises(TypeError, match="restrict_to_max_seq_len"):
        model.generate(torch.tensor([[1, 2]]), 2, restrict_to_max_seq_len="yes")


# ----------------------------------------------------------------------------------------------------
# (b) beam search
# ----------------------------------------------------------------------------------------------------


def test_one_beam_is_greedy_generate():
    net = make_net("rotary", cross=True, max_seq_len=32, seed=12)
    model = AutoregressiveWrapper(net)
    prompts = prompt_list([4, 1, 6], seed=13)
    ctx = torch.randn(3, 5, C, generator=torch.Generator().manual_seed(14))
    ctx_mask = torch.tensor([[True] * 5, [True, True, False, False, False], [False] * 5])
    for kw in (dict(context=ctx, context_mask=ctx_mask), dict(context=ctx, context_mask=ctx_mask, cond_scale=3.0)):
        greedy = model.generate(prompts, 7, temperature=0.0, **kw)
        assert torch.equal(model.beam_search(prompts, 7, beams=1, **kw), greedy), list(kw)


def brute_force(net64, prompt: list[int], steps: int, vocab: int, eos: int | None = None, pad: int = 0):
    """Every continuation of ``steps`` tokens (finished at ``eos``, then padded) with its summed float64
    log-probability, best first: ``[(tokens, score), ...]``."""
    seqs = list(itertools.product(range(vocab), repeat=steps))
    x = torch.tensor([prompt + list(s) for s in seqs])
    with torch.no_grad():
        logp = net64(x).log_softmax(-1)  # (v ** t, n + t, v)
    n = len(prompt)
    found: dict[tuple, float] = {}
    for r, s in enumerate(seqs):
        score, toks = 0.0, []
        for t, tok in enumerate(s):
            score += float(logp[r, n - 1 + t, tok])
            toks.append(tok)
            if tok == eos:
                break
        found[tuple(toks + [pad] * (steps - len(toks)))] = score
    return sorted(found.items(), key=lambda kv: -kv[1])


@pytest.mark.parametrize("eos", [None, 1])
def test_beam_search_equals_brute_force(eos):
    """With beams = v ** (t - 1) every prefix survives until the last step: the beams are exactly the
    k best of all continuations (finished ones scored up to their eos), with the float64 scores."""
    vocab, steps = 4, 3
    k = vocab ** (steps - 1)
    net = make_net("rotary", vocab=vocab, max_seq_len=16, seed=15)
    model = AutoregressiveWrapper(net)
    prompts = prompt_list([3, 1], seed=16, vocab=vocab)
    tokens, scores = model.beam_search(prompts, steps, beams=k, eos_token=eos, return_beams_and_scores=True)
    assert tokens.shape == (k, 2, steps) and scores.shape == (k, 2) and scores.dtype == torch.float32
    net64 = copy.deepcopy(net).double().eval()
    for i, p in enumerate(prompts):
        ranked = brute_force(net64, p.tolist(), steps, vocab, eos)
        ref_scores = torch.tensor([s for _, s in ranked[: k + 1]], dtype=torch.float64)
        gaps = ref_scores[:-1] - ref_scores[1:]
        assert float(gaps.min()) > 1e-4, "near-tie in the brute force; pick another seed"
        assert_close(scores[:, i], ref_scores[:k], f"beam scores of sample {i}", torch.float32, table=ATTEND_TOL)
        assert tokens[:, i].tolist() == [list(s) for s, _ in ranked[:k]], f"beams of sample {i}"
        assert model.beam_search(p[None], steps, beams=k, eos_token=eos)[0].tolist() == list(ranked[0][0])


def test_finished_beams_keep_their_score_and_pad():
    net = make_net("rotary", max_seq_len=32, seed=17)
    model = AutoregressiveWrapper(net, pad_value=3)
    prompts = prompt_list([2, 5], seed=18)
    free, _ = model.beam_search(prompts, 6, beams=3, return_beams_and_scores=True)
    eos = int(free[0, 0, 1])  # the best beam's second token: a beam will finish there
    tokens, scores = model.beam_search(prompts, 6, beams=3, eos_token=eos, return_beams_and_scores=True)
    net64 = copy.deepcopy(net).double().eval()
    finished = 0
    for kk in range(3):
        for i, p in enumerate(prompts):
            row = tokens[kk, i].tolist()
            end = row.index(eos) + 1 if eos in row else len(row)
            assert row[end:] == [3] * (len(row) - end), "tokens after eos must be pad_value"
            finished += end < len(row) or row[-1] == eos
            with torch.no_grad():
                logp = net64(torch.tensor([p.tolist() + row[:end]])).log_softmax(-1)[0]
            ref = sum(float(logp[len(p) - 1 + t, row[t]]) for t in range(end))
            assert_close(scores[kk, i : i + 1], torch.tensor([ref], dtype=torch.float64), f"score of beam {kk} of sample {i}",
                         torch.float32, table=ATTEND_TOL)
    assert finished > 0


def test_more_beams_than_sequences_give_minus_inf_never_nan():
    vocab = 3
    net = make_net("rotary", vocab=vocab, max_seq_len=16, seed=19)
    model = AutoregressiveWrapper(net)
    prompts = prompt_list([2, 4], seed=20, vocab=vocab)
    for kw in (dict(), dict(eos_token=0), dict(stochastic=True, filter_logits_fn="top_k", filter_kwargs={"k": 1})):
        tokens, scores = model.beam_search(prompts, 2, beams=12, return_beams_and_scores=True, **kw)
        assert not bool(scores.isnan().any()), kw
        assert bool((scores[:-1] >= scores[1:]).all()), f"beams not sorted best first: {kw}"
        valid = torch.isfinite(scores)
        assert int(valid[:, 0].sum()) <= vocab**2 and bool(valid[0].all()), kw
        for i in range(2):  # the valid beams are distinct sequences
            rows = {tuple(tokens[kk, i].tolist()) for kk in range(12) if bool(valid[kk, i])}
            assert len(rows) == int(valid[:, i].sum()), kw
    _, scores = model.beam_search(prompts, 2, beams=12, return_beams_and_scores=True)
    assert int(torch.isfinite(scores).sum(0).min()) == vocab**2  # every sequence found, the rest -inf


def test_half_precision_scores_are_float32():
    """A bfloat16 model: the log-probabilities are summed in float32 and match the float64 sums of the same
    weights within bfloat16's tolerance."""
    net = make_net("rotary", max_seq_len=32, seed=35).to(torch.bfloat16)
    model = AutoregressiveWrapper(net)
    prompts = prompt_list([3, 5], seed=36)
    tokens, scores = model.beam_search(prompts, 4, beams=2, return_beams_and_scores=True)
    assert scores.dtype == torch.float32
    net64 = copy.deepcopy(net).double().eval()
    for kk in range(2):
        for i, p in enumerate(prompts):
            with torch.no_grad():
                logp = net64(torch.cat((p, tokens[kk, i]))[None]).log_softmax(-1)[0]
            ref = sum(float(logp[len(p) - 1 + t, int(tokens[kk, i, t])]) for t in range(4))
            assert_close(scores[kk, i : i + 1], torch.tensor([ref], dtype=torch.float64), f"bfloat16 beam {kk} of sample {i}",
                         torch.bfloat16, table=ATTEND_TOL)


@settings(max_examples=6)
@given(seed=st.integers(0, 2**16), lengths=st.lists(st.integers(1, 8), min_size=2, max_size=3))
def test_beam_search_padded_batch_equals_each_prompt_alone(seed, lengths):
    """A list of prompts (left-padded inside, some longer than max_seq_len so the window slides) with a
    context of per-sample lengths: each sample's beams and scores are those of its prompt alone."""
    net = make_net("rotary", cross=True, seed=seed % 7)
    model = AutoregressiveWrapper(net)
    g = torch.Generator().manual_seed(seed)
    prompts = prompt_list(lengths, seed=seed)
    ctx = torch.randn(len(lengths), 3, C, generator=g)
    ctx_mask = torch.arange(3)[None] < torch.randint(0, 4, (len(lengths),), generator=g)[:, None]
    tokens, scores = model.beam_search(prompts, 4, beams=3, context=ctx, context_mask=ctx_mask,
                                       return_beams_and_scores=True)
    for i, p in enumerate(prompts):
        t1, s1 = model.beam_search(p[None], 4, beams=3, context=ctx[i : i + 1], context_mask=ctx_mask[i : i + 1],
                                   return_beams_and_scores=True)
        assert_close(scores[:, i], s1[:, 0].double(), f"scores of sample {i}", torch.float32, table=ATTEND_TOL)
        if float((s1[:-1, 0] - s1[1:, 0]).min()) > 1e-4:  # beams in the same order unless scores nearly tie
            assert torch.equal(tokens[:, i], t1[:, 0]), f"beams of sample {i}"


def test_beam_search_cache_equals_no_cache():
    """Every condition at once, guidance, eos, and the window sliding: the cached path (cache repeated per
    beam and reordered with KVCache.index_select) equals the uncached recompute."""
    net = make_net("rotary", cross=True, seed=21)
    model = AutoregressiveWrapper(net)
    g = torch.Generator().manual_seed(22)
    prompts = prompt_list([5, 2], seed=23)
    pre = torch.randn(2, 2, DIM, generator=g) * 0.5
    ctx = torch.randn(2, 3, C, generator=g)
    kw = dict(beams=3, context=ctx, context_mask=torch.tensor([[True, True, False], [True, True, True]]),
              prepend_embeds=pre, prepend_mask=torch.tensor([[False, True], [True, True]]), cond_scale=2.0,
              eos_token=5, return_beams_and_scores=True)
    tokens, scores = model.beam_search(prompts, 7, **kw)
    t2, s2 = model.beam_search(prompts, 7, cache_kv=False, **kw)
    assert torch.equal(tokens, t2)
    assert_close(scores, s2.double(), "scores of the cached path", torch.float32, table=ATTEND_TOL)
    assert_finite(scores[torch.isfinite(scores)], "scores")


@pytest.mark.parametrize("cache_kv", [True, False])
def test_garbage_in_padded_slots_changes_nothing(cache_kv):
    """Out-of-vocabulary ids in padded prompt slots, NaN in padded context positions and prefix rows:
    the same beams and bit-for-bit the same scores as clean inputs."""
    net = make_net("rotary", cross=True, max_seq_len=32, seed=24)
    model = AutoregressiveWrapper(net)
    g = torch.Generator().manual_seed(25)
    prompts = torch.randint(0, V, (3, 5), generator=g)
    mask = torch.tensor([[False, False, True, True, True], [True] * 5, [False] * 4 + [True]])
    ctx, ctx_mask = torch.randn(3, 4, C, generator=g), torch.tensor([[True, False, False, False], [True] * 4, [False] * 4])
    pre, pre_mask = torch.randn(3, 2, DIM, generator=g) * 0.5, torch.tensor([[False, True], [False, False], [True, True]])
    clean = model.beam_search(prompts, 5, beams=3, mask=mask, context=ctx, context_mask=ctx_mask, prepend_embeds=pre,
                              prepend_mask=pre_mask, return_beams_and_scores=True, cache_kv=cache_kv)
    dirty = model.beam_search(prompts.masked_fill(~mask, 10**6), 5, beams=3, mask=mask,
                              context=ctx.masked_fill(~ctx_mask[..., None], NAN), context_mask=ctx_mask,
                              prepend_embeds=pre.masked_fill(~pre_mask[..., None], NAN), prepend_mask=pre_mask,
                              return_beams_and_scores=True, cache_kv=cache_kv)
    assert torch.equal(clean[0], dirty[0])
    assert_bitwise(dirty[1], clean[1], "scores with garbage in padding")


def test_stochastic_beam_search():
    """Gumbel top-k candidates from the filtered logits: with top_k(k=1) only the argmax token is a
    candidate (one finite beam, the greedy one); temperature 0 is the deterministic search; the scores
    are the model's log-probabilities whatever the sampling."""
    net = make_net("rotary", max_seq_len=32, seed=26)
    model = AutoregressiveWrapper(net)
    prompts = prompt_list([3, 2], seed=27)
    tokens, scores = model.beam_search(prompts, 4, beams=3, stochastic=True, filter_logits_fn="top_k",
                                       filter_kwargs={"k": 1}, return_beams_and_scores=True)
    assert torch.equal(tokens[0], model.generate(prompts, 4, temperature=0.0))
    assert bool(torch.isinf(scores[1:]).all()) and bool(torch.isfinite(scores[0]).all())
    det = model.beam_search(prompts, 4, beams=3, return_beams_and_scores=True)
    zero = model.beam_search(prompts, 4, beams=3, stochastic=True, temperature=0.0, return_beams_and_scores=True)
    assert torch.equal(det[0], zero[0]) and torch.equal(det[1], zero[1])
    torch.manual_seed(0)
    tokens, scores = model.beam_search(prompts, 4, beams=3, stochastic=True, temperature=1.5, return_beams_and_scores=True)
    net64 = copy.deepcopy(net).double().eval()
    for kk in range(3):
        for i, p in enumerate(prompts):
            with torch.no_grad():
                logp = net64(torch.cat((p, tokens[kk, i]))[None]).log_softmax(-1)[0]
            ref = sum(float(logp[len(p) - 1 + t, int(tokens[kk, i, t])]) for t in range(4))
            assert_close(scores[kk, i : i + 1], torch.tensor([ref], dtype=torch.float64), f"stochastic beam {kk} of sample {i}",
                         torch.float32, table=ATTEND_TOL)


def test_prompt_lens_is_right_padding():
    """x-transformers' form: right-padded prompts with their lengths (prompt_lens), the same as the list."""
    net = make_net("rotary", max_seq_len=32, seed=28)
    model = AutoregressiveWrapper(net)
    right = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0]])
    lens = torch.tensor([4, 2])
    as_list = [right[0], right[1, :2]]
    assert torch.equal(model.generate(right, 5, prompt_lens=lens, temperature=0.0), model.generate(as_list, 5, temperature=0.0))
    b1 = model.beam_search(right, 5, beams=3, prompt_lens=lens, return_beams_and_scores=True)
    b2 = model.beam_search(as_list, 5, beams=3, return_beams_and_scores=True)
    assert b1[0].shape == (3, 2, 5) and b1[1].shape == (3, 2)
    assert torch.equal(b1[0], b2[0])
    assert_close(b1[1], b2[1].double(), "scores of right- and left-padded prompts", torch.float32, table=ATTEND_TOL)


def test_beam_search_bad_arguments_raise_clear_errors():
    model = AutoregressiveWrapper(make_net("rotary", max_seq_len=32))
    p = torch.tensor([[1, 2, 3]])
    cases = [
        (dict(beams=0), ValueError, "beams"),
        (dict(beams=2.0), ValueError, "beams"),
        (dict(filter_logits_fn="top_k"), ValueError, "stochastic"),
        (dict(temperature=0.7), ValueError, "stochastic"),
        (dict(stochastic=1), TypeError, "stochastic"),
        (dict(return_beams_and_scores="yes"), TypeError, "return_beams_and_scores"),
        (dict(prompt_lens=torch.tensor([2]), mask=torch.ones(1, 3, dtype=torch.bool)), ValueError, "prompt_lens"),
        (dict(prompt_lens=torch.tensor([4])), ValueError, "prompt_lens"),
        (dict(prompt_lens=torch.tensor([2.0])), TypeError, "prompt_lens"),
        (dict(prompt_lens=torch.tensor([2, 3])), ValueError, "prompt_lens"),
        (dict(mask=torch.ones(1, 3)), TypeError, "mask"),
        (dict(eos_token=1.0), TypeError, "eos_token"),
    ]
    with pytest.raises(ValueError, match="prompts"):  # one 1-D prompt: refused as in generate, not guessed
        model.beam_search(p[0], 3)
    for kw, err, word in cases:
        with pytest.raises(err, match=word):
            model.beam_search(p, 3, **kw)
    with pytest.raises(ValueError, match="prompt_lens"):
        model.beam_search([p[0]], 3, prompt_lens=torch.tensor([3]))
    with pytest.raises(ValueError, match="seq_len"):
        beam_search_tokens(model.net, p, -1)
    assert beam_search_tokens(model.net, p, 0, beams=2)[0].shape == (1, 2, 0)


# ----------------------------------------------------------------------------------------------------
# (c) parity with x-transformers on converted weights
# ----------------------------------------------------------------------------------------------------


def peers(max_seq_len: int = 8, seed: int = 30):
    xt = pytest.importorskip("x_transformers")
    from safeformer import from_x_transformers

    torch.manual_seed(seed)
    xnet = xt.TransformerWrapper(num_tokens=13, max_seq_len=max_seq_len, use_abs_pos_emb=False,
                                 attn_layers=xt.Decoder(dim=32, depth=2, heads=2, attn_dim_head=16, rotary_pos_emb=True,
                                                        rotary_emb_dim=16))
    return xt.AutoregressiveWrapper(xnet).eval(), AutoregressiveWrapper(from_x_transformers(xnet)).eval()


@pytest.mark.filterwarnings("ignore")
def test_greedy_generate_matches_x_transformers():
    xw, sw = peers()
    prompts = torch.randint(0, 13, (3, 4), generator=torch.Generator().manual_seed(31))
    lens = torch.tensor([4, 2, 3])
    assert torch.equal(xw.generate(prompts, 5, temperature=0.0), sw.generate(prompts, 5, temperature=0.0))
    assert torch.equal(xw.generate(prompts, 5, temperature=0.0, prompt_lens=lens),
                       sw.generate(prompts, 5, temperature=0.0, prompt_lens=lens))
    # past max_seq_len (8): x-transformers' uncached path re-runs the last 8 tokens, as safeformer does on
    # both paths (its cached path trims the cache instead, which differs from the second layer on)
    assert torch.equal(xw.generate(prompts, 12, temperature=0.0, cache_kv=False), sw.generate(prompts, 12, temperature=0.0))


@pytest.mark.filterwarnings("ignore")
def test_beam_search_matches_x_transformers():
    xw, sw = peers()
    prompts = torch.randint(0, 13, (3, 4), generator=torch.Generator().manual_seed(32))
    lens = torch.tensor([3, 4, 1])
    for kw in (dict(), dict(prompt_lens=lens)):
        xt_tokens, xt_scores = xw.beam_search(prompts, 4, beams=3, return_beams_and_scores=True, **kw)
        sf_tokens, sf_scores = sw.beam_search(prompts, 4, beams=3, return_beams_and_scores=True, **kw)
        assert torch.equal(xt_tokens, sf_tokens), list(kw)
        assert_close(sf_scores, xt_scores.double(), f"beam scores {list(kw)}", torch.float32, table=ATTEND_TOL)
        assert torch.equal(xw.beam_search(prompts, 4, beams=3, **kw), sw.beam_search(prompts, 4, beams=3, **kw))
    xt_tokens, xt_scores = xw.beam_search(prompts, 10, beams=2, return_beams_and_scores=True, cache_kv=False)
    sf_tokens, sf_scores = sw.beam_search(prompts, 10, beams=2, return_beams_and_scores=True)  # past max_seq_len
    assert torch.equal(xt_tokens, sf_tokens)
    assert_close(sf_scores, xt_scores.double(), "beam scores past max_seq_len", torch.float32, table=ATTEND_TOL)
