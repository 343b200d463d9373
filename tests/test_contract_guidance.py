"""The safety contract (docs/safety.md, S1-S9) for ``AutoregressiveWrapper``: the next-token loss
(with classifier-free-guidance condition dropout, ``null_context`` "empty" and "learned") and guided
generation (``generate`` / ``next_token_logits`` with ``cond_scale``, guidance rescale and negative
contexts).

One test function per clause (``test_s<k>_...``), so a failure names the clause. Batch layouts are
drawn by hypothesis with dead rows on purpose: left padding under the causal mask, fully padded
samples, all-False context masks, zero-length contexts, every condition dropped (``cond_drop_prob``
1) or some (0.5, in train mode; the drop pattern is reproduced from the seed). Numbers are compared
with a plain float64 reference built from the model's weights (``helpers.ref_stack``: loops over
samples, heads and queries), one sample at a time with its padding removed.

Shape legend: b batch, n sequence (prompt) positions, j context positions, c_ctx context width,
v vocabulary, t generated tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import helpers as hp
import pytest
import torch
from helpers import CTX_DIM, DIM, DIM_HEAD, HEADS, MAX_SEQ, NAN, VOCAB, Scenario, mask_from_lengths
from hypothesis import example, given
from hypothesis import strategies as st
from torch import Tensor

import safeformer as sf
from safeformer.decoding.generation import AutoregressiveWrapper

IGNORE = -100
GARBAGE = (NAN, float("inf"), float("-inf"), 3.0e38)
NULLS = ("empty", "learned")



@pytest.fixture(autouse=True)
def _one_thread():
    with hp.single_thread():
        yield


# ----------------------------------------------------------------------------------------------------
# the model: a cross-attending decoder with GQA and absolute positions, seeded weights
# ----------------------------------------------------------------------------------------------------


def make_model(null: str, p: float, backend: str = "auto", check_finite: bool = False) -> AutoregressiveWrapper:
    net = sf.TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=MAX_SEQ, check_finite=check_finite,
        attn_layers=sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, kv_heads=1, cross_attend=True,
                               dim_context=CTX_DIM, backend=backend),
    )
    model = AutoregressiveWrapper(net, cond_drop_prob=p, null_context=null, ignore_index=IGNORE)
    if model.null_token is not None:  # a trained-looking null token, not the near-zero init
        with torch.no_grad():
            model.null_token.copy_(torch.randn(1, CTX_DIM, generator=torch.Generator().manual_seed(77)))
    return model


_MODELS: dict[tuple, AutoregressiveWrapper] = {}


def model_of(null: str, p: float = 0.0, backend: str = "auto", dtype: torch.dtype = torch.float32) -> AutoregressiveWrapper:
    """The wrapper with this file's fixed weights (the same for every ``null``/``p``/backend/dtype)."""
    key = (null, p, backend, dtype)
    if key not in _MODELS:
        # the padded path: these tests follow each attention's dead rows through hooks (the unpadded path
        # is held to the same clauses in test_contract_models.py and to equality in test_unpadded.py)
        _MODELS[key] = hp.set_unpadded(hp.seeded_module(lambda: make_model(null, p, backend)).to(dtype), False)
    return _MODELS[key]


