"""``EntropyBasedTokenizer`` (safeformer/entropy_tokenizer.py): entropies and boundaries against float64
references in plain code, padding that never creates or moves a boundary (lens, right, left masks,
garbage ids, zero-length and all-padding samples), the contract on the entropy (S1-S3, S9), and parity with
x-transformers' ``EntropyBasedTokenizer`` on a converted decoder.

Shape legend: b batch, n positions, v vocabulary, T tokens.
"""

from __future__ import annotations

import math

import helpers as hp
import pytest
import torch
from doors import INF, NAN, PLANT_VALUES, Probe, _gen, _leaf, _lengths_mask
from torch import Tensor, nn

import safeformer as sf
from safeformer.research.entropy_tokenizer import (
    EntropyBasedTokenizer,
    calc_entropy_from_logits,
    entropy_tokenizer_from_x_transformers,
    get_accumulated_threshold_mask,
)

V = 12


def _decoder(dtype=torch.float32) -> sf.TransformerWrapper:
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=32, attn_layers=sf.Decoder(dim=16, depth=2, heads=2, dim_head=8))
    with torch.no_grad():  # logits spread enough that entropies vary around the thresholds below
        net.to_logits.weight.mul_(6.0)
    return net.to(dtype)


# ----------------------------------------------------------------------------------------------------
# float64 references
# ----------------------------------------------------------------------------------------------------


def ref_entropy(logits: Tensor) -> Tensor:
    """-sum p log p in float64, one row at a time, banned tokens (-inf) skipped."""
    rows = logits.double().reshape(-1, logits.shape[-1])
    out = []
    for r in rows:
        live = r[torch.isfinite(r)]
        p = torch.exp(live - live.max())
        p = p / p.sum()
        out.append(-sum(float(q) * math.log(float(q)) for q in p if q > 0))
    return torch.tensor(out, dtype=torch.float64).reshape(logits.shape[:-1])


def ref_boundaries(entropies: list[float], threshold: float, accumulate: bool, ignore_below: float,
                   max_token_size: int | None) -> list[int]:
    """Token lengths of one sample's real positions, walked one position at a time."""
    n = len(entropies)
    ends = set()
    if accumulate:
        acc = 0.0
        for i, e in enumerate(entropies):
            acc += 0.0 if e < ignore_below else e
            if acc >= threshold - 1e-9 * max(1.0, threshold):
                ends.add(i)
                acc = 0.0
    else:
        ends = {i for i, e in enumerate(entropies) if e >= threshold}
    if n:
        ends.add(n - 1)
    if max_token_size is not None:
        start, extra = 0, set()
        for i in range(n):
            if (i - start + 1) % max_token_size == 0:
                extra.add(i)
            if i in ends:
                start = i + 1
        ends |= extra
    lengths, last = [], -1
    for i in sorted(ends):
        lengths.append(i - last)
        last = i
    return lengths


# ----------------------------------------------------------------------------------------------------
# the math
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_entropy_equals_float64_reference(dtype):
    g = _gen(1)
    logits = (torch.randn(3, 5, 9, generator=g) * 4).to(dtype)
    logits[0, 1, :4] = -INF  # banned tokens
    logits[1, 2, :8] = -INF  # one token left: entropy 0
    logits[2, 0] = 1e4  # a flat row: log 9
    got = calc_entropy_from_logits(logits)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    want = ref_entropy(logits)
    hp.assert_close(got, want, "entropy", torch.float32 if dtype == torch.bfloat16 else dtype)
    assert got[1, 2].item() == 0.0 and abs(got[2, 0].item() - math.log(9)) < 1e-5


def test_accumulated_threshold_mask_equals_walk():
    """The pointer-doubling boundaries equal a float64 walk, and x-transformers' function where present."""
    g = _gen(2)
    for trial in range(20):
        b, n = 3, int(torch.randint(1, 40, (1,), generator=g))
        e = torch.rand(b, n, generator=g, dtype=torch.float64) * 3
        thr = float(torch.rand(1, generator=g)) * 8
        below = float(torch.rand(1, generator=g)) * min(thr, 1.0)
        got = get_accumulated_threshold_mask(e, thr, below)
        for s in range(b):
            lengths = ref_boundaries(e[s].tolist(), thr, True, below, None)
            ends = torch.tensor(lengths).cumsum(0) - 1
            want = torch.zeros(n, dtype=torch.bool)
            want[ends] = True
            want[-1] = bool(got[s, -1])  # the last position: a boundary only when the threshold is reached there
            assert torch.equal(got[s], want), f"trial {trial}, sample {s}"
    xt_tok = pytest.importorskip("x_transformers.entropy_based_tokenizer")
    e = torch.rand(4, 33, generator=g) * 3
    assert torch.equal(get_accumulated_threshold_mask(e, 5.0, 0.5), xt_tok.get_accumulated_threshold_mask(e, 5.0, 0.5))


