"""Diagnostics: find the first module that makes a non-finite value, and explain masks' dead rows.

- ``find_nonfinite(model, *args, **kwargs)`` runs one forward and one backward pass with hooks and
  names the first module whose output (forward), or whose gradient (backward, in the order autograd
  produces them), holds NaN or inf. When the gradient arriving at the model's outputs is already
  non-finite, it blames the loss (whatever consumed the outputs) instead of any module. It leaves the
  model as it found it.
- ``mask_report(...)`` counts, per sample, the dead rows of an attention (docs/safety.md: a query
  that may attend to no key) and says *why* each row is dead, from the parts of the mask.
- ``plot_mask(mask, path)`` writes a PNG of an ``(i, j)`` mask with its dead rows highlighted
  (matplotlib is imported only there; it is not a core dependency).

Shape legend: b batch, h heads, i queries, j keys, n sequence positions.
Masks follow safeformer's one convention: bool, True = may attend / is real.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from .core.masks import causal_mask, validate_mask

__all__ = [
    "NonFiniteTensor",
    "NonFiniteReport",
    "find_nonfinite",
    "DeadRowReport",
    "MaskReport",
    "mask_report",
    "plot_mask",
]


# ----------------------------------------------------------------------------------------------------
# find_nonfinite
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NonFiniteTensor:
    """One tensor found holding NaN or inf.

    Attributes:
        phase: ``"forward"`` (a module's output), ``"backward"`` (a gradient a module produced for its
            inputs or parameters), ``"loss"`` (the scalar that was backpropagated) or ``"incoming"``
            (the gradient arriving at the model's outputs from outside the model: made by the loss,
            or by whatever code consumed the outputs; ``module`` is then ``""``).
        module: qualified name of the module (``""`` is the model itself).
        module_type: the module's class name.
        what: which tensor: ``"output"``, ``"output[0]"``, ``"grad_input[1]"``,
            ``"grad of parameter 'weight'"``, ``"grad of output"``, ``"grad of output[0]"``, ...
        shape: the tensor's shape.
        dtype: the tensor's dtype.
        nan, posinf, neginf: how many entries are NaN, +inf, -inf.
        first_index: index of the first non-finite entry (for ``"incoming"``: the first offending
            output position, e.g. ``(sample, position, feature)`` for a ``(b, n, d)`` output).
        incoming_finite: backward only: whether the gradient flowing *into* the module (w.r.t. its
            outputs) was finite. ``False`` means the non-finite gradient came from above the module
            (the loss, or functional code between modules), not from the module itself. Always
            ``False`` for ``"incoming"`` (the finding is that gradient).
        positions: ``"incoming"`` only, for a tensor of 2 or more dims: the distinct indices over all
            dims but the last (for a ``(b, n, d)`` output: the ``(sample, position)`` pairs) that hold
            a non-finite entry, in order, at most ``_MAX_POSITIONS`` of them.
        position_count: how many such positions there are in all.
    """

    phase: str
    module: str
    module_type: str
    what: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nan: int
    posinf: int
    neginf: int
    first_index: tuple[int, ...]
    incoming_finite: bool | None = None
    positions: tuple[tuple[int, ...], ...] = ()
    position_count: int = 0

    @property
    def count(self) -> int:
        """Number of non-finite entries."""
        return self.nan + self.posinf + self.neginf

    def __str__(self) -> str:
        name = self.module if self.module else "<model>"
        numel = 1
        for s in self.shape:
            numel *= s
        if self.phase == "incoming":
            text = (
                f"incoming gradient from outside the model (the loss, or whatever consumed the outputs): "
                f"{self.what} of {name!r} ({self.module_type}), shape {self.shape} {self.dtype}: "
                f"{self.count} of {numel} non-finite ({self.nan} NaN, {self.posinf} +inf, {self.neginf} -inf), "
                f"first at output index {self.first_index}"
            )
            if self.position_count:
                shown = ", ".join(map(str, self.positions[:8])) + (" ..." if self.position_count > 8 else "")
                text += f"; at {self.position_count} output position(s) (index over all dims but the last): {shown}"
            return text
        text = (
            f"{self.phase}: {name!r} ({self.module_type}) {self.what}, shape {self.shape} {self.dtype}: "
            f"{self.count} of {numel} non-finite ({self.nan} NaN, {self.posinf} +inf, {self.neginf} -inf), "
            f"first at {self.first_index}"
        )
        if self.incoming_finite is False:
            text += "; its incoming gradient was already non-finite (the cause lies above this module)"
        return text


@dataclass(frozen=True)
class NonFiniteReport:
    """What ``find_nonfinite`` saw.

    Attributes:
        forward: the first module output that held NaN/inf, or ``None``.
        backward: the first gradient (module inputs or parameters, in the order autograd produced
            them) that held NaN/inf, or ``None``. When the gradient arriving at the model's outputs
            was already non-finite, this is that gradient (``phase == "incoming"``, the same finding
            as ``incoming``) and no module inside the model is blamed.
        loss: the value that was backpropagated, or ``None`` when no backward ran.
        loss_finding: the loss itself, when it was non-finite.
        nonfinite_parameters: names of parameters whose final gradient is non-finite.
        forward_offenders: qualified names of every module whose output held NaN/inf, in order.
        outputs_checked: module outputs checked in the forward pass.
        gradients_checked: gradients checked in the backward pass.
        backward_ran: whether a backward pass ran (the output needed a gradient).
        backward_hooks: ``"module"`` (full backward hooks: the gradient each module produced for its
            inputs) or ``"output"`` (the fallback for models with in-place modules: the gradient
            arriving at each module's outputs, so a finding names the module whose output received
            the non-finite gradient; the culprit is what consumed that output: the next module in
            the forward order, or code between modules).
        incoming: the gradient arriving at the model's outputs (the gradient of the top-level
            forward's output tensors), when it held NaN/inf: the non-finite gradient comes from
            outside the model, typically a loss that multiplies NaN/inf (in targets or outputs) at
            masked positions by a 0 mask (``0 * NaN = NaN``). ``None`` when it was finite (or no
            backward ran).
    """

    forward: NonFiniteTensor | None
    backward: NonFiniteTensor | None
    loss: float | None
    loss_finding: NonFiniteTensor | None
    nonfinite_parameters: tuple[str, ...]
    forward_offenders: tuple[str, ...]
    outputs_checked: int
    gradients_checked: int
    backward_ran: bool
    backward_hooks: str = "module"
    incoming: NonFiniteTensor | None = None

    @property
    def finite(self) -> bool:
        """True when every output, the loss and every gradient were finite."""
        return (
            self.forward is None and self.backward is None and self.loss_finding is None
            and not self.nonfinite_parameters
        )

    def __str__(self) -> str:
        if self.finite:
            back = f"{self.gradients_checked} gradients" if self.backward_ran else "no backward (output needs no grad)"
            return f"NonFiniteReport: all finite ({self.outputs_checked} module outputs, {back} checked)"
        lines = ["NonFiniteReport: non-finite values found"]
        if self.forward is not None:
            lines.append(f"  first {self.forward}")
            if len(self.forward_offenders) > 1:
                more = ", ".join(repr(n or "<model>") for n in self.forward_offenders[1:6])
                extra = " ..." if len(self.forward_offenders) > 6 else ""
                lines.append(f"  then {len(self.forward_offenders) - 1} more module output(s): {more}{extra}")
        if self.loss_finding is not None:
            lines.append(f"  {self.loss_finding}")
        if self.incoming is not None:
            lines.append(f"  {self.incoming}")
            lines.append("    no module inside the model is blamed: the gradient was already non-finite when it reached the outputs")
            if self.forward is not None:
                lines.append("    (the model's forward already made a non-finite value, see above: fix that first)")
            lines.append(
                "    if the loss masks positions by multiplying with the mask, NaN/inf at masked positions still "
                "gives 0 * NaN = NaN gradients: select them away before any arithmetic touches them, e.g. "
                "target = torch.where(mask, target, 0) or loss over out[mask], target[mask] "
                "(a torch.where on the final per-position loss is not enough)"
            )
        elif self.backward is not None:
            lines.append(f"  first {self.backward}")
            if self.backward_hooks == "output":
                lines.append("    (gradient w.r.t. this module's output: the culprit is what consumed that output)")
        elif self.backward_ran:
            lines.append("  backward: every gradient finite")
        if self.nonfinite_parameters:
            names = ", ".join(self.nonfinite_parameters[:6]) + (" ..." if len(self.nonfinite_parameters) > 6 else "")
            lines.append(f"  {len(self.nonfinite_parameters)} parameter(s) with non-finite .grad: {names}")
        return "\n".join(lines)

    __repr__ = __str__


def _tensors(obj) -> Iterator[tuple[str, Tensor]]:
    """``(path, tensor)`` for every tensor in a nested tuple/list/dict output."""
    if isinstance(obj, Tensor):
        yield "", obj
    elif isinstance(obj, (tuple, list)):
        for k, item in enumerate(obj):
            for path, t in _tensors(item):
                yield f"[{k}]{path}", t
    elif isinstance(obj, dict):
        for k, item in obj.items():
            for path, t in _tensors(item):
                yield f"[{k!r}]{path}", t
    elif hasattr(obj, "__dataclass_fields__"):
        for k in obj.__dataclass_fields__:
            for path, t in _tensors(getattr(obj, k)):
                yield f".{k}{path}", t


_MAX_POSITIONS = 64


def _describe(t: Tensor, phase: str, module: str, module_type: str, what: str, incoming=None) -> NonFiniteTensor | None:
    if not (t.is_floating_point() or t.is_complex()):
        return None
    bad = ~torch.isfinite(t)
    if not bool(bad.any()):
        return None
    first = tuple(int(v) for v in bad.nonzero()[0].tolist()) if t.dim() else ()
    positions: tuple[tuple[int, ...], ...] = ()
    position_count = 0
    if phase == "incoming" and t.dim() >= 2:
        where = bad.any(-1).nonzero()
        position_count = int(where.shape[0])
        positions = tuple(tuple(int(v) for v in row) for row in where[:_MAX_POSITIONS].tolist())
    return NonFiniteTensor(
        phase=phase, module=module, module_type=module_type, what=what, shape=tuple(t.shape), dtype=t.dtype,
        nan=int(torch.isnan(t).sum()), posinf=int(torch.isposinf(t).sum()), neginf=int(torch.isneginf(t).sum()),
        first_index=first, incoming_finite=incoming, positions=positions, position_count=position_count,
    )


def _all_finite(ts) -> bool:
    return all(t is None or not t.is_floating_point() or bool(torch.isfinite(t).all()) for t in ts)


def find_nonfinite(
    model: nn.Module,
    *args,
    loss_fn: Callable[..., Tensor] | None = None,
    train: bool | None = None,
    **kwargs,
) -> NonFiniteReport:
    """Run ``model(*args, **kwargs)`` forward and backward and report the first non-finite value.

    Forward hooks check every module's output as it is produced (children finish before their
    parents, so the first offender is the innermost, earliest one). Then a backward pass runs: of
    ``loss_fn(output)`` if given, else of the sum of the output's finite entries (so a NaN in the
    output does not by itself poison every gradient). The gradient arriving at the model's outputs
    is checked first: if it holds NaN/inf, the cause lies outside the model (the loss, e.g. one that
    multiplies NaN targets at padded positions by a 0 mask) and the report says so
    (``report.incoming``, ``report.backward.phase == "incoming"``) instead of blaming the last
    layer. Otherwise full backward hooks check the gradient each
    module produces for its inputs, and tensor hooks the gradient of each parameter, in the order
    autograd produces them. A model with a module that modifies its output in place (which full
    backward hooks cannot wrap) is run again with tensor hooks on every module's outputs instead
    (``report.backward_hooks == "output"``).

    The model is left as it was found: every hook is removed (also when the model raises), the
    training flag of every submodule is restored, and each parameter's ``.grad`` (and that of any
    leaf tensor argument) is put back as it was before the call.

    Args:
        model: the module to run.
        *args: positional arguments for ``model``.
        loss_fn: maps the model's output to the scalar to backpropagate.
        train: run in training (``True``) or evaluation (``False``) mode; ``None`` keeps the modes.
        **kwargs: keyword arguments for ``model``.

    Returns:
        a ``NonFiniteReport``; ``report.finite`` is True when nothing was found.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``loss_fn`` does not return a scalar tensor.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    try:
        return _one_pass(model, args, kwargs, loss_fn, train, module_hooks=True)
    except RuntimeError as err:
        # Full backward hooks wrap module outputs in a custom Function, and a module that modifies its
        # output in place (nn.ReLU(inplace=True)) then fails. Check the gradients of module outputs instead.
        if "BackwardHookFunction" not in str(err):
            raise
        return _one_pass(model, args, kwargs, loss_fn, train, module_hooks=False)