def cross_param_names(model: AutoregressiveWrapper) -> set[str]:
    """Names of the parameters of the cross-attention blocks (their norms included)."""
    layers = model.net.attn_layers
    ids = {id(p) for kind, layer in zip(layers.layer_kinds, layers.layers) if kind == "cross"
           for p in [*layer[0].parameters(), *layer[1].parameters()]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def roles(model: AutoregressiveWrapper) -> dict[int, str]:
    return hp.stack_roles(model.net.attn_layers, "main")


# ----------------------------------------------------------------------------------------------------
# plain float64 references
# ----------------------------------------------------------------------------------------------------


def ref_logits64(model: AutoregressiveWrapper, ids: Tensor, context: Tensor | None) -> Tensor:
    """``(L, v)`` float64 logits of one unpadded sample ``ids (L,)`` with its real context ``(j, c_ctx)``."""
    return hp.ref_wrapper(model.net, ids[None], context=None if context is None else context.detach().double()[None])[0]


def dropped_for(seed: int, b: int, p: float) -> Tensor:
    """``(b,)`` the samples whose condition the wrapper drops after ``torch.manual_seed(seed)``.

    Mirrors ``drop_condition``: its first random draw is ``torch.rand(b) < p``. (Should that change,
    the loss-vs-reference checks of S1, S4 and S8 fail loudly, not silently.)"""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.rand(b) < p


# ----------------------------------------------------------------------------------------------------
# drawn training batches
# ----------------------------------------------------------------------------------------------------


@dataclass
class TrainCase:
    """A training batch layout: ``sc`` (sequence and context padding), the condition-drop probability,
    the null condition, and how the context is given: ``masked`` (with ``context_mask``), ``unmasked``
    (every position real) or ``none`` (``context=None``)."""

    sc: Scenario
    p: float
    null: str
    ctx_kind: str

    @property
    def b(self) -> int:
        return self.sc.b

    def ids(self) -> Tensor:
        return torch.randint(0, VOCAB, (self.sc.b, self.sc.n), generator=self.sc.generator())

    def context(self, dtype=torch.float32) -> Tensor | None:
        """A fresh leaf ``(b, j, c_ctx)`` (None for ``ctx_kind == 'none'``)."""
        if self.ctx_kind == "none":
            return None
        g = torch.Generator().manual_seed(self.sc.seed + 1)
        return torch.randn(self.sc.b, self.sc.j, CTX_DIM, generator=g).to(dtype).requires_grad_()

    def ctx_mask(self) -> Tensor | None:
        return self.sc.ctx_mask if self.ctx_kind == "masked" else None

    def ctx_real(self) -> Tensor:
        """``(b, j)`` real context positions."""
        return self.sc.ctx_mask if self.ctx_kind == "masked" else torch.ones(self.sc.b, self.sc.j, dtype=torch.bool)

    def dropped(self, train: bool) -> Tensor:
        if not train or self.ctx_kind == "none" or self.p == 0:
            return torch.zeros(self.b, dtype=torch.bool)
        return dropped_for(self.sc.seed, self.b, self.p)

    def loss(self, model: AutoregressiveWrapper, ids: Tensor, ctx: Tensor | None, train: bool = True) -> Tensor:
        model.train(train)
        torch.manual_seed(self.sc.seed)  # the drop pattern of ``dropped``
        return model(ids, mask=self.sc.seq_mask, context=ctx, context_mask=self.ctx_mask())

    def sample_context(self, model, ctx: Tensor | None, s: int, dropped: Tensor) -> Tensor | None:
        """What sample ``s`` conditions on, alone: its real context positions, nothing, or the null token."""
        if ctx is None:
            return None
        if dropped[s]:
            return None if self.null == "empty" else model.null_token.detach()
        return ctx[s][self.ctx_real()[s]]

    def cross_dead(self, train: bool) -> Tensor:
        """``(b, n - 1)`` dead rows of the cross-attention (the net sees ``n - 1`` input positions)."""
        if self.ctx_kind == "none":
            return torch.zeros(self.b, max(self.sc.n - 1, 0), dtype=torch.bool)
        alive = self.ctx_real().any(1)
        dropped = self.dropped(train)
        alive = torch.where(dropped, torch.tensor(self.null == "learned"), alive)
        return (~alive)[:, None].expand(self.b, max(self.sc.n - 1, 0))

    def self_dead(self) -> Tensor:
        return hp.causal_dead(self.sc.seq_mask[:, :-1])


@st.composite
def train_cases(draw, styles=("left", "right", "holes"), force_dead: bool = True, ps=(0.5, 0.0, 1.0)) -> TrainCase:
    sc = draw(hp.scenarios(max_b=3, min_n=2, max_n=6, max_j=4, styles=styles, force_dead=force_dead))
    p = draw(st.sampled_from(ps))
    null = draw(st.sampled_from(NULLS))
    ctx_kind = draw(st.sampled_from(["masked", "masked", "masked", "unmasked", "none"]))
    return TrainCase(sc, p, null, ctx_kind)


def fixed_train(p: float = 0.5, null: str = "learned") -> TrainCase:
    return TrainCase(hp.fixed_scenario(), p, null, "masked")


def ref_sample_terms(case: TrainCase, model, ids: Tensor, ctx: Tensor | None, dropped: Tensor) -> list[tuple[Tensor, int]]:
    """Per sample ``(summed NLL, number of counted targets)``, float64, each sample alone.

    A target counts when it and the token before it are both real: the sample's real tokens are
    squeezed together, run alone, and only pairs that were neighbours in the batch are scored.
    """
    out = []
    for s in range(case.b):
        pos = case.sc.seq_mask[s].nonzero().flatten()
        total, count = torch.zeros((), dtype=torch.float64), 0
        if len(pos) >= 2:
            toks = ids[s, pos]
            logits = ref_logits64(model, toks[:-1], case.sample_context(model, ctx, s, dropped))
            for k in range(1, len(pos)):
                if pos[k] == pos[k - 1] + 1:
                    total = total + hp.ref_cross_entropy(logits[k - 1], toks[k])
                    count += 1
        out.append((total, count))
    return out


def ref_loss64(case: TrainCase, model, ids, ctx, train: bool = True) -> Tensor:
    terms = ref_sample_terms(case, model, ids, ctx, case.dropped(train))
    count = sum(c for _, c in terms)
    return sum((t for t, _ in terms), torch.zeros((), dtype=torch.float64)) / max(count, 1)


@dataclass
class Grads:
    loss: Tensor
    params: dict[str, Tensor | None]
    context: Tensor | None


def loss_and_grads(case: TrainCase, model, ids: Tensor, ctx: Tensor | None, train: bool = True) -> Grads:
    model.zero_grad(set_to_none=True)
    loss = case.loss(model, ids, ctx, train)
    if loss.requires_grad:
        loss.backward()
    cg = None if ctx is None else (torch.zeros_like(ctx) if ctx.grad is None else ctx.grad.detach().clone())
    return Grads(loss.detach(), hp.param_grads(model), cg)


def assert_grads_bitwise(got: Grads, want: Grads, what: str, skip: set[str] = frozenset()) -> None:
    hp.assert_bitwise(got.loss, want.loss, f"{what}: loss")
    hp.assert_grads_match(got.params, want.params, what, skip=skip)
    if want.context is not None:
        hp.assert_bitwise(got.context, want.context, f"{what}: grad of context")


def assert_grads_close(got: Grads, want: Grads, what: str, dtype: torch.dtype) -> None:
    hp.assert_close(got.loss.double(), want.loss.double(), f"{what}: loss", dtype)
    hp.assert_grads_match(got.params, want.params, what, dtype)
    if want.context is not None:
        hp.assert_close(got.context.double(), want.context.double(), f"{what}: grad of context", dtype)


# ----------------------------------------------------------------------------------------------------
# drawn generation problems
# ----------------------------------------------------------------------------------------------------


@dataclass
class GenCase:
    """Padded prompts, a condition (maybe with all-False rows or zero-length, maybe None), a
    negative condition (none, per sample, or one shared by the batch), and the guidance settings."""

    lengths: list[int]
    n: int
    ctx_mask: Tensor | None  # (b, j); None with ctx_kind 'none'
    ctx_kind: str  # 'masked' | 'none'
    neg_kind: str  # 'none' | 'batch' | 'shared'
    neg_mask: Tensor | None  # (b | 1, jn)
    null: str
    cond_scale: float
    phi: float
    steps: int
    seed: int
    left: bool = True  # prompts padded on the left (else on the right)

    @property
    def b(self) -> int:
        return len(self.lengths)

    def mask(self) -> Tensor:
        return mask_from_lengths(self.lengths, self.n, left=self.left)

    def prompts(self) -> Tensor:
        g = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, VOCAB, (self.b, self.n), generator=g)

    def context(self, dtype=torch.float32) -> Tensor | None:
        if self.ctx_kind == "none":
            return None
        g = torch.Generator().manual_seed(self.seed + 1)
        return (torch.randn(self.b, self.ctx_mask.shape[1], CTX_DIM, generator=g) * 2).to(dtype)

    def negative(self, dtype=torch.float32) -> Tensor | None:
        if self.neg_kind == "none":
            return None
        g = torch.Generator().manual_seed(self.seed + 2)
        return torch.randn(*self.neg_mask.shape, CTX_DIM, generator=g).to(dtype)

    def kwargs(self, prompts=None, ctx=None, neg=None, dtype=torch.float32, **over) -> dict:
        """Keyword arguments for ``generate`` / ``next_token_logits`` (``ctx``/``neg`` replace the clean ones)."""
        kw = dict(mask=self.mask(), cond_scale=self.cond_scale, guidance_rescale=self.phi)
        if self.ctx_kind != "none":
            kw.update(context=self.context(dtype) if ctx is None else ctx, context_mask=self.ctx_mask)
        if self.neg_kind != "none":
            kw.update(negative_context=self.negative(dtype) if neg is None else neg, negative_context_mask=self.neg_mask)
        kw.update(over)
        return kw

    def alone(self, s: int, dtype=torch.float64) -> tuple[Tensor, dict]:
        """Sample ``s`` alone: its real prompt tokens and real (negative) context positions, no masks."""
        prompt = self.prompts()[s][self.mask()[s]][None]
        kw = dict(cond_scale=self.cond_scale, guidance_rescale=self.phi)
        if self.ctx_kind != "none":
            kw["context"] = self.context(dtype)[s][self.ctx_mask[s]][None]
        if self.neg_kind != "none":
            r = 0 if self.neg_kind == "shared" else s
            kw["negative_context"] = self.negative(dtype)[r][self.neg_mask[r]][None]
        return prompt, kw

    def ref_guided64(self, model, s: int) -> Tensor:
        """``(v,)`` the plain float64 guided next-token logits of sample ``s`` alone."""
        prompt, kw = self.alone(s)
        cond = ref_logits64(model, prompt[0], kw["context"][0] if "context" in kw else None)[-1]
        if self.cond_scale == 1.0:
            return cond
        if "negative_context" in kw:
            uctx = kw["negative_context"][0]
        elif self.null == "learned":
            uctx = model.null_token.detach()
        elif self.ctx_kind == "none":
            return cond  # no condition, no null token: nothing to guide
        else:
            uctx = None
        uncond = ref_logits64(model, prompt[0], uctx)[-1]
        return hp.ref_guidance(cond, uncond, self.cond_scale, self.phi)

    def cross_dead_samples(self, model) -> Tensor:
        """``(b,)`` or ``(2b,)`` (conditional then unconditional branch): samples whose cross-attention
        sees no real key in the batched forward of ``generate``."""
        cond = torch.ones(self.b, dtype=torch.bool) if self.ctx_kind == "none" else ~self.ctx_mask.any(1)
        if self.cond_scale == 1.0:
            return cond
        if self.neg_kind != "none":
            uncond = ~self.neg_mask.any(1).expand(self.b)
        elif model.null_token is not None:
            uncond = torch.zeros(self.b, dtype=torch.bool)
        elif self.ctx_kind == "none":
            return cond  # one branch only
        else:
            uncond = torch.ones(self.b, dtype=torch.bool)
        if self.cond_scale == 0.0 and self.phi == 0.0:  # the conditional branch has scale 0 and is not the
            return uncond  # rescale's reference: only the unconditional one runs
        return torch.cat((cond, uncond))