OPTIONS = [dict(entropy_threshold=1.2), dict(entropy_threshold=1.2, max_token_size=3),
           dict(entropy_threshold=4.0, accumulate_entropy=True),
           dict(entropy_threshold=4.0, accumulate_entropy=True, ignore_entropy_below=1.0, max_token_size=4)]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_tokens_equal_float64_reference(opts):
    """Token lengths and segments equal the reference walk over a float64 decoder's entropies."""
    tok = EntropyBasedTokenizer(_decoder(torch.float64), **opts)
    g = _gen(3)
    b, n = 4, 16
    seq = torch.randint(0, V, (b, n), generator=g)
    lens = torch.tensor([n, 7, 0, 1])
    ent, mask = tok.entropies(seq, lens=lens)
    lengths = tok(seq, lens=lens)
    segments = tok(seq, lens=lens, return_segmented_seq=True)
    assert lengths.dtype == torch.long and lengths.shape[0] == b
    for s in range(b):
        want = ref_boundaries(ent[s, : int(lens[s])].tolist(), opts["entropy_threshold"], opts.get("accumulate_entropy", False),
                              opts.get("ignore_entropy_below", 0.0), opts.get("max_token_size"))
        assert lengths[s].tolist() == want + [0] * (lengths.shape[1] - len(want)), f"sample {s}"
        assert [len(t) for t in segments[s]] == want
        if want:
            assert torch.equal(torch.cat(segments[s]), seq[s, : int(lens[s])])
    assert 1 < lengths.count_nonzero(1)[0] < n, "the test draws no interesting cut"


# ----------------------------------------------------------------------------------------------------
# padding
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_padding_never_creates_or_moves_a_boundary(opts):
    """lens, a right-padded mask and a left-padded mask, with garbage ids in the padding, give each sample's
    tokens alone; a zero-length sample has none."""
    tok = EntropyBasedTokenizer(_decoder(), **opts)
    g = _gen(4)
    b, n = 5, 12
    seq = torch.randint(0, V, (b, n), generator=g)
    lens = torch.tensor([n, 5, 0, 1, 9])
    alone = [tok(seq[s, : int(lens[s])]) if lens[s] else None for s in range(b)]
    right = torch.arange(n)[None] < lens[:, None]
    left = right.flip(1)
    left_seq = torch.stack([torch.cat((seq[s, int(lens[s]):], seq[s, : int(lens[s])])) for s in range(b)])
    for garbage in (10**6, -7):
        runs = {
            "lens": tok(seq.masked_fill(~right, garbage), lens=lens),
            "right mask": tok(seq.masked_fill(~right, garbage), mask=right),
            "left mask": tok(left_seq.masked_fill(~left, garbage), mask=left),
            "decoder_forward_kwargs mask": tok(seq.masked_fill(~right, garbage), decoder_forward_kwargs={"mask": right}),
        }
        for what, got in runs.items():
            for s in range(b):
                if alone[s] is None:
                    assert not bool(got[s].any()), f"{what}: a zero-length sample has tokens"
                    continue
                k = alone[s].shape[0]
                assert got[s, :k].tolist() == alone[s].tolist() and not bool(got[s, k:].any()), f"{what}, sample {s}"
        seg = tok(left_seq.masked_fill(~left, garbage), mask=left, return_segmented_seq=True)
        assert seg[2] == () and all(torch.equal(torch.cat(seg[s]), seq[s, : int(lens[s])]) for s in (0, 1, 3, 4))


class _Refuses(nn.Module):
    def forward(self, *args, **kwargs):
        raise AssertionError("the decoder was called on a batch with no real position")


def test_all_padding_and_empty_inputs():
    tok = EntropyBasedTokenizer(_Refuses(), 1.0)
    seq = torch.randint(0, V, (3, 6))
    out = tok(seq, lens=torch.zeros(3, dtype=torch.long))
    assert out.shape == (3, 0) and out.dtype == torch.long
    assert tok(seq, mask=torch.zeros(3, 6, dtype=torch.bool), return_segmented_seq=True) == [(), (), ()]
    assert tok(torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0)
    assert tok(torch.zeros(0, dtype=torch.long)).shape == (0,)
    assert tok(torch.zeros(0, 5, dtype=torch.long)).shape == (0, 0)
    ent, _ = tok.entropies(seq, lens=torch.zeros(3, dtype=torch.long))
    hp.assert_zero(ent, "entropies of an all-padding batch")