class _Probe:
    """The hooks of one ``find_nonfinite`` pass and what they found."""

    def __init__(self, model: nn.Module, module_hooks: bool):
        self.model = model
        self.module_hooks = module_hooks
        self.names = {m: name for name, m in model.named_modules()}
        self.forward_found: list[NonFiniteTensor] = []
        self.backward_found: list[NonFiniteTensor] = []
        self.incoming_found: list[NonFiniteTensor] = []
        self.counts = {"outputs": 0, "grads": 0}
        self.handles = []

    def output_grad_hook(self, name: str, mtype: str, what: str):
        """A tensor hook checking the gradient of one module output (the fallback without module hooks)."""
        def hook(g):
            self.counts["grads"] += 1
            found = _describe(g, "backward", name, mtype, what)
            if found is not None:
                self.backward_found.append(found)

        return hook

    def forward_hook(self, module, _inputs, output):
        """Check a module's outputs (and hook their gradients without module hooks)."""
        name, mtype = self.names.get(module, "?"), type(module).__name__
        found_here = False
        for path, t in _tensors(output):
            self.counts["outputs"] += 1
            if not found_here:
                found = _describe(t.detach(), "forward", name, mtype, "output" + path)
                if found is not None:
                    self.forward_found.append(found)
                    found_here = True
            if not self.module_hooks and t.requires_grad:
                t.register_hook(self.output_grad_hook(name, mtype, "grad_output" + path))

    def backward_hook(self, module, grad_input, grad_output):
        """Check the gradients a module produced for its inputs."""
        name = self.names.get(module, "?")
        incoming = _all_finite(grad_output)
        for k, g in enumerate(grad_input):
            if g is None:
                continue
            self.counts["grads"] += 1
            found = _describe(g, "backward", name, type(module).__name__, f"grad_input[{k}]", incoming)
            if found is not None:
                self.backward_found.append(found)
                break

    def param_hook(self, pname: str):
        """A tensor hook checking the gradient of one parameter."""
        mod_name, _, attr = pname.rpartition(".")
        mod_type = type(self.model.get_submodule(mod_name)).__name__ if mod_name else type(self.model).__name__

        def hook(g):
            self.counts["grads"] += 1
            found = _describe(g, "backward", mod_name, mod_type, f"grad of parameter {attr!r}")
            if found is not None:
                self.backward_found.append(found)

        return hook

    def incoming_hook(self, what: str):
        """A tensor hook checking the gradient arriving at one of the model's outputs."""
        def hook(g):
            self.counts["grads"] += 1
            found = _describe(g, "incoming", "", type(self.model).__name__, what, incoming=False)
            if found is not None:
                self.incoming_found.append(found)

        return hook

    def install(self, params: list[tuple[str, Tensor]]) -> None:
        """Hook every module (forward, and backward with module hooks) and every parameter."""
        for module in self.names:
            self.handles.append(module.register_forward_hook(self.forward_hook))
            if self.module_hooks:
                self.handles.append(module.register_full_backward_hook(self.backward_hook))
        for pname, p in params:
            self.handles.append(p.register_hook(self.param_hook(pname)))
            p.grad = None

    def watch_outputs(self, output) -> None:
        """Hook the gradient arriving at the model's outputs: if it is non-finite, the model is innocent."""
        for path, t in _tensors(output):
            if t.requires_grad and (t.is_floating_point() or t.is_complex()):
                self.handles.append(t.register_hook(self.incoming_hook("grad of output" + path)))

    def remove(self) -> None:
        """Remove every hook."""
        for h in self.handles:
            h.remove()

    def report(self, loss_value, loss_finding, backward_ran: bool, bad_params: list[str]) -> NonFiniteReport:
        """The report of this pass."""
        incoming = self.incoming_found[0] if self.incoming_found else None
        return NonFiniteReport(
            forward=self.forward_found[0] if self.forward_found else None,
            backward=incoming if incoming is not None else (self.backward_found[0] if self.backward_found else None),
            loss=loss_value,
            loss_finding=loss_finding,
            nonfinite_parameters=tuple(bad_params),
            forward_offenders=tuple(f.module for f in self.forward_found),
            outputs_checked=self.counts["outputs"],
            gradients_checked=self.counts["grads"],
            backward_ran=backward_ran,
            backward_hooks="module" if self.module_hooks else "output",
            incoming=incoming,
        )