@st.composite
def gen_cases(draw, scales=(3.0, 0.0, 1.0)) -> GenCase:
    """Prompts padded on the left (mostly) or the right; sizes are drawn from lists whose first (simplest)
    element is a mid-sized case, so that the few examples are not all minimal."""
    b = draw(st.sampled_from([3, 1, 2]))
    n = draw(st.sampled_from([4, 1, 2, 3, 5]))
    lengths = draw(st.lists(st.integers(1, n), min_size=b, max_size=b))
    left = draw(st.sampled_from([True, True, False]))
    ctx_kind = draw(st.sampled_from(["masked", "masked", "masked", "none"]))
    j = draw(st.sampled_from([3, 0, 1, 2, 4]))
    rows = [draw(st.lists(st.booleans(), min_size=j, max_size=j)) for _ in range(b)]
    if draw(st.booleans()):  # an all-False context row on purpose
        rows[draw(st.integers(0, b - 1))] = [False] * j
    ctx_mask = torch.tensor(rows, dtype=torch.bool).reshape(b, j)
    neg_kind = draw(st.sampled_from(["batch", "none", "shared", "none"]))
    jn = draw(st.sampled_from([2, 0, 1, 3]))
    nb = 1 if neg_kind == "shared" else b
    neg_mask = torch.tensor([draw(st.lists(st.booleans(), min_size=jn, max_size=jn)) for _ in range(nb)], dtype=torch.bool).reshape(nb, jn)
    return GenCase(
        lengths, n, None if ctx_kind == "none" else ctx_mask, ctx_kind, neg_kind, None if neg_kind == "none" else neg_mask,
        draw(st.sampled_from(NULLS)), draw(st.sampled_from(scales)), draw(st.sampled_from([0.5, 0.0])),
        draw(st.sampled_from([3, 1, 2, 4])), draw(st.integers(0, 2**20)), left,
    )


def fixed_gen(cond_scale: float = 3.0, null: str = "empty", neg: str = "batch") -> GenCase:
    """Left padding, an all-False context row, a negative context with an all-False row."""
    return GenCase(
        [3, 1, 4], 4, torch.tensor([[True, False, True], [True, True, False], [False, False, False]]), "masked",
        neg, None if neg == "none" else torch.tensor([[True, False], [False, False], [True, True]])[: 1 if neg == "shared" else 3],
        null, cond_scale, 0.5, 4, 11,
    )


class Capture:
    """A ``filter_logits_fn`` that records the logits of each step and keeps only their argmax (so
    sampling at temperature 1 is greedy, and every step's logits can be compared)."""

    def __init__(self) -> None:
        self.steps: list[Tensor] = []

    def __call__(self, logits: Tensor) -> Tensor:
        self.steps.append(logits.detach().clone())
        top = logits.argmax(-1, keepdim=True)
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, top, True)
        return logits.masked_fill(~keep, float("-inf"))


def generate_captured(model, prompts, case: GenCase, **kw) -> tuple[Tensor, list[Tensor]]:
    cap = Capture()
    tokens = model.generate(prompts, case.steps, temperature=1.0, filter_logits_fn=cap, **kw)
    return tokens, cap.steps


# ----------------------------------------------------------------------------------------------------
# S1 finite
# ----------------------------------------------------------------------------------------------------


@hp.examples(15)
@example(tc=fixed_train(0.5, "learned"))
@example(tc=fixed_train(1.0, "empty"))
@given(tc=train_cases())
def test_s1_finite_loss_and_grads(tc: TrainCase):
    """Dead rows on purpose (left padding under causal, fully padded samples, all-False and zero-length
    contexts, conditions dropped with p in {0, 0.5, 1}, train mode): the loss and every gradient are
    finite, and the loss equals the plain float64 reference."""
    model = model_of(tc.null, tc.p)
    ids, ctx = tc.ids(), tc.context()
    run = loss_and_grads(tc, model, ids, ctx)
    hp.assert_finite(run.loss, "loss")
    got = {k: g for k, g in run.params.items() if g is not None}
    assert got, "no parameter received a gradient"
    for k, g in got.items():
        hp.assert_finite(g, f"grad of {k}")
    if ctx is not None:
        hp.assert_finite(run.context, "grad of context")
    hp.assert_close(run.loss, ref_loss64(tc, model, ids, ctx), "loss vs float64 reference", torch.float32)


@hp.examples(10)
@example(gc=fixed_gen(3.0, "empty"))
@example(gc=fixed_gen(0.0, "learned", "none"))
@given(gc=gen_cases())
def test_s1_finite_guided_generation(gc: GenCase):
    """For cond_scale 0, 1 and 3: guided next-token logits are finite, greedy generation gives valid
    token ids whose first token is the argmax of those logits, and sampling (top-k) gives valid ids."""
    model = model_of(gc.null)
    prompts = gc.prompts()
    for scale in (0.0, 1.0, 3.0):
        kw = gc.kwargs(cond_scale=scale)
        logits = model.next_token_logits(prompts, **kw)
        assert logits.shape == (gc.b, VOCAB)
        hp.assert_finite(logits, f"guided logits (cond_scale={scale})")
        greedy = model.generate(prompts, gc.steps, temperature=0.0, **kw)
        sampled = model.generate(prompts, gc.steps, temperature=1.0, filter_logits_fn="top_k", filter_kwargs={"k": 5}, **kw)
        for what, toks in (("greedy", greedy), ("sampled", sampled)):
            assert toks.shape == (gc.b, gc.steps) and toks.dtype == torch.long, f"{what}: {toks.shape} {toks.dtype}"
            assert bool(((toks >= 0) & (toks < VOCAB)).all()), f"{what} (cond_scale={scale}): invalid ids {toks.tolist()}"
        assert torch.equal(greedy[:, 0], logits.argmax(-1)), f"cond_scale={scale}: first greedy token vs argmax of logits"


# ----------------------------------------------------------------------------------------------------
# S2 a dropped condition is an exact no-op; dead rows are exactly zero
# ----------------------------------------------------------------------------------------------------