def test_one_dimensional_sequence_and_training_mode_restored():
    dec = _decoder().train()
    tok = EntropyBasedTokenizer(dec, 1.2)
    seq = torch.randint(0, V, (10,), generator=_gen(5))
    lengths = tok(seq)
    assert lengths.dim() == 1 and int(lengths.sum()) == 10
    segs = tok(seq, return_segmented_seq=True)
    assert isinstance(segs, tuple) and torch.equal(torch.cat(segs), seq)
    assert dec.training, "the decoder's training mode was not restored"
    assert torch.equal(tok(seq, lens=torch.tensor(4)), tok(seq[:4]))


# ----------------------------------------------------------------------------------------------------
# the contract (the probe below is the door's registry probe)
# ----------------------------------------------------------------------------------------------------


def probe_entropy_tokenizer(seed: int, value: float) -> Probe:
    """``calc_entropy_from_logits`` on logits of a padded batch (one sample fully padded) with ``value``
    planted at padded positions: their entropy is exactly 0 and they receive exactly 0 gradient. Inside:
    ``EntropyBasedTokenizer`` on the decoder's own padded batch with garbage ids in the padding (and the
    same ``value`` in padded rows of a prefix passed through ``decoder_forward_kwargs``) gives the same
    token lengths and segments as with clean padding."""
    g = _gen(seed)
    b, n, v = 4, 6, 5
    mask = _lengths_mask(g, b, n, left=seed % 2 == 1)
    logits = _leaf(torch.randn(b, n, v, generator=g) * 3, ~mask[..., None], value)
    out = calc_entropy_from_logits(logits, mask)
    tok = EntropyBasedTokenizer(_decoder(), 1.2, accumulate_entropy=seed % 4 >= 2, max_token_size=3 if seed % 3 else None)
    seq = torch.randint(0, V, (b, n), generator=g)
    pre_mask = torch.tensor([[True, False]] * b)
    pre = torch.randn(b, 2, 16, generator=g)
    garbage = 0 if value == 0 else (10**6 if value == value else -7)
    clean = tok(seq, mask=mask, decoder_forward_kwargs=dict(prepend_embeds=pre, prepend_mask=pre_mask, excise_prepend_embeds=True))
    dirty = tok(seq.masked_fill(~mask, garbage), mask=mask, decoder_forward_kwargs=dict(
        prepend_embeds=pre.masked_fill(~pre_mask[..., None], value), prepend_mask=pre_mask, excise_prepend_embeds=True))
    assert torch.equal(clean, dirty), "garbage in the padding changed the tokens"
    nan_logits = torch.randn(b, n, v)
    nan_logits[-1, 0, 0] = NAN  # the last sample is all real

    class _NaN(nn.Module):
        def forward(self, x, **kw):
            return nan_logits

    class _Flat(nn.Module):
        def forward(self, x, **kw):
            return torch.zeros(b, n)

    return Probe(
        out, {"logits": logits}, {"logits": ~mask[..., None].expand_as(logits)}, dead=~mask,
        bad_calls=[
            ("int mask", lambda: calc_entropy_from_logits(logits, mask.int()), TypeError, "mask"),
            ("integer logits", lambda: calc_entropy_from_logits(torch.ones(b, n, v, dtype=torch.long)), TypeError, "logits"),
            ("lens and mask", lambda: tok(seq, lens=mask.sum(1), mask=mask), ValueError, "lens"),
            ("float lens", lambda: tok(seq, lens=mask.sum(1).float()), TypeError, "lens"),
            ("lens beyond n", lambda: tok(seq, lens=torch.full((b,), n + 1)), ValueError, "lens"),
            ("negative lens", lambda: tok(seq, lens=torch.full((b,), -1)), ValueError, "lens"),
            ("lens of another batch", lambda: tok(seq, lens=torch.ones(b + 1, dtype=torch.long)), ValueError, "lens"),
            ("float mask", lambda: tok(seq, mask=mask.float()), TypeError, "mask"),
            ("mask of wrong shape", lambda: tok(seq, mask=mask[:, :-1]), ValueError, "mask"),
            ("a mask in decoder_forward_kwargs and lens", lambda: tok(seq, lens=mask.sum(1), decoder_forward_kwargs={"mask": mask}),
             ValueError, "mask"),
            ("3-d seq", lambda: tok(torch.zeros(b, n, 2, dtype=torch.long)), ValueError, "seq"),
            ("NaN logits at a real position", lambda: EntropyBasedTokenizer(_NaN(), 1.0)(seq), ValueError, "logits"),
            ("a decoder returning no vocabulary", lambda: EntropyBasedTokenizer(_Flat(), 1.0)(seq), ValueError, "logits"),
            ("ignore_entropy_below above the threshold", lambda: EntropyBasedTokenizer(_decoder(), 1.0, ignore_entropy_below=2.0),
             ValueError, "ignore_entropy_below"),
            ("max_token_size of 0", lambda: EntropyBasedTokenizer(_decoder(), 1.0, max_token_size=0), ValueError, "max_token_size"),
            ("a NaN threshold", lambda: EntropyBasedTokenizer(_decoder(), NAN), ValueError, "entropy_threshold"),
            ("a decoder that is not a module", lambda: EntropyBasedTokenizer(lambda x: x, 1.0), TypeError, "decoder"),
        ],
    )