def _loss_of(output, loss_fn) -> Tensor | None:
    """The scalar to backpropagate: ``loss_fn(output)``, else the sum of the output's finite entries."""
    if loss_fn is not None:
        loss = loss_fn(output)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(f"loss_fn must return a scalar tensor, got {getattr(loss, 'shape', type(loss))}")
        return loss.reshape(())
    outs = [t for _, t in _tensors(output) if t.is_floating_point() and t.requires_grad]
    loss = None
    if outs:
        zero = torch.zeros((), dtype=outs[0].dtype, device=outs[0].device)
        loss = sum(torch.where(torch.isfinite(t), t, zero).sum().float() for t in outs)
    return loss


def _run_hooked(model: nn.Module, args, kwargs, loss_fn, probe: _Probe):
    """The forward and the backward pass under the hooks: ``(loss value, loss finding, backward ran)``."""
    loss_value = None
    loss_finding = None
    backward_ran = False
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        output = model(*args, **kwargs)
        probe.watch_outputs(output)
        loss = _loss_of(output, loss_fn)
        if loss is not None and loss.requires_grad:
            loss_value = float(loss.detach())
            loss_finding = _describe(loss.detach(), "loss", "", type(model).__name__, "loss")
            loss.backward()
            backward_ran = True
    return loss_value, loss_finding, backward_ran