@hp.examples(10)
@example(tc=fixed_train(0.0, "empty"))
@given(tc=train_cases(ps=(0.0,)))
def test_s2_dropped_condition_is_exact_noop(tc: TrainCase):
    """The loss with an all-False context mask, with a zero-length context, and (null "empty") with
    every condition dropped in train mode (cond_drop_prob 1) equals the loss with context=None bit for
    bit; so do all gradients, the cross-attention's are exactly 0 and the context's too. In a mixed
    batch every dead row (no context; left padding under causal) of every attention is exactly 0 and
    passes exactly 0 gradient back. Guided next-token logits with an all-False context mask equal those
    without a context bit for bit at cond_scale 1, and at any other scale do not depend on cond_scale
    (bit for bit) and equal those of a zero-length context."""
    sc = tc.sc
    ids = tc.ids()
    ctx = torch.randn(sc.b, max(sc.j, 1), CTX_DIM, generator=sc.generator()).requires_grad_()
    some_mask = sc.ctx_mask if sc.j else torch.ones(sc.b, 1, dtype=torch.bool)  # any mask: all dropped
    none_mask = torch.zeros(sc.b, ctx.shape[1], dtype=torch.bool)
    for null in NULLS:
        model = model_of(null)
        cross = cross_param_names(model)
        plain = loss_and_grads(TrainCase(sc, 0.0, null, "none"), model, ids, None, train=True)
        runs = [
            ("all-False context mask", model, dict(context=ctx, context_mask=none_mask)),
            ("zero-length context", model, dict(context=ctx[:, :0])),
            ("zero-length context, empty mask", model, dict(context=ctx[:, :0], context_mask=none_mask[:, :0])),
        ]
        if null == "empty":
            runs.append(("cond_drop_prob=1 (empty null)", model_of("empty", 1.0), dict(context=ctx, context_mask=some_mask)))
        for what, m, kw in runs:
            m.zero_grad(set_to_none=True)
            ctx.grad = None
            loss = m.train()(ids, mask=sc.seq_mask, **kw)
            loss.backward()
            got = Grads(loss.detach(), hp.param_grads(m), None)
            assert_grads_bitwise(got, plain, f"{null} null, {what} vs context=None", skip=cross)
            for k in cross:
                hp.assert_zero(got.params[k], f"{null} null, {what}: grad of cross-attention parameter {k}", none_ok=True)
            hp.assert_zero(ctx.grad, f"{null} null, {what}: grad of context", none_ok=True)

    # dead rows inside a mixed batch: each cross-attention output row of a sample without context is 0
    model = model_of("empty")
    ctx = torch.randn(sc.b, sc.j, CTX_DIM, generator=sc.generator()).requires_grad_()
    dead = {"main.cross": hp.ctx_dead(sc.ctx_mask, sc.n - 1), "main.self": tc.self_dead()}
    with hp.capture_attention(model, roles(model)) as seen:
        model.train()(ids, mask=sc.seq_mask, context=ctx, context_mask=sc.ctx_mask)
    checked = hp.assert_dead_rows_zero(seen, dead)
    keys = {"main.self": sc.n - 1, "main.cross": sc.j}
    expected = {r for r, rows in dead.items() if rows.any() and keys[r] > 0}
    assert expected <= checked, f"dead rows of {sorted(expected - checked)} were never seen"

    # guidance: with an all-False context mask the conditional branch is the unconditional one, so the
    # guided logits do not depend on cond_scale (bit for bit, among scales that run both branches) and
    # equal those of a zero-length context. cond_scale=0 runs the unconditional branch alone, and
    # context=None runs no branch pair either (a batch of b, not 2b): those agree to float32 rounding,
    # since CPU matmuls round differently for different batch sizes, with or without masks.
    prompts, pmask = ids, sc.seq_mask.clone()
    pmask[:, -1] = True  # every prompt needs a real token
    model.eval()
    cdet, empty = ctx.detach(), torch.zeros_like(sc.ctx_mask)
    one = model.next_token_logits(prompts, mask=pmask, context=cdet, context_mask=empty, cond_scale=1.0)
    hp.assert_bitwise(one, model.next_token_logits(prompts, mask=pmask, cond_scale=1.0), "logits (cond_scale=1), all-False context mask vs no context")
    guided = {s: model.next_token_logits(prompts, mask=pmask, context=cdet, context_mask=empty, cond_scale=s) for s in (0.0, 3.0, -2.0)}
    zero_len = model.next_token_logits(prompts, mask=pmask, context=cdet[:, :0], cond_scale=3.0)
    for s, got in guided.items():
        if s != 0.0:
            hp.assert_bitwise(got, guided[3.0], f"guided logits with an all-False context mask, cond_scale={s} vs 3")
        hp.assert_close(got, guided[0.0], f"guided logits with an all-False context mask, cond_scale={s} vs 0", torch.float32)
        hp.assert_close(got, one, f"guided logits with an all-False context mask (cond_scale={s}) vs no context", torch.float32)
    hp.assert_bitwise(zero_len, guided[3.0], "guided logits, zero-length context vs all-False context mask")


# ----------------------------------------------------------------------------------------------------
# S3 no leak from masked positions
# ----------------------------------------------------------------------------------------------------


@hp.examples(10)
@example(tc=fixed_train(0.5, "learned"))
@example(tc=fixed_train(0.5, "empty"))
@given(tc=train_cases())
def test_s3_no_leak_from_masked_positions(tc: TrainCase):
    """NaN, +-inf or 3e38 at masked context positions and garbage ids at padded token positions change
    neither the loss nor any parameter gradient (bit for bit); the context's gradient is exactly 0 at
    masked positions and unchanged elsewhere."""
    model = model_of(tc.null, tc.p)
    ids, ctx = tc.ids(), tc.context()
    base = loss_and_grads(tc, model, ids, ctx)
    pad = ~tc.sc.seq_mask
    junk = torch.randint(-(10**6), 10**6, ids.shape, generator=torch.Generator().manual_seed(tc.sc.seed + 5))
    bad_ids = torch.where(pad, junk, ids)
    for value in GARBAGE:
        bad_ctx = None
        if ctx is not None:
            bad_ctx = ctx.detach().clone()
            bad_ctx[~tc.ctx_real()] = value
            bad_ctx.requires_grad_()
        run = loss_and_grads(tc, model, bad_ids, bad_ctx)
        if ctx is not None:
            masked = ~tc.ctx_real()
            hp.assert_zero(run.context[masked], f"grad of context at masked positions holding {value}")
            hp.assert_bitwise(run.context[~masked], base.context[~masked], f"grad of context at real positions ({value} planted)")
        assert_grads_bitwise(Grads(run.loss, run.params, None), Grads(base.loss, base.params, None), f"{value} at masked positions")


@hp.examples(10)
@example(gc=fixed_gen(3.0, "empty", "batch"))
@example(gc=fixed_gen(2.0, "learned", "shared"))
@given(gc=gen_cases(scales=(3.0, 0.0, 1.0, -0.5)))
def test_s3_no_leak_into_guided_generation(gc: GenCase):
    """Garbage ids at padded prompt positions and NaN/+-inf/3e38 at masked positions of the context and
    of the negative context change neither the guided next-token logits (bit for bit) nor any token,
    with or without the KV cache."""
    model = model_of(gc.null)
    prompts = gc.prompts()
    clean_logits = model.next_token_logits(prompts, **gc.kwargs())
    clean_tokens = model.generate(prompts, gc.steps, temperature=0.0, **gc.kwargs())
    junk = torch.randint(-(10**6), 10**6, prompts.shape, generator=torch.Generator().manual_seed(gc.seed + 3))
    bad_prompts = torch.where(gc.mask(), prompts, junk)
    for value in GARBAGE:
        ctx = neg = None
        if gc.ctx_kind != "none":
            ctx = torch.where(gc.ctx_mask[..., None], gc.context(), value)
        if gc.neg_kind != "none":
            neg = torch.where(gc.neg_mask[..., None], gc.negative(), value)
        kw = gc.kwargs(ctx=ctx, neg=neg)
        hp.assert_bitwise(model.next_token_logits(bad_prompts, **kw), clean_logits, f"guided logits with {value} planted")
        tokens = model.generate(bad_prompts, gc.steps, temperature=0.0, **kw)
        assert torch.equal(tokens, clean_tokens), f"{value} planted: {tokens.tolist()} vs {clean_tokens.tolist()}"
        uncached = model.generate(bad_prompts, gc.steps, temperature=0.0, cache_kv=False, **kw)
        assert torch.equal(uncached, clean_tokens), f"{value} planted, without the KV cache"


# ----------------------------------------------------------------------------------------------------
# S4 padding invariance
# ----------------------------------------------------------------------------------------------------


@hp.examples(10)
@example(tc=fixed_train(0.5, "learned"))
@given(tc=train_cases(styles=("left", "right"), force_dead=False) | train_cases(styles=("left", "right")))
def test_s4_padding_invariance(tc: TrainCase):
    """The loss of a left- or right-padded batch (float64) is the count-weighted mean of each sample's
    loss run alone (its padding and its context's padding removed; a dropped condition as nothing or
    the learned null token), and each per-sample loss equals the plain float64 reference."""
    model = model_of(tc.null, tc.p, dtype=torch.float64)
    ids, ctx = tc.ids(), tc.context(torch.float64)
    batch = tc.loss(model, ids, ctx).detach()
    dropped = tc.dropped(True)
    ref = ref_sample_terms(tc, model, ids, ctx, dropped)
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    for s in range(tc.b):
        real = tc.sc.seq_mask[s]
        c = tc.sample_context(model, ctx, s, dropped)
        alone = model(ids[s, real][None], context=None if c is None else c[None]).detach()
        n_s = max(int(real.sum()) - 1, 0)
        if n_s == 0:
            hp.assert_zero(alone, f"loss of sample {s} with no counted target")
        else:
            hp.assert_close(alone, ref[s][0] / ref[s][1], f"sample {s} alone vs float64 reference", torch.float64)
        assert ref[s][1] == n_s
        total, count = total + alone * n_s, count + n_s
    hp.assert_close(batch, total / max(count, 1), "batch loss vs count-weighted mean of samples alone", torch.float64)