def _grad(probe: Probe, seed: int) -> Tensor:
    u = torch.randn(probe.out.shape, generator=torch.Generator().manual_seed(seed))
    (gr,) = torch.autograd.grad((probe.out * u).sum(), [probe.leaves["logits"]], allow_unused=True)
    assert gr is not None, "no gradient reached the logits"
    return gr


@pytest.mark.parametrize("seed", range(4))
def test_contract_s1_s2(seed):
    probe = probe_entropy_tokenizer(seed, NAN)
    hp.assert_finite(probe.out, "entropy")
    hp.assert_zero(probe.out.detach()[probe.dead], "entropy at padded positions")
    gr = _grad(probe, seed)
    hp.assert_finite(gr, "grad of logits")
    hp.assert_zero(gr[probe.masked["logits"]], "grad of logits at padded positions")


@pytest.mark.parametrize("value", PLANT_VALUES, ids=["nan", "inf", "-inf", "1e4"])
@pytest.mark.parametrize("seed", range(4))
def test_contract_s3_masked_contents_never_matter(seed, value):
    clean, dirty = probe_entropy_tokenizer(seed, 0.0), probe_entropy_tokenizer(seed, value)
    hp.assert_bitwise(dirty.out, clean.out, "entropy")
    gc, gd = _grad(clean, seed), _grad(dirty, seed)
    m = dirty.masked["logits"]
    hp.assert_bitwise(gd[~m], gc[~m], "grad of logits at real positions")
    hp.assert_zero(gd[m], "grad of logits at padded positions")


def test_contract_s9_clear_errors():
    hp.assert_clear_errors(probe_entropy_tokenizer(0, 0.0).bad_calls, "EntropyBasedTokenizer, ")


# ----------------------------------------------------------------------------------------------------
# x-transformers
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_x_transformers_parity(opts):
    """A converted tokenizer gives x-transformers' token lengths and segments (lens, none, a 1-d sequence)."""
    xt = pytest.importorskip("x_transformers")
    from x_transformers.entropy_based_tokenizer import EntropyBasedTokenizer as XTTokenizer
    from x_transformers.entropy_based_tokenizer import calc_entropy_from_logits as xt_entropy

    torch.manual_seed(0)
    xdec = xt.TransformerWrapper(num_tokens=V, max_seq_len=32, attn_layers=xt.Decoder(dim=16, depth=2, heads=2, rotary_pos_emb=True))
    with torch.no_grad():
        xdec.to_logits.weight.mul_(6.0)
    ref = XTTokenizer(xdec, **opts)
    tok = entropy_tokenizer_from_x_transformers(ref)
    g = _gen(6)
    seq = torch.randint(0, V, (4, 20), generator=g)
    lens = torch.tensor([20, 9, 13, 1])
    ent, _ = tok.entropies(seq)
    err = (ent - xt_entropy(xdec(seq))).abs().max().item()
    assert err < 1e-5, f"entropies: max error {err}"
    assert torch.equal(tok(seq, lens=lens), ref(seq, lens=lens))
    assert torch.equal(tok(seq), ref(seq))
    assert torch.equal(tok(seq[0]), ref(seq[0]))
    for got, want in zip(tok(seq, lens=lens, return_segmented_seq=True), ref(seq, lens=lens, return_segmented_seq=True)):
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert 1 < int(ref(seq[0]).count_nonzero()) < 20, "the test draws no interesting cut"


def test_conversion_refuses_other_objects():
    hp.assert_clear_errors([("a decoder", lambda: entropy_tokenizer_from_x_transformers(_decoder()), TypeError, "tokenizer")],
                           "entropy_tokenizer_from_x_transformers, ")
