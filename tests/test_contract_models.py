"""The safety contract (docs/safety.md, S1-S9) for every public module of the model stack.

Each clause is one test function, parametrized over one small case per module (``helpers.CASES``:
Attention as self- and as cross-attention, Encoder, Decoder, CrossAttender, TransformerWrapper,
ContinuousTransformerWrapper, XTransformer), so a failure names the clause and the module.
Masks are drawn by hypothesis with dead rows on purpose: fully padded samples, all-False context
masks, zero-length contexts, left padding under causal masking, holes.

Shape legend: b batch, n sequence positions, j context positions, c model width.
"""

from __future__ import annotations

from dataclasses import dataclass

import helpers as hp
import pytest
import torch
from helpers import CASES, NAN, Case, Inputs, Scenario
from hypothesis import example, given
from hypothesis import strategies as st
from torch import Tensor, nn

import safeformer as sf

IDS = [c.name for c in CASES]
ALL_IDS = [c.name for c in hp.ALL_CASES]  # the stacks again on the unpadded path
ATTENTION_CASES = ("Attention-self", "Attention-self-padding", "Attention-past-kv", "Attention-cross")



@pytest.fixture(autouse=True)
def _one_thread():
    with hp.single_thread():
        yield


_MODELS: dict[tuple[str, str, torch.dtype], nn.Module] = {}