@hp.examples(8)
@example(gc=fixed_gen(3.0, "empty", "batch"))
@example(gc=fixed_gen(3.0, "learned", "none"))
@given(gc=gen_cases())
def test_s4_guided_generation_padding_invariance(gc: GenCase):
    """Greedy guided generation of a left- (or right-) padded batch (float64) equals each prompt alone
    (prompt, context and negative context unpadded); the first step's guided logits equal those of the
    sample alone and the plain float64 reference (float32 model: to float32 tolerance)."""
    model64 = model_of(gc.null, dtype=torch.float64)
    model32 = model_of(gc.null)
    prompts = gc.prompts()
    tokens = model64.generate(prompts, gc.steps, temperature=0.0, **gc.kwargs(dtype=torch.float64))
    logits32 = model32.next_token_logits(prompts, **gc.kwargs())
    for s in range(gc.b):
        prompt, kw = gc.alone(s)
        alone = model64.generate(prompt, gc.steps, temperature=0.0, **kw)
        assert tokens[s].tolist() == alone[0].tolist(), f"sample {s}: batch {tokens[s].tolist()} vs alone {alone[0].tolist()}"
        ref = gc.ref_guided64(model64, s)
        # next_token_logits hands back the logits sampling sees: float32, whatever the model's dtype
        hp.assert_close(model64.next_token_logits(prompt, **kw)[0], ref, f"sample {s} alone: logits vs reference", torch.float32)
        hp.assert_close(logits32[s], ref, f"sample {s} in the batch: guided logits vs float64 reference", torch.float32)


# ----------------------------------------------------------------------------------------------------
# S5 every path agrees
# ----------------------------------------------------------------------------------------------------


@hp.examples(8)
@example(tc=fixed_train(0.5, "learned"))
@example(tc=fixed_train(1.0, "empty"))
@given(tc=train_cases())
def test_s5_paths_agree(tc: TrainCase):
    """The loss and every gradient on the fused SDPA backends (auto, math, flash) and the float32
    reference path agree with the float64 reference path, dead rows and dropped conditions included."""
    ctx64 = tc.context(torch.float64)
    want = loss_and_grads(tc, model_of(tc.null, tc.p, "reference", torch.float64), tc.ids(), ctx64)
    hp.assert_close(want.loss, ref_loss64(tc, model_of(tc.null, tc.p, "reference", torch.float64), tc.ids(), ctx64),
                    "float64 reference path vs plain reference", torch.float64)
    runs = {}
    for backend in hp.ALL_BACKENDS:
        runs[backend] = loss_and_grads(tc, model_of(tc.null, tc.p, backend), tc.ids(), tc.context())
        assert_grads_close(runs[backend], want, f"backend={backend} vs float64", torch.float32)
    for backend in hp.SDPA_BACKENDS:
        assert_grads_close(runs[backend], runs["reference"], f"backend={backend} vs backend='reference'", torch.float32)


@hp.examples(8)
@example(gc=fixed_gen(3.0, "empty", "batch"))
@example(gc=fixed_gen(2.0, "learned", "none"))
@given(gc=gen_cases(scales=(3.0, 0.0, 1.0, 7.5)))
def test_s5_cached_and_uncached_guided_generation_agree(gc: GenCase):
    """Guided generation with the KV cache (one batched cache for both branches) and without it (the
    whole sequence recomputed each step), and with two separate passes, give the same tokens and the
    same guided logits at every step (float64 and float32; float32 to its tolerance), on every
    backend."""
    prompts = gc.prompts()
    for dtype in (torch.float64, torch.float32):
        for backend in hp.ALL_BACKENDS if dtype == torch.float32 else ("auto",):
            model = model_of(gc.null, backend=backend, dtype=dtype)
            kw = gc.kwargs(dtype=dtype)
            cached, c_steps = generate_captured(model, prompts, gc, cache_kv=True, **kw)
            uncached, u_steps = generate_captured(model, prompts, gc, cache_kv=False, **kw)
            assert torch.equal(cached, uncached), f"{dtype} {backend}: cached {cached.tolist()} vs uncached {uncached.tolist()}"
            assert len(c_steps) == len(u_steps) == gc.steps
            for t, (a, b) in enumerate(zip(c_steps, u_steps)):
                hp.assert_close(a.double(), b.double(), f"{dtype} {backend}: guided logits at step {t}, cached vs uncached", dtype)
            if dtype == torch.float64:  # the peers' way: conditional and unconditional as two forwards, two caches
                negs, null = model._negatives(prompts, sf.Conditions(context=kw.get("negative_context"), context_mask=kw.get("negative_context_mask")))
                neg = {"negative_context": negs.context, "negative_context_mask": negs.context_mask, "null_context": null}
                cap = Capture()
                two = sf.generate_tokens(
                    model.net, prompts, gc.steps, mask=kw["mask"], context=kw.get("context"), context_mask=kw.get("context_mask"),
                    **neg, temperature=1.0, filter_logits_fn=cap,
                    cond_scale=gc.cond_scale, guidance_rescale=gc.phi, pad_value=model.pad_value, _two_pass=True,
                )
                assert torch.equal(two, cached), f"two passes {two.tolist()} vs one batched pass {cached.tolist()}"
                for t, (a, b) in enumerate(zip(cap.steps, c_steps)):
                    hp.assert_close(a.double(), b.double(), f"guided logits at step {t}, two passes vs batched", torch.float32)


# ----------------------------------------------------------------------------------------------------
# S6 the kernel is not trusted
# ----------------------------------------------------------------------------------------------------


def generation_dead(cross: Tensor, self_dead: Tensor) -> dict:
    """The rows known to be dead in guided generation, by role, for ``helpers.NaNKernel``: ``cross``
    ``(B,)`` samples (both CFG branches) whose context is empty, all rows; ``self_dead`` ``(B, n)`` prompt
    positions before the first real token (in any call that covers the whole prompt)."""

    def cross_rows(q, k, v, attn_mask):
        return cross[:, None, None] if cross.shape[0] == q.shape[0] else None

    def self_rows(q, k, v, attn_mask):
        (b, _, i, _), n = q.shape, self_dead.shape[1]
        if self_dead.shape[0] != b or i < n:
            return None
        return torch.cat((self_dead, torch.zeros(b, i - n, dtype=torch.bool)), dim=1)[:, None, :]

    return {"main.cross": cross_rows, "main.self": self_rows}