def _one_pass(model: nn.Module, args, kwargs, loss_fn, train, *, module_hooks: bool) -> NonFiniteReport:
    """One hooked forward and backward pass; the model (modes, gradients) is left as it was found."""
    probe = _Probe(model, module_hooks)
    modes = {m: m.training for m in model.modules()}
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    saved_grads = {id(p): p.grad for _, p in params}
    leaf_inputs = [t for _, t in _tensors((args, kwargs)) if t.is_leaf and t.requires_grad]
    saved_input_grads = [t.grad for t in leaf_inputs]

    loss_value = None
    loss_finding = None
    backward_ran = False
    bad_params: list[str] = []
    try:
        if train is not None:
            model.train(train)
        probe.install(params)
        for t in leaf_inputs:
            t.grad = None
        loss_value, loss_finding, backward_ran = _run_hooked(model, args, kwargs, loss_fn, probe)
        bad_params = [pname for pname, p in params if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
    finally:
        probe.remove()
        for module, mode in modes.items():
            module.training = mode
        for _, p in params:
            p.grad = saved_grads[id(p)]
        for t, g in zip(leaf_inputs, saved_input_grads):
            t.grad = g
    return probe.report(loss_value, loss_finding, backward_ran, bad_params)


# ----------------------------------------------------------------------------------------------------
# mask_report
# ----------------------------------------------------------------------------------------------------

# What each factor of a mask means, and how a dead row caused by a set of factors reads.
_FACTOR_TEXT = {
    "query_padding": "the query is itself padding",
    "key_padding": "all keys are padding",
    "causal": "causal",
    "context": "empty context (zero-length, or an all-False context_mask)",
    "mask": "the given mask allows no key in this row",
}
_KEY_SIDE = ("key_padding", "context", "mask")
_COMBO_TEXT = {
    ("causal", "key_padding"): "causal + key padding: every real key lies after this query (left padding under a causal mask)",
    ("causal",): "causal: more queries than keys, the first queries see no key",
}


def _reason_text(reason: tuple[str, ...]) -> str:
    if reason in _COMBO_TEXT:
        return _COMBO_TEXT[reason]
    if len(reason) == 1:
        return f"{reason[0]}: {_FACTOR_TEXT[reason[0]]}"
    return " + ".join(reason) + ": only together do these leave no key"


@dataclass(frozen=True)
class DeadRowReport:
    """Dead rows of one attention, per sample, with their computed causes.

    A *reason* is a minimal set of mask factors whose combination alone leaves the row no key
    (e.g. ``("key_padding",)``, or ``("causal", "key_padding")`` for left padding under a causal
    mask). A dead row may have more than one reason (a padded query in a fully padded sample has
    both ``("query_padding",)`` and ``("key_padding",)``).

    Attributes:
        attention: ``"self"``, ``"cross"`` or ``"mask"`` (a combined mask given as is).
        queries: i.
        keys: j.
        dead: ``(b, h, i)`` bool, True at dead rows (``h`` is 1 unless the mask has heads).
        reasons: reason -> ``(b, h, i)`` bool, True at dead rows that this reason explains.
    """

    attention: str
    queries: int
    keys: int
    dead: Tensor
    reasons: dict[tuple[str, ...], Tensor] = field(default_factory=dict)

    @property
    def dead_per_sample(self) -> list[int]:
        """Dead rows per sample (counted over heads too when the mask has heads)."""
        return [int(v) for v in self.dead.flatten(1).sum(1)]

    def reason_counts(self, sample: int) -> dict[tuple[str, ...], int]:
        """``{reason: dead rows it explains}`` for one sample (reasons that explain none are left out)."""
        out = {}
        for reason, where in self.reasons.items():
            n = int(where[sample].sum())
            if n:
                out[reason] = n
        return out

    def __str__(self) -> str:
        b, h = self.dead.shape[:2]
        unit = "rows" if h == 1 else f"(head, row) pairs of {h} heads"
        label = {"self": "self-attention", "cross": "cross-attention"}.get(self.attention, "attention mask")
        lines = [f"{label}: {self.queries} queries x {self.keys} keys; dead {unit} per sample:"]
        for s in range(b):
            n = self.dead_per_sample[s]
            if not n:
                lines.append(f"  sample {s}: 0 dead")
                continue
            rows = self.dead[s].any(0).nonzero().flatten().tolist()
            shown = ", ".join(map(str, rows[:12])) + (" ..." if len(rows) > 12 else "")
            lines.append(f"  sample {s}: {n} dead (rows {shown})")
            for reason, c in self.reason_counts(s).items():
                lines.append(f"    {c:4d}  {_reason_text(reason)}")
        return "\n".join(lines)


@dataclass(frozen=True)
class MaskReport:
    """``mask_report``'s result: one ``DeadRowReport`` per attention described.

    Attributes:
        sections: the reports, self-attention first.
    """

    sections: tuple[DeadRowReport, ...]

    @property
    def dead_per_sample(self) -> list[int]:
        """Dead rows per sample, summed over the sections."""
        totals = None
        for s in self.sections:
            counts = s.dead_per_sample
            totals = counts if totals is None else [a + c for a, c in zip(totals, counts)]
        return totals or []

    def section(self, attention: str) -> DeadRowReport:
        """The section for ``"self"``, ``"cross"`` or ``"mask"``."""
        for s in self.sections:
            if s.attention == attention:
                return s
        raise KeyError(f"no {attention!r} section in this report (have {[s.attention for s in self.sections]})")

    def __str__(self) -> str:
        return "\n".join(str(s) for s in self.sections)

    __repr__ = __str__


def _explain(factors: dict[str, Tensor], b: int, h: int, i: int, j: int) -> DeadRowReport:
    """Dead rows of the AND of ``factors`` (each broadcastable to ``(b, h, i, j)``) and their reasons."""
    j_out = j
    if j == 0:
        # No key at all: give every factor one virtual key that only the key-side factors (the ones
        # whose emptiness this is) hide, so that "query_padding" is not blamed for an empty key set.
        factors = {
            k: (torch.full((*v.shape[:-1], 1), k not in _KEY_SIDE, dtype=torch.bool, device=v.device) if v.shape[-1] == 0 else v)
            for k, v in factors.items()
        }
        j = 1
    full = {k: v.expand(b, h, i, j) for k, v in factors.items()}
    device = next(iter(full.values())).device
    combined = torch.ones(b, h, i, j, dtype=torch.bool, device=device)
    for v in full.values():
        combined = combined & v
    dead = ~combined.any(-1)  # (b, h, i)
    reasons: dict[tuple[str, ...], Tensor] = {}
    names = sorted(full)
    for size in range(1, len(names) + 1):  # minimal sets first: singletons, then pairs, ...
        for combo in itertools.combinations(names, size):
            part = torch.ones(b, h, i, j, dtype=torch.bool, device=device)
            for k in combo:
                part = part & full[k]
            kills = ~part.any(-1)
            # minimal: no smaller reason already kills this row
            smaller = torch.zeros_like(dead)
            for r, where in reasons.items():
                if set(r) < set(combo):
                    smaller |= where
            where = dead & kills & ~smaller
            if bool(where.any()):
                reasons[combo] = where
    return DeadRowReport(attention="", queries=i, keys=j_out, dead=dead, reasons=reasons)


def _as_4d(mask: Tensor) -> Tensor:
    if mask.dim() == 2:
        return mask[None, None]
    if mask.dim() == 3:
        return mask[:, None]
    if mask.dim() == 4:
        return mask
    raise ValueError(f"mask must have shape (i, j), (b, i, j) or (b, 1|h, i, j), got {tuple(mask.shape)}")


def mask_report(
    mask: Tensor | None = None,
    *,
    padding_mask: Tensor | None = None,
    causal: bool = False,
    context_mask: Tensor | None = None,
    context_length: int | None = None,
) -> MaskReport:
    """Count dead rows per sample and say why each row is dead.

    Give either a combined attention ``mask`` (its dead rows are reported with the reason ``mask``),
    or the parts a model combines, so that the causes can be computed:

    - self-attention: ``padding_mask (b, n)`` (True = real token) and/or ``causal``. A row is dead if
      the query is itself padding, if all keys are padding (a fully padded sample), or if causal
      masking hides every real key (left padding under a causal mask).
    - cross-attention: ``context_mask (b, j)`` and/or ``context_length`` (``0`` = zero-length
      context). Rows are dead where the context is empty; padded queries (``padding_mask``) are
      dead there too.

    ``mask`` may be combined with the parts: it is then one more factor (``"mask"``) of the
    self-attention (its ``i`` and ``j`` must match ``n``).

    Args:
        mask: bool ``(i, j)``, ``(b, i, j)`` or ``(b, 1|h, i, j)``, True = may attend.
        padding_mask: bool ``(b, n)``, True = real position (queries and keys of self-attention,
            queries of cross-attention).
        causal: the self-attention is causal (bottom-right aligned, as in safeformer).
        context_mask: bool ``(b, j)``, True = real context position.
        context_length: ``j`` when no ``context_mask`` is given (every position real).

    Returns:
        a ``MaskReport`` with a section per attention described (``"self"`` or ``"mask"``, and
        ``"cross"``).

    Raises:
        TypeError: a mask is not a bool tensor.
        ValueError: shapes disagree, or nothing was given.
    """
    _check_report_args(mask, padding_mask, causal, context_mask, context_length)
    sections = []
    m4 = None
    if mask is not None:
        validate_mask(mask, "mask")
        m4 = _as_4d(mask)
    if mask is not None or causal or padding_mask is not None:
        sections.append(_self_section(mask, m4, padding_mask, causal))
    if context_mask is not None or context_length is not None:
        sections.append(_cross_section(m4, padding_mask, context_mask, context_length))
    return MaskReport(tuple(sections))


def _check_report_args(mask, padding_mask, causal, context_mask, context_length) -> None:
    """``mask_report``'s arguments: something given, the parts' shapes agreeing."""
    if mask is None and padding_mask is None and not causal and context_mask is None and context_length is None:
        raise ValueError("mask_report needs a mask, or the parts: padding_mask, causal, context_mask/context_length")
    if padding_mask is not None:
        validate_mask(padding_mask, "padding_mask")
        if padding_mask.dim() != 2:
            raise ValueError(f"padding_mask must have shape (b, n), got {tuple(padding_mask.shape)}")
    if context_mask is not None:
        validate_mask(context_mask, "context_mask")
        if context_mask.dim() != 2:
            raise ValueError(f"context_mask must have shape (b, j), got {tuple(context_mask.shape)}")
        if context_length is not None and context_length != context_mask.shape[1]:
            raise ValueError(f"context_length={context_length} disagrees with context_mask of shape {tuple(context_mask.shape)}")
        if padding_mask is not None and padding_mask.shape[0] != context_mask.shape[0]:
            raise ValueError(
                f"padding_mask {tuple(padding_mask.shape)} and context_mask {tuple(context_mask.shape)} disagree on b"
            )
    if context_length is not None and (not isinstance(context_length, int) or context_length < 0):
        raise ValueError(f"context_length must be a non-negative int, got {context_length!r}")


def _self_section(mask: Tensor | None, m4: Tensor | None, padding_mask: Tensor | None, causal: bool) -> DeadRowReport:
    """The self-attention section (``"mask"`` when the given mask is its only factor)."""
    factors: dict[str, Tensor] = {}
    if m4 is not None:
        _, h, i, j = m4.shape
        b = m4.shape[0] if padding_mask is None else padding_mask.shape[0]
        if padding_mask is not None and (padding_mask.shape[1] != i or padding_mask.shape[1] != j):
            raise ValueError(f"mask {tuple(mask.shape)} and padding_mask {tuple(padding_mask.shape)} disagree on n")
        if m4.shape[0] not in (1, b):
            raise ValueError(f"mask {tuple(mask.shape)} and padding_mask {tuple(padding_mask.shape)} disagree on b")
        factors["mask"] = m4
    elif padding_mask is not None:
        b, i = padding_mask.shape
        h, j = 1, i
    else:
        raise ValueError("causal=True needs padding_mask (b, n) or mask to know the shape")
    if padding_mask is not None:
        factors["query_padding"] = padding_mask[:, None, :, None]
        factors["key_padding"] = padding_mask[:, None, None, :]
    if causal:
        factors["causal"] = causal_mask(i, j, device=(m4 if m4 is not None else padding_mask).device)
    rep = _explain(factors, b, h, i, j)
    return DeadRowReport("mask" if set(factors) == {"mask"} else "self", i, j, rep.dead, rep.reasons)


def _cross_section(m4: Tensor | None, padding_mask: Tensor | None, context_mask: Tensor | None,
                   context_length: int | None) -> DeadRowReport:
    """The cross-attention section (a ``context_length`` alone: every context position real)."""
    if context_mask is None:
        b = padding_mask.shape[0] if padding_mask is not None else (m4.shape[0] if m4 is not None else 1)
        device = padding_mask.device if padding_mask is not None else None
        context_mask = torch.ones(b, context_length, dtype=torch.bool, device=device)
    b, j = context_mask.shape
    i = padding_mask.shape[1] if padding_mask is not None else 1
    factors = {"context": context_mask[:, None, None, :]}
    if padding_mask is not None:
        factors["query_padding"] = padding_mask[:, None, :, None]
    rep = _explain(factors, b, 1, i, j)
    return DeadRowReport("cross", i, j, rep.dead, rep.reasons)


# ----------------------------------------------------------------------------------------------------
# plot_mask
# ----------------------------------------------------------------------------------------------------


def plot_mask(
    mask: Tensor,
    path: str | Path,
    *,
    sample: int = 0,
    head: int = 0,
    title: str | None = None,
) -> Path:
    """Write a PNG of an ``(i, j)`` mask with its dead rows highlighted.

    Allowed entries are drawn dark, masked ones light; a dead row (no allowed key) is drawn red and
    marked on the left. Needs matplotlib (imported here only).

    Args:
        mask: bool ``(i, j)``, ``(b, i, j)`` or ``(b, h, i, j)``, True = may attend.
        path: where to write the PNG.
        sample: which sample to draw when the mask has a batch dim.
        head: which head to draw when the mask has a head dim.
        title: the figure title (default: the shape and dead-row count).

    Returns:
        the path written.

    Raises:
        TypeError: ``mask`` is not a bool tensor.
        ValueError: wrong number of dims, or ``sample``/``head`` out of range.
        ImportError: matplotlib is not installed.
    """
    validate_mask(mask, "mask")
    m = mask.detach().cpu()
    if m.dim() == 4:
        if not 0 <= head < m.shape[1]:
            raise ValueError(f"head={head} out of range for mask of shape {tuple(mask.shape)}")
        m = m[:, head]
    if m.dim() == 3:
        if not 0 <= sample < m.shape[0]:
            raise ValueError(f"sample={sample} out of range for mask of shape {tuple(mask.shape)}")
        m = m[sample]
    if m.dim() != 2:
        raise ValueError(f"mask must have shape (i, j), (b, i, j) or (b, h, i, j), got {tuple(mask.shape)}")
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("plot_mask needs matplotlib: pip install matplotlib") from err

    i, j = m.shape
    dead = ~m.any(-1) if j else torch.ones(i, dtype=torch.bool)
    # 0 = masked, 1 = allowed, 2 = dead row
    img = m.long()
    img[dead] = 2
    cmap = ListedColormap(["#f2f2f2", "#1f3b73", "#d62728"])
    fig, ax = plt.subplots(figsize=(max(3.0, 0.3 * j + 1.5), max(2.5, 0.3 * i + 1.2)))
    try:
        if j:
            ax.imshow(img.numpy(), cmap=cmap, vmin=0, vmax=2, interpolation="nearest", aspect="auto")
        for r in dead.nonzero().flatten().tolist():
            ax.annotate("dead", xy=(-0.5, r), xytext=(-1.2, r), ha="right", va="center", color="#d62728", fontsize=8,
                        annotation_clip=False)
        ax.set_xlabel("key j")
        ax.set_ylabel("query i")
        ax.set_title(title if title is not None else f"mask ({i}, {j}): {int(dead.sum())} dead row(s)")
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)
    return out