def model_of(case: Case, backend: str = "auto", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The case's module (built once per backend and dtype; tests never change its weights)."""
    key = (case.name, backend, dtype)
    if key not in _MODELS:
        _MODELS[key] = hp.set_unpadded(case.build(backend, dtype), getattr(case, "unpadded", False))
    return _MODELS[key]


@dataclass
class Run:
    out: Tensor
    leaf_grads: dict[str, Tensor]
    param_grads: dict[str, Tensor | None]


def forward_backward(case: Case, model: nn.Module, inp: Inputs, rows: Tensor | None = None) -> Run:
    """Output, and the gradients of ``sum(out * u)`` (a fixed random ``u``, zero outside ``rows (b, n)``
    when given) for inputs and parameters."""
    model.zero_grad(set_to_none=True)
    for leaf in inp.leaves.values():
        leaf.grad = None
    out = case.run(model, inp)
    if out.dim() == 0:
        loss = out
    else:
        g = torch.Generator().manual_seed(1234)
        u = torch.randn(out.shape, generator=g)
        if rows is not None:
            u = u * rows[..., None]
        loss = (out * u.to(out.dtype)).sum()
    if loss.requires_grad:
        loss.backward()
    # a leaf that takes part in the output must receive a gradient: a missing one (None) is not a zero one
    missing = [k for k, v in inp.leaves.items() if v.grad is None and loss.requires_grad]
    assert not missing, f"no gradient reached input(s) {missing}"
    leaf_grads = {k: (torch.zeros_like(v) if v.grad is None else v.grad.detach().clone()) for k, v in inp.leaves.items()}
    return Run(out.detach(), leaf_grads, hp.param_grads(model))


def assert_runs_equal(got: Run, want: Run, what: str, params: bool = True) -> None:
    hp.assert_bitwise(got.out, want.out, f"{what}: output")
    for k in want.leaf_grads:
        hp.assert_bitwise(got.leaf_grads[k], want.leaf_grads[k], f"{what}: grad of {k}")
    if params:
        hp.assert_grads_match(got.param_grads, want.param_grads, f"{what}: parameters")


def assert_runs_close(got: Run, want: Run, what: str, dtype: torch.dtype) -> None:
    hp.assert_close(got.out.double(), want.out.double(), f"{what}: output", dtype)
    for k in want.leaf_grads:
        hp.assert_close(got.leaf_grads[k].double(), want.leaf_grads[k].double(), f"{what}: grad of {k}", dtype)
    hp.assert_grads_match(got.param_grads, want.param_grads, f"{what}: parameters", dtype)


# ----------------------------------------------------------------------------------------------------
# S1 finite
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", hp.ALL_CASES, ids=ALL_IDS)
@hp.examples(15)
@example(sc=hp.fixed_scenario())
@given(sc=hp.scenarios())
def test_s1_finite(case: Case, sc: Scenario):
    """Dead rows, all-False masks, zero-length contexts, fully padded samples: the output and every
    input and parameter gradient are finite (checked on the results: anomaly mode locates a NaN, it is not
    needed to find one)."""
    model = model_of(case)
    inp = case.inputs(sc)
    run = forward_backward(case, model, inp)
    hp.assert_finite(run.out, "output")
    for k, g in run.leaf_grads.items():
        hp.assert_finite(g, f"grad of {k}")
    got = [k for k, g in run.param_grads.items() if g is not None]
    assert got, "no parameter received a gradient"
    for k in got:
        hp.assert_finite(run.param_grads[k], f"grad of parameter {k}")


# ----------------------------------------------------------------------------------------------------
# S2 dead rows are exactly zero
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
@hp.examples(15)
@example(sc=hp.fixed_scenario())
@given(sc=hp.scenarios())
def test_s2_dead_rows_exactly_zero(case: Case, sc: Scenario):
    """Every attention's output at its dead rows is exactly 0.0, and a gradient arriving at those rows
    passes exactly 0 into its projections and its inputs."""
    model = model_of(case)
    dead = case.dead(sc)
    with hp.capture_attention(model, case.roles(model)) as seen:
        case.run(model, case.inputs(sc))
    assert seen, "no attention ran"
    checked = hp.assert_dead_rows_zero(seen, dead)
    expected = {r for r, rows in dead.items() if rows.any()}
    assert checked == expected, f"dead rows of {sorted(expected - checked)} were never seen"


@pytest.mark.parametrize("case", [c for c in CASES if c.has_context], ids=[c.name for c in CASES if c.has_context])
def test_s2_empty_context_leaves_residual_unchanged(case: Case):
    """An all-False context mask or a zero-length context for the whole batch gives bit-for-bit the
    output of running without a context (the cross-attention adds exactly 0.0)."""
    sc = hp.fixed_scenario()
    model = model_of(case)
    inp = case.inputs(sc)
    none_mask = torch.zeros_like(sc.ctx_mask)
    if isinstance(case, hp.XTransformerCase):
        src, tgt = inp.args
        masked = model(src, tgt, mask=none_mask, tgt_mask=inp.kwargs["tgt_mask"])
        empty = model(src[:, :0], tgt, mask=none_mask[:, :0], tgt_mask=inp.kwargs["tgt_mask"])
        real = inp.kwargs["tgt_mask"]
        logits = model.decoder.net(tgt[:, :-1], mask=real[:, :-1])  # no context at all
        target = torch.where(real[:, 1:], tgt[:, 1:], -100)
        plain = sf.safe_cross_entropy(logits, target)
        hp.assert_bitwise(masked, plain, "loss with an all-False source mask vs no context")
        hp.assert_bitwise(empty, plain, "loss with a zero-length source vs no context")
        return
    if isinstance(case, hp.AttentionCrossCase):
        x, ctx = inp.args
        for what, out in (("all-False mask", model(x, ctx, mask=none_mask)[0]), ("zero-length context", model(x, ctx[:, :0])[0])):
            hp.assert_zero(out, f"cross-attention output with an {what}")
            model.zero_grad(set_to_none=True)
            x.grad = None
            (out * torch.randn_like(out)).sum().backward()
            for name, p in model.named_parameters():
                hp.assert_zero(p.grad, f"grad of {name} with an {what}", none_ok=True)
            hp.assert_zero(x.grad, f"grad of x with an {what}", none_ok=True)
        return
    args, kw = inp.args, {k: v for k, v in inp.kwargs.items() if k not in ("context", "context_mask")}
    ctx = inp.kwargs["context"]
    if isinstance(case, hp.CrossAttenderCase):
        # a CrossAttender needs a context: compare with the stack whose cross blocks are skipped by hand
        ref = torch.where(sc.seq_mask[..., None], args[0], 0.0)
        for kind, layer in zip(model.layer_kinds, model.layers):
            if kind == "ff":
                ref = ref + layer.mixer(layer.norm(ref))
        ref = torch.where(sc.seq_mask[..., None], model.final_norm(ref), 0.0)  # padded positions leave as 0
    elif getattr(case, "memory_keys", False):
        # memory keys stay when the context goes (x-transformers' semantics): an all-False mask equals a
        # zero-length context (both attend to the memory keys only), which is not "no cross-attention"
        ref = model(*args, **kw, context=ctx[:, :0])
        hp.assert_close(model(*args, **kw, context=ctx, context_mask=none_mask), ref,
                        "all-False context mask vs zero-length context (memory keys only)", torch.float32)
        return
    else:
        ref = model(*args, **kw)
    hp.assert_bitwise(model(*args, **kw, context=ctx, context_mask=none_mask), ref, "all-False context mask vs no context")
    hp.assert_bitwise(model(*args, **kw, context=ctx[:, :0], context_mask=none_mask[:, :0]), ref, "zero-length context vs no context")
    hp.assert_bitwise(model(*args, **kw, context=ctx[:, :0]), ref, "zero-length context without a mask vs no context")


# ----------------------------------------------------------------------------------------------------
# S3 no leak from masked positions
# ----------------------------------------------------------------------------------------------------

GARBAGE = (NAN, float("inf"), float("-inf"), 3.0e38)




@pytest.mark.parametrize(
    "case", hp.ALL_CASES, ids=ALL_IDS
)
@hp.examples(15)
@example(sc=hp.fixed_scenario())
@given(sc=hp.scenarios())
def test_s3_no_leak_from_masked_positions(case: Case, sc: Scenario):
    """NaN, +-inf or huge numbers (or garbage token ids) at padded positions of the input and masked
    positions of the context change no output anywhere; their gradient is exactly 0; every other
    input gradient is unchanged (bit for bit)."""
    model = model_of(case)
    base = forward_backward(case, model, case.inputs(sc))
    for value in GARBAGE:
        planted = case.plant(case.inputs(sc), sc, value)
        run = forward_backward(case, model, planted)
        hp.assert_bitwise(run.out, base.out, f"output with {value} at masked positions")
        for k, where in planted.planted.items():
            grad = run.leaf_grads[k]
            hp.assert_zero(grad[where], f"grad of {k} at masked positions holding {value}")
            hp.assert_bitwise(grad[~where], base.leaf_grads[k][~where], f"grad of {k} at real positions ({value} planted)")
        if case.name not in ATTENTION_CASES:  # the module-level case is test_s3_..._parameter_grads
            assert_runs_equal(run, base, f"{value} planted")




@pytest.mark.parametrize(
    "case", hp.ALL_CASES, ids=ALL_IDS,
)
def test_s3_masked_positions_do_not_reach_parameter_grads(case: Case):
    """With NaN/inf at masked positions, every parameter gradient equals the clean run's, bit for bit."""
    sc = hp.fixed_scenario()
    model = model_of(case)
    base = forward_backward(case, model, case.inputs(sc))
    for value in GARBAGE:
        run = forward_backward(case, model, case.plant(case.inputs(sc), sc, value))
        for k, g in base.param_grads.items():
            got = run.param_grads[k]
            if g is None:
                assert got is None or not bool(got.any()), k
            else:
                hp.assert_bitwise(got, g, f"grad of parameter {k} with {value} at masked positions")


# ----------------------------------------------------------------------------------------------------
# S4 padding invariance
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", hp.ALL_CASES, ids=ALL_IDS)
@hp.examples(15)
@example(sc=hp.fixed_scenario())
@given(sc=hp.scenarios(force_dead=False) | hp.scenarios())
def test_s4_padding_invariance(case: Case, sc: Scenario):
    """Each sample's outputs at its real positions equal those of the sample run alone, unpadded
    (left padding, right padding, holes, with its context's padding removed, possibly to length 0)."""
    model = model_of(case, dtype=torch.float64)
    inp = case.inputs(sc, torch.float64)
    out = case.run(model, inp).detach()
    if case.scalar_output:  # XTransformer: the batch loss is the count-weighted mean of per-sample losses
        counts = (inp.kwargs["tgt_mask"].sum(1) - 1).clamp(min=0)
        total = torch.zeros((), dtype=torch.float64)
        for s in range(sc.b):
            alone = case.run(model, case.alone(inp, sc, s)).detach()
            if counts[s] == 0:
                hp.assert_zero(alone, f"loss of sample {s} with no counted target")
            total = total + alone * counts[s]
        # the loss is computed in float32 even for a float64 model (safe_cross_entropy casts with .float())
        hp.assert_close(out, total / counts.sum().clamp(min=1), "batch loss vs samples alone", torch.float32)
        return
    real = case.real(sc)
    for s in range(sc.b):
        if not real[s].any():
            continue
        alone = case.run(model, case.alone(inp, sc, s)).detach()
        hp.assert_close(out[s, real[s]], alone[0], f"sample {s} in the batch vs alone", torch.float64)


# ----------------------------------------------------------------------------------------------------
# S5 every path agrees
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", hp.ALL_CASES, ids=ALL_IDS)
@hp.examples(10)
@example(sc=hp.fixed_scenario(), prefix=2)
@given(sc=hp.scenarios(), prefix=st.integers(1, 6))
def test_s5_paths_agree(case: Case, sc: Scenario, prefix: int):
    """Fused SDPA (auto, math, flash) and the float32 reference path agree with the float64 reference
    path, outputs and gradients, dead rows included; decoding with the KV cache step by step agrees
    with the full forward at every position."""
    want = forward_backward(case, model_of(case, "reference", torch.float64), case.inputs(sc, torch.float64))
    runs = {}
    for backend in hp.ALL_BACKENDS:
        runs[backend] = forward_backward(case, model_of(case, backend), case.inputs(sc))
        assert_runs_close(runs[backend], want, f"backend={backend} vs float64", torch.float32)
    for backend in hp.SDPA_BACKENDS:
        assert_runs_close(runs[backend], runs["reference"], f"backend={backend} vs backend='reference'", torch.float32)
    if case.decodes:
        prefix = min(prefix, sc.n)
        for dtype in (torch.float64, torch.float32):
            model = model_of(case, "auto", dtype)
            inp = case.inputs(sc, dtype)
            with torch.no_grad():
                full = case.full_logits(model, inp) if case.scalar_output else case.run(model, inp)
                cached = case.decode(model, inp, sc, prefix)
            real = inp.kwargs["tgt_mask"] if case.scalar_output else case.real(sc)  # padded rows: not in the contract
            hp.assert_close(cached[real], full[real], f"KV-cache decoding (prefix {prefix}) vs full forward", dtype)


def test_s5_decoder_without_padding_uses_is_causal():
    """A decoder without padding hands the kernel is_causal=True and no mask tensor (flash-eligible)."""
    case = hp.DecoderCase()
    model = model_of(case)
    x = torch.randn(2, 5, hp.DIM)
    rec = hp.RecordingKernel()
    with sf.testing.substitute_kernel(rec):
        out = model(x)
    self_calls = [c for c in rec.calls if c.k_shape[2] == 5]
    assert len(self_calls) == 2
    assert all(c.is_causal and c.mask_shape is None for c in self_calls), self_calls
    hp.assert_close(out, model_of(case, "reference")(x), "is_causal path vs reference", torch.float32)


# ----------------------------------------------------------------------------------------------------
# S6 the kernel is not trusted
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", hp.ALL_CASES, ids=ALL_IDS)
@hp.examples(10)
@example(sc=hp.fixed_scenario())
@given(sc=hp.scenarios())
def test_s6_kernel_not_trusted(case: Case, sc: Scenario):
    """A kernel that writes NaN into every dead row (by its mask, and every row known to be dead)
    changes no output and no gradient, on every SDPA backend."""
    if getattr(case, "explicit_attention", False):
        pytest.skip("this case's attention runs the explicit path: no kernel is called (S2/S3 cover its dead rows)")
    dead = case.dead(sc)
    must_fire = any(rows.any() and case.key_len(sc, role) > 0 for role, rows in dead.items())
    for backend in hp.SDPA_BACKENDS:
        model = model_of(case, backend)
        with sf.testing.substitute_kernel(hp.faithful_kernel()):
            clean = forward_backward(case, model, case.inputs(sc))
        kernel = hp.NaNKernel(dead)
        with sf.testing.substitute_kernel(kernel), hp.track_roles(model, case.roles(model), kernel):
            poisoned = forward_backward(case, model, case.inputs(sc))
        if must_fire:
            assert kernel.poisoned > 0, "the NaN kernel never saw a dead row: the test would prove nothing"
        assert_runs_equal(poisoned, clean, f"NaN kernel on backend={backend}")


# ----------------------------------------------------------------------------------------------------
# S7 half precision, large logits
# ----------------------------------------------------------------------------------------------------


def _scale_qk(model: nn.Module, factor: float) -> None:
    with torch.no_grad():
        for m in hp.attention_modules(model):
            if m.q_norm is not None and m.qk_norm_q_scale is not None:  # qk-norm fixes the size of q and k;
                m.qk_norm_q_scale.mul_(factor)  # its learned scales set the logit scale
                m.qk_norm_k_scale.mul_(factor)
            elif m.q_norm is not None:  # or its fixed multipliers (qk_norm_scale)
                m.q_norm.mult *= factor
                m.k_norm.mult *= factor
            else:
                m.to_q.weight.mul_(factor)
                m.to_k.weight.mul_(factor)


def _max_logit(case: Case, model: nn.Module, inp: Inputs) -> float:
    rec = hp.RecordingKernel()
    with sf.testing.substitute_kernel(rec), torch.no_grad():
        case.run(model, inp)
    return max((c.max_abs_logit for c in rec.calls), default=0.0)


_SCALED: dict[tuple[str, torch.dtype], nn.Module] = {}


def scaled_model(case: Case, dtype: torch.dtype) -> nn.Module:
    """The case's module in ``dtype`` with q/k weights scaled so that the largest |q.k| * scale is ~4e3
    on the fixed scenario (measured by a recording kernel, before and after the cast)."""
    key = (case.name, dtype)
    if key not in _SCALED:
        sc = hp.fixed_scenario()
        model = hp.set_unpadded(case.build("auto"), getattr(case, "unpadded", False))
        base = _max_logit(case, model, case.inputs(sc))
        _scale_qk(model, (4000.0 / base) ** 0.5)
        reached = _max_logit(case, model.to(dtype), case.inputs(sc, dtype))
        assert 1e3 <= reached <= 1e5, f"largest |logit| {reached:.3g} is not in the regime this test is about"
        _SCALED[key] = model
    return _SCALED[key]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@hp.examples(4)
@example(sc=hp.fixed_scenario())
@given(sc=hp.scenarios())
def test_s7_half_precision_large_logits(case: Case, dtype: torch.dtype, sc: Scenario):
    """With q/k weights scaled so that |q.k| * scale reaches 1e3-1e4, bfloat16 and float16 give finite
    outputs and gradients on the fused and the reference path, and dead rows stay exactly 0.

    The loss covers real output positions only (as a masked loss does): a gradient sent into padded
    rows can overflow float16, see test_s7_fp16_gradient_into_padded_rows."""
    if getattr(case, "explicit_attention", False):
        pytest.skip("softclamped logits are bounded (|logit| <= attn_logit_softclamp_value): no large-logit regime")
    model = scaled_model(case, dtype)
    dead = case.dead(sc)
    for backend in ("auto", "reference"):
        hp.set_backend(model, backend)
        try:
            run = forward_backward(case, model, case.inputs(sc, dtype), case.real(sc))
            with hp.capture_attention(model, case.roles(model)) as seen, torch.no_grad():
                case.run(model, case.inputs(sc, dtype))
        finally:
            hp.set_backend(model, "auto")
        assert run.out.dtype == dtype or run.out.dim() == 0
        hp.assert_finite(run.out, f"{dtype} output ({backend})")
        for k, g in run.leaf_grads.items():
            hp.assert_finite(g, f"{dtype} grad of {k} ({backend})")
        grads = {k: g for k, g in run.param_grads.items() if g is not None}
        assert grads
        for k, g in grads.items():
            hp.assert_finite(g, f"{dtype} grad of {k} ({backend})")
        for role, _, out, _ in seen:
            hp.assert_zero(out[dead[role]], f"{dtype} {role} output at dead rows ({backend})")


def test_s7_fp16_gradient_into_padded_rows():
    """A loss over every output position (padding included) in float16, large logits, fully padded batch."""
    case = hp.TransformerWrapperCase()
    model = scaled_model(case, torch.float16)
    sc = Scenario(torch.zeros(2, 3, dtype=torch.bool), torch.tensor([[True, False, True], [False, False, False]]), seed=1947)
    run = forward_backward(case, model, case.inputs(sc, torch.float16))
    hp.assert_finite(run.out, "output")
    for k, g in run.param_grads.items():
        if g is not None:
            hp.assert_finite(g, f"grad of {k}")


# ----------------------------------------------------------------------------------------------------
# S8 safe reductions and losses
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", hp.ALL_CASES, ids=ALL_IDS)
def test_s8_safe_reductions(case: Case):
    """Pooling over a fully padded sample gives exactly 0 (others: the float64 mean of their real
    positions) with finite gradients; a loss whose targets are all ignored is exactly 0.0 with zero
    gradients."""
    sc = hp.fixed_scenario()
    assert not sc.seq_mask[2].any()  # sample 2 is fully padded
    model = model_of(case)
    model.zero_grad(set_to_none=True)
    if case.scalar_output:
        src, tgt = case.inputs(sc).args
        for what, kwargs in (
            ("all targets ignore_index", dict(tgt=torch.full_like(tgt, -100))),
            ("tgt_mask all False", dict(tgt=tgt, tgt_mask=torch.zeros_like(tgt, dtype=torch.bool))),
            ("single-token targets", dict(tgt=tgt[:, :1])),
        ):
            model.zero_grad(set_to_none=True)
            loss = model(src, kwargs.pop("tgt"), mask=sc.ctx_mask, **kwargs)
            assert loss.dtype == torch.float32 and loss.item() == 0.0 and not torch.isnan(loss), f"{what}: loss {loss}"
            loss.backward()
            for name, p in model.named_parameters():
                hp.assert_zero(p.grad, f"{what}: grad of {name}", none_ok=True)
        return
    inp = case.inputs(sc)
    pooled, per_position = case.pooled(model, inp, sc)
    hp.assert_zero(pooled[2], "pooled output of a fully padded sample")
    real = sc.seq_mask
    for s in range(sc.b):
        if real[s].any():
            want = per_position[s, real[s]].double().mean(0)
            hp.assert_close(pooled[s].double(), want, f"pooled output of sample {s}", torch.float32)
    (pooled * torch.randn_like(pooled)).sum().backward()
    for k, leaf in inp.leaves.items():
        if leaf.grad is not None:
            hp.assert_finite(leaf.grad, f"grad of {k}")
    grads = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    assert grads
    for name, g in grads:
        hp.assert_finite(g, f"grad of {name}")
    if isinstance(case, hp.TransformerWrapperCase):
        model.zero_grad(set_to_none=True)
        logits = model(*inp.args, **inp.kwargs)
        loss = sf.safe_cross_entropy(logits, torch.full(logits.shape[:2], -100))
        assert loss.item() == 0.0
        loss.backward()
        for name, p in model.named_parameters():
            hp.assert_zero(p.grad, f"all-ignored loss: grad of {name}", none_ok=True)


# ----------------------------------------------------------------------------------------------------
# S9 bad input gets a clear error
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_s9_bad_input_errors(case: Case):
    """Wrong mask dtype (TypeError), shape or device, wrong context width, a context mask without a
    context, non-finite real inputs under check_finite, unknown constructor arguments: each raises an
    error whose message names the argument."""
    sc = hp.fixed_scenario()
    model = model_of(case)
    inp = case.inputs(sc)
    calls = case.bad_calls(model, inp)
    assert len(calls) >= 4
    hp.assert_clear_errors(calls)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        case.unknown_kwarg()()
    # the same calls with good arguments run: the errors above come from the argument under test
    hp.assert_finite(case.run(model, inp).detach(), "output with good arguments")


# ----------------------------------------------------------------------------------------------------
# torch.inference_mode: the usual way to serve a model
# ----------------------------------------------------------------------------------------------------


def _inference_copy(x):
    """``x`` with every tensor copied; called inside ``torch.inference_mode``, the copies are inference tensors
    (no version counter, no autograd)."""
    if isinstance(x, Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_inference_copy(v) for v in x)
    if isinstance(x, dict):
        return {k: _inference_copy(v) for k, v in x.items()}
    return x


@pytest.mark.parametrize("case", hp.ALL_CASES, ids=ALL_IDS)
def test_inference_mode_equals_no_grad(case: Case):
    """Under ``torch.inference_mode``, with every input an inference tensor (masks and contexts included: a
    mask's validation cannot key on a version counter there), the output equals the ``no_grad`` output bit
    for bit."""
    model = model_of(case)
    inp = case.inputs(hp.fixed_scenario())
    with torch.no_grad():
        want = case.run(model, inp)
    with torch.inference_mode():
        got = case.run(model, Inputs(_inference_copy(inp.args), _inference_copy(inp.kwargs)))
    assert got.is_inference()
    hp.assert_bitwise(got, want, f"{case.name} under inference_mode: output")