@hp.examples(8)
@example(tc=fixed_train(0.5, "learned"), gc=fixed_gen(3.0, "empty", "batch"))
@example(tc=fixed_train(1.0, "empty"), gc=fixed_gen(1.0, "learned", "none"))
@given(tc=train_cases(), gc=gen_cases())
def test_s6_kernel_not_trusted(tc: TrainCase, gc: GenCase):
    """A kernel that writes NaN into every dead row (rows its mask leaves without a key, and every row
    known to be dead) changes neither the loss nor any gradient (bit for bit), nor the guided logits
    nor the generated tokens, on every SDPA backend."""
    dead = {"main.self": tc.self_dead(), "main.cross": tc.cross_dead(True)}
    must_fire = bool(dead["main.self"].any()) or (bool(dead["main.cross"].any()) and tc.sc.j > 0 and tc.ctx_kind != "none")
    prompts = gc.prompts()
    for backend in hp.SDPA_BACKENDS:
        model = model_of(tc.null, tc.p, backend)
        with sf.testing.substitute_kernel(hp.faithful_kernel()):
            clean = loss_and_grads(tc, model, tc.ids(), tc.context())
        kernel = hp.NaNKernel(dead)
        with sf.testing.substitute_kernel(kernel), hp.track_roles(model, roles(model), kernel):
            poisoned = loss_and_grads(tc, model, tc.ids(), tc.context())
        if must_fire:
            assert kernel.poisoned > 0, "the NaN kernel never saw a dead row: the test would prove nothing"
        assert_grads_bitwise(poisoned, clean, f"loss under the NaN kernel, backend={backend}")

        gen = model_of(gc.null, backend=backend)
        kw = gc.kwargs()
        clean_logits = gen.next_token_logits(prompts, **kw)
        clean_tokens = gen.generate(prompts, gc.steps, temperature=0.0, **kw)
        cross = gc.cross_dead_samples(gen)
        self_dead = hp.causal_dead(gc.mask()).repeat(cross.shape[0] // gc.b, 1)
        for cache_kv in (True, False):
            kernel = hp.NaNKernel(generation_dead(cross, self_dead))
            with sf.testing.substitute_kernel(kernel), hp.track_roles(gen, roles(gen), kernel):
                logits = gen.next_token_logits(prompts, **kw)
                tokens = gen.generate(prompts, gc.steps, temperature=0.0, cache_kv=cache_kv, **kw)
            # the cross-attention kernel runs only for a context of some length in a branch that runs
            runs_cond = not (gc.cond_scale == 0.0 and gc.phi == 0.0)
            j_ctx = 0 if gc.ctx_mask is None else gc.ctx_mask.shape[1]
            j_uncond = gc.neg_mask.shape[1] if gc.neg_kind != "none" and gc.neg_mask is not None else j_ctx
            j_run = max(j_ctx if runs_cond else 0, j_uncond if gc.cond_scale != 1.0 else 0)
            fires = bool(self_dead.any()) or (bool(cross.any()) and gc.ctx_kind != "none" and j_run > 0)
            if fires:
                assert kernel.poisoned > 0, "the NaN kernel never saw a dead row in generation"
            hp.assert_bitwise(logits, clean_logits, f"guided logits under the NaN kernel, backend={backend}")
            assert torch.equal(tokens, clean_tokens), f"tokens under the NaN kernel, backend={backend}, cache_kv={cache_kv}"


# ----------------------------------------------------------------------------------------------------
# S7 half precision, large logits
# ----------------------------------------------------------------------------------------------------


def _max_logit(model, run) -> float:
    rec = hp.RecordingKernel()
    with sf.testing.substitute_kernel(rec), torch.no_grad():
        run(model)
    return max((c.max_abs_logit for c in rec.calls), default=0.0)


_SCALED: dict[tuple, AutoregressiveWrapper] = {}


def scaled_model(null: str, p: float, dtype: torch.dtype) -> AutoregressiveWrapper:
    """The wrapper in ``dtype`` with q/k weights scaled so that the largest |q.k| * scale is ~4e3 on the
    fixed batch (measured by a recording kernel, before and after the cast)."""
    key = (null, p, dtype)
    if key not in _SCALED:
        tc = fixed_train(0.0, null)
        run = lambda m, dt=torch.float32: tc.loss(m, tc.ids(), tc.context(dt), train=False)
        model = hp.set_unpadded(hp.seeded_module(lambda: make_model(null, p)), False)  # hooks follow dead rows
        base = _max_logit(model, run)
        factor = (4000.0 / base) ** 0.5
        with torch.no_grad():
            for m in hp.attention_modules(model):
                m.to_q.weight.mul_(factor)
                m.to_k.weight.mul_(factor)
        model = model.to(dtype)
        reached = _max_logit(model, lambda m: run(m, dtype))
        assert 1e3 <= reached <= 1e5, f"largest |logit| {reached:.3g} is not in the regime this test is about"
        _SCALED[key] = model
    return _SCALED[key]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@hp.examples(4)
@example(tc=fixed_train(0.5, "learned"), gc=fixed_gen(3.0, "empty", "batch"))
@given(tc=train_cases(), gc=gen_cases(scales=(3.0, 0.0)))
def test_s7_half_precision(dtype: torch.dtype, tc: TrainCase, gc: GenCase):
    """With |q.k| * scale ~1e3-1e4 in bfloat16 and float16: the loss and every gradient are finite
    (fused and reference path), dead cross-attention rows are exactly 0, a fully dropped condition
    (null "empty") gives bit for bit the loss without a context, and guided logits are finite with
    greedy tokens that are their argmax."""
    model = scaled_model(tc.null, tc.p, dtype)
    ids = tc.ids()
    for backend in ("auto", "reference"):
        hp.set_backend(model, backend)
        try:
            run = loss_and_grads(tc, model, ids, tc.context(dtype))
            with hp.capture_attention(model, roles(model)) as seen, torch.no_grad():
                tc.loss(model, ids, tc.context(dtype))
        finally:
            hp.set_backend(model, "auto")
        hp.assert_finite(run.loss, f"{dtype} loss ({backend})")
        grads = {k: g for k, g in run.params.items() if g is not None}
        assert grads
        for k, g in grads.items():
            hp.assert_finite(g, f"{dtype} grad of {k} ({backend})")
        if run.context is not None:
            hp.assert_finite(run.context, f"{dtype} grad of context ({backend})")
        for role, _, out, _ in seen:
            if role == "main.cross":
                hp.assert_zero(out[tc.cross_dead(True)], f"{dtype} cross-attention output at dead rows ({backend})")
    if tc.null == "empty" and tc.ctx_kind != "none":
        dropper = scaled_model("empty", 1.0, dtype)
        ctx = tc.context(dtype)
        dropped = dropper.train()(ids, mask=tc.sc.seq_mask, context=ctx, context_mask=tc.ctx_mask())
        plain = dropper(ids, mask=tc.sc.seq_mask)
        hp.assert_bitwise(dropped, plain, f"{dtype}: loss with every condition dropped vs context=None")

    gen = scaled_model(gc.null, 0.0, dtype)
    prompts = gc.prompts()
    kw = gc.kwargs(dtype=dtype)
    logits = gen.next_token_logits(prompts, **kw)
    hp.assert_finite(logits, f"{dtype} guided logits")
    tokens = gen.generate(prompts, gc.steps, temperature=0.0, **kw)
    assert bool(((tokens >= 0) & (tokens < VOCAB)).all())
    assert torch.equal(tokens[:, 0], logits.argmax(-1)), f"{dtype}: first greedy token vs argmax of guided logits"


# ----------------------------------------------------------------------------------------------------
# S8 safe losses
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("null", NULLS)
@pytest.mark.parametrize("p", [0.0, 1.0])
def test_s8_all_ignored_loss_is_zero(p: float, null: str):
    """All targets ignore_index, an all-False mask, single-token sequences, every sample fully padded:
    the loss is exactly 0.0 (float32, not NaN) and every gradient (null token and context included) is
    exactly 0; ignore_index inside a sample counts exactly like padding there."""
    model = model_of(null, p).train()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (3, 5), generator=g)
    ctx_mask = torch.tensor([[True, False, True, True], [False] * 4, [True] * 4])
    cases = {
        "all targets ignore_index": dict(x=torch.full_like(ids, IGNORE)),
        "all-False mask": dict(x=ids, mask=torch.zeros_like(ids, dtype=torch.bool)),
        "single-token sequences": dict(x=ids[:, :1]),
        "one real token per sample": dict(x=ids, mask=torch.arange(5).expand(3, 5) == torch.tensor([[0], [2], [4]])),
        "alternating real tokens": dict(x=ids, mask=(torch.arange(5) % 2 == 0).expand(3, 5)),
    }
    for what, kw in cases.items():
        for ctx_given in (True, False):
            model.zero_grad(set_to_none=True)
            ctx = torch.randn(3, 4, CTX_DIM, generator=g).requires_grad_() if ctx_given else None
            loss = model(kw["x"], mask=kw.get("mask"), context=ctx, context_mask=ctx_mask if ctx_given else None)
            assert loss.dtype == torch.float32 and loss.item() == 0.0 and not torch.isnan(loss), f"{what}: loss {loss}"
            loss.backward()
            for name, prm in model.named_parameters():
                hp.assert_zero(prm.grad, f"{what}: grad of {name}", none_ok=True)
            if ctx is not None:
                hp.assert_zero(ctx.grad, f"{what}: grad of context", none_ok=True)

    # ignore_index in the middle of a sample is padding there (bit for bit), and matches the reference
    holes = torch.tensor([[True, True, False, True, True], [True] * 5, [False, True, True, False, True]])
    ctx = torch.randn(3, 4, CTX_DIM, generator=g)
    tc = TrainCase(Scenario(holes, ctx_mask, seed=9), p, null, "masked")
    torch.manual_seed(9)
    by_ignore = model(torch.where(holes, ids, IGNORE), context=ctx, context_mask=ctx_mask)
    by_mask = tc.loss(model, ids, ctx)
    hp.assert_bitwise(by_ignore, by_mask, "ignore_index vs mask=False at the same positions")
    hp.assert_close(by_mask.detach(), ref_loss64(tc, model, ids, ctx), "loss with holes vs float64 reference", torch.float32)


# ----------------------------------------------------------------------------------------------------
# S9 bad input gets a clear error
# ----------------------------------------------------------------------------------------------------


def _bad_calls(model: AutoregressiveWrapper):
    """``(what, call, exception type, argument the message must name)``."""
    b, n, j = 2, 5, 4
    x = torch.randint(0, VOCAB, (b, n), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(b, n, dtype=torch.bool)
    ctx, cm = torch.randn(b, j, CTX_DIM), torch.tensor([[True, True, False, False], [True] * 4])
    p = x[:, :3]
    pm = torch.tensor([[False, True, True], [True, True, True]])
    neg = torch.randn(b, 3, CTX_DIM)
    loss = lambda **kw: model.train()(x, **kw)
    gen = lambda **kw: model.generate(p, 3, **{"mask": pm, **kw})
    logits = lambda **kw: model.next_token_logits(p, **{"mask": pm, **kw})
    calls = [
        # the loss
        ("int mask", lambda: loss(mask=mask.long()), TypeError, "mask"),
        ("float mask", lambda: loss(mask=mask.float()), TypeError, "mask"),
        ("mask of wrong shape", lambda: loss(mask=torch.ones(b, n + 1, dtype=torch.bool)), ValueError, "mask"),
        ("(n, n) mask", lambda: loss(mask=torch.ones(n, n, dtype=torch.bool)), ValueError, "mask"),
        ("mask on another device", lambda: loss(mask=torch.ones(b, n, dtype=torch.bool, device="meta")), ValueError, "mask"),
        ("float token ids", lambda: model(x.float()), TypeError, "x"),
        ("token ids of 3 dims", lambda: model(x[..., None]), ValueError, "x"),
        ("context_mask without context", lambda: loss(context_mask=cm), ValueError, "context_mask"),
        ("int context_mask", lambda: loss(context=ctx, context_mask=cm.long()), TypeError, "context_mask"),
        ("float context_mask", lambda: loss(context=ctx, context_mask=cm.float()), TypeError, "context_mask"),
        ("context_mask of wrong shape", lambda: loss(context=ctx, context_mask=torch.ones(b, j + 1, dtype=torch.bool)), ValueError, "context_mask"),
        ("context of wrong batch", lambda: loss(context=torch.randn(b + 1, j, CTX_DIM)), ValueError, "context"),
        ("context of 2 dims", lambda: loss(context=torch.randn(b, CTX_DIM)), ValueError, "context"),
        ("context of wrong width (eval)", lambda: model.eval()(x, context=torch.randn(b, j, CTX_DIM + 1)), ValueError, "context"),
        # generation
        ("int prompt mask", lambda: gen(mask=pm.long()), TypeError, "mask"),
        ("float prompt mask", lambda: gen(mask=pm.float()), TypeError, "mask"),
        ("prompt mask of wrong shape", lambda: gen(mask=torch.ones(b, 4, dtype=torch.bool)), ValueError, "mask"),
        ("prompt mask with an empty row", lambda: gen(mask=torch.tensor([[False] * 3, [True] * 3])), ValueError, "mask"),
        ("float prompts", lambda: model.generate(p.float(), 3), TypeError, "prompts"),
        ("prompts of 1 dim", lambda: model.generate(p[0], 3), ValueError, "prompts"),
        ("negative seq_len", lambda: model.generate(p, -1), ValueError, "seq_len"),
        ("context_mask without context", lambda: gen(context_mask=cm), ValueError, "context_mask"),
        ("int context_mask", lambda: gen(context=ctx, context_mask=cm.long(), cond_scale=3.0), TypeError, "context_mask"),
        ("context_mask of wrong shape, cond_scale 1", lambda: gen(context=ctx, context_mask=torch.ones(b, j + 1, dtype=torch.bool)), ValueError, "context_mask"),
        ("context of wrong width, cond_scale 1", lambda: gen(context=torch.randn(b, j, CTX_DIM + 1)), ValueError, "context"),
        ("context of wrong batch", lambda: gen(context=torch.randn(b + 1, j, CTX_DIM), cond_scale=3.0), ValueError, "context"),
        ("negative_context_mask without negative_context", lambda: gen(context=ctx, negative_context_mask=cm, cond_scale=3.0), ValueError, "negative_context_mask"),
        ("int negative_context_mask", lambda: gen(context=ctx, cond_scale=3.0, negative_context=neg, negative_context_mask=torch.ones(b, 3, dtype=torch.long)), TypeError, "negative_context_mask"),
        ("negative_context_mask of wrong shape", lambda: gen(context=ctx, cond_scale=3.0, negative_context=neg, negative_context_mask=torch.ones(b, 4, dtype=torch.bool)), ValueError, "negative_context_mask"),
        ("negative_context of 2 dims", lambda: gen(context=ctx, cond_scale=3.0, negative_context=neg[0]), ValueError, "negative_context"),
        ("NaN cond_scale", lambda: gen(context=ctx, cond_scale=NAN), ValueError, "cond_scale"),
        ("inf cond_scale", lambda: gen(context=ctx, cond_scale=math.inf), ValueError, "cond_scale"),
        ("string cond_scale", lambda: gen(context=ctx, cond_scale="3"), ValueError, "cond_scale"),
        ("guidance_rescale > 1", lambda: gen(context=ctx, cond_scale=3.0, guidance_rescale=1.5), ValueError, "guidance_rescale"),
        ("negative guidance_rescale", lambda: logits(context=ctx, cond_scale=3.0, guidance_rescale=-0.1), ValueError, "guidance_rescale"),
        ("negative temperature", lambda: gen(temperature=-1.0), ValueError, "temperature"),
        ("NaN temperature", lambda: gen(temperature=NAN), ValueError, "temperature"),
        ("unknown filter name", lambda: gen(filter_logits_fn="top_q"), ValueError, "filter_logits_fn"),
        ("top_k with k=0", lambda: gen(filter_logits_fn="top_k", filter_kwargs={"k": 0}), ValueError, "top_k"),
        ("top_p with p=2", lambda: gen(filter_logits_fn="top_p", filter_kwargs={"p": 2.0}), ValueError, "top_p"),
        ("min_p with min_p=-1", lambda: gen(filter_logits_fn="min_p", filter_kwargs={"min_p": -1.0}), ValueError, "min_p"),
        ("float eos_token", lambda: gen(eos_token=1.5), TypeError, "eos_token"),
        ("prompt longer than max_seq_len", lambda: model.generate(p, MAX_SEQ), ValueError, "max_seq_len"),
        ("next_token_logits: NaN cond_scale", lambda: logits(context=ctx, cond_scale=NAN), ValueError, "cond_scale"),
        ("next_token_logits: int mask", lambda: logits(mask=pm.int()), TypeError, "mask"),
    ]
    return calls


@pytest.mark.parametrize("null", NULLS)
def test_s9_bad_input_errors(null: str):
    """Wrong mask dtypes (TypeError) and shapes, masks without their context, wrong context shapes,
    bad guidance/sampling arguments, bad constructor arguments: each raises the documented error whose
    message names the argument; the same calls with good arguments give finite values."""
    model = model_of(null, 0.5)
    hp.assert_clear_errors(_bad_calls(model))
    ctor = [
        ("cond_drop_prob > 1", lambda: AutoregressiveWrapper(make_model("empty", 0.0).net, cond_drop_prob=1.5), ValueError, "cond_drop_prob"),
        ("unknown null_context", lambda: AutoregressiveWrapper(make_model("empty", 0.0).net, null_context="zeros"), ValueError, "null_context"),
        ("non-causal net", lambda: AutoregressiveWrapper(sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=8, attn_layers=sf.Encoder(dim=DIM, depth=1))), ValueError, "net"),
        ("not a TransformerWrapper", lambda: AutoregressiveWrapper(sf.Decoder(dim=DIM, depth=1)), TypeError, "net"),
    ]
    hp.assert_clear_errors(ctor)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        AutoregressiveWrapper(make_model("empty", 0.0).net, cond_dropout=0.1)
    # check_finite=True on the net: NaN at a real context position is reported, at a masked one it is not
    checked = hp.copy_weights(make_model(null, 0.0, check_finite=True), model)
    x = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    ctx, cm = torch.randn(2, 4, CTX_DIM), torch.tensor([[True, True, False, False], [True] * 4])
    nan_real, nan_masked = ctx.clone(), ctx.clone()
    nan_real[1, 2, 0] = NAN
    nan_masked[0, 3] = NAN
    for what, call in (
        ("loss", lambda c: checked.eval()(x, context=c, context_mask=cm)),
        ("generate", lambda c: checked.generate(x[:, :3], 2, context=c, context_mask=cm, cond_scale=3.0, temperature=0.0)),
        ("next_token_logits", lambda c: checked.next_token_logits(x[:, :3], context=c, context_mask=cm, cond_scale=3.0)),
    ):
        with pytest.raises(ValueError) as info:
            call(nan_real)
        assert hp.names_argument(str(info.value), "context"), f"{what}, NaN at a real context position: {info.value}"
        clean, masked = call(ctx), call(nan_masked)
        assert torch.equal(masked, clean), f"{what}: NaN at a masked context position changed the result"
        hp.assert_finite(masked.float(), f"{what} with NaN at a masked context position")

    # the good calls run and give finite values: the errors come from the argument under test
    x = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    ctx, cm = torch.randn(2, 4, CTX_DIM), torch.tensor([[True, True, False, False], [True] * 4])
    hp.assert_finite(model.train()(x, mask=torch.ones(2, 5, dtype=torch.bool), context=ctx, context_mask=cm).detach(), "loss")
    hp.assert_finite(model.next_token_logits(x[:, :3], context=ctx, context_mask=cm, cond_scale=3.0,
                                             negative_context=torch.randn(2, 3, CTX_DIM)), "guided logits")


def _gen_setup(null: str):
    model = model_of(null)
    p = torch.randint(0, VOCAB, (2, 3), generator=torch.Generator().manual_seed(0))
    ctx, cm = torch.randn(2, 4, CTX_DIM), torch.tensor([[True, True, False, False], [True] * 4])
    return model, p, ctx, cm


def _unvalidated():
    """Inputs the contract says must raise a clear error, which ``generation.py`` does not check yet:
    ``(id, call, exception type, text the message must contain)``."""

    def neg_width(null):
        model, p, ctx, cm = _gen_setup(null)
        return model.generate(p, 2, context=ctx, context_mask=cm, cond_scale=3.0, negative_context=torch.randn(2, 3, CTX_DIM + 1))

    def neg_batch(null):
        model, p, ctx, cm = _gen_setup(null)
        return model.generate(p, 2, context=ctx, context_mask=cm, cond_scale=3.0, negative_context=torch.randn(3, 3, CTX_DIM))

    def neg_int(null):
        model, p, ctx, cm = _gen_setup(null)
        return model.generate(p, 2, context=ctx, cond_scale=3.0, negative_context=torch.ones(2, 3, CTX_DIM, dtype=torch.long))

    def ctx_mask_shape_guided(null):
        model, p, ctx, cm = _gen_setup(null)
        return model.generate(p, 2, context=ctx, context_mask=torch.ones(2, 5, dtype=torch.bool), cond_scale=3.0)

    def ctx_width_guided(null):
        model, p, ctx, cm = _gen_setup(null)
        return model.generate(p, 2, context=torch.randn(2, 4, CTX_DIM + 1), cond_scale=3.0)

    def ctx_width_train_learned(null):
        model = model_of(null, 0.5).train()
        x = torch.randint(0, VOCAB, (2, 5))
        return model(x, context=torch.randn(2, 4, CTX_DIM + 1))

    def int_context_loss(null):
        model = model_of(null, 0.0).eval()
        x = torch.randint(0, VOCAB, (2, 5))
        return model(x, context=torch.ones(2, 4, CTX_DIM, dtype=torch.long))

    def filter_kwargs_without_filter(null):
        model, p, ctx, cm = _gen_setup(null)
        return model.generate(p, 2, filter_kwargs={"k": 3})

    def nan_real_negative_checked(null):
        model = hp.copy_weights(make_model(null, 0.0, check_finite=True), model_of(null))
        p = torch.randint(0, VOCAB, (2, 3), generator=torch.Generator().manual_seed(0))
        neg = torch.randn(2, 3, CTX_DIM)
        neg[1, 1, 0] = NAN
        return model.generate(p, 2, context=torch.randn(2, 4, CTX_DIM), cond_scale=3.0, negative_context=neg)

    def nan_real_context_dropped_checked(null):
        model = hp.copy_weights(make_model(null, 1.0, check_finite=True), model_of(null, 1.0)).train()
        ctx = torch.randn(2, 4, CTX_DIM)
        ctx[1, 1, 0] = NAN
        return model(torch.randint(0, VOCAB, (2, 5)), context=ctx)

    return [
        pytest.param(neg_width, "empty", ValueError, "negative_context", id="negative_context-of-wrong-width"),
        pytest.param(neg_batch, "empty", ValueError, "negative_context", id="negative_context-of-wrong-batch-names-it"),
        pytest.param(neg_int, "empty", TypeError, "negative_context", id="int-negative_context-names-it"),
        pytest.param(ctx_mask_shape_guided, "empty", ValueError, "context_mask", id="context_mask-of-wrong-shape-cond_scale-3"),
        pytest.param(ctx_width_guided, "learned", ValueError, "context", id="context-of-wrong-width-cond_scale-3-learned-null"),
        pytest.param(ctx_width_guided, "empty", ValueError, "(2, 4, 13)", id="context-of-wrong-width-cond_scale-3-reports-its-shape"),
        pytest.param(ctx_width_train_learned, "learned", ValueError, "context", id="context-of-wrong-width-train-learned-null-names-context"),
        pytest.param(int_context_loss, "empty", TypeError, "context", id="integer-context-in-the-loss"),
        pytest.param(nan_real_negative_checked, "empty", ValueError, "negative_context", id="check_finite-NaN-in-real-negative_context-names-it"),
        pytest.param(nan_real_context_dropped_checked, "empty", ValueError, "context", id="check_finite-NaN-in-real-context-of-a-dropped-sample"),
        pytest.param(filter_kwargs_without_filter, "empty", ValueError, "filter_kwargs", id="filter_kwargs-without-filter_logits_fn"),
    ]


@pytest.mark.parametrize("call, null, exc, text", _unvalidated())
def test_s9_bad_input_errors_more_cases(call, null, exc, text):
    """S9 cases first found unvalidated in generation.py / wrappers.py: the call must raise ``exc``
    whose message names ``text``."""
    try:
        call(null)
    except exc as e:
        if text.startswith("("):
            assert text in str(e), f"message does not report the shape {text}: {e}"
        else:
            assert hp.names_argument(str(e), text), f"the {exc.__name__} does not name {text!r}: {e}"
        if text == "context":  # the message must not blame another argument
            assert not hp.names_argument(str(e), "null_context") and not hp.names_argument(str(e), "uncond_context"), str(e)
        return
    pytest.fail(f"no {exc.__name__} raised")
