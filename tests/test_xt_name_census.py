"""The name census: every public name of every x-transformers module is at safeformer's module of the same path,
or listed in ``safeformer.core.xt_helpers.NOT_PROVIDED`` with its reason. The helpers provided give x-transformers'
results on the same inputs (seeded for the random ones) and check their arguments; ``top_k`` takes
x-transformers' argument order."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch

import safeformer as sf
import safeformer.core.xt_helpers as xh
import safeformer.x_transformers as sfx
from safeformer.core.xt_helpers import NOT_PROVIDED

xt = pytest.importorskip("x_transformers")


def _xt_modules() -> list[str]:
    return ["x_transformers"] + [f"x_transformers.{m.name}" for m in pkgutil.iter_modules(xt.__path__)]


def _public_names(path: str) -> list[str]:
    mod = importlib.import_module(path)
    if path == "x_transformers":
        return sorted(n for n, v in vars(mod).items() if not n.startswith("_") and not inspect.ismodule(v))
    # classes and functions defined in the module or imported into it from another x-transformers module (users
    # import those from either path: ``from x_transformers.x_transformers import Attend``)
    return sorted(n for n, v in vars(mod).items() if not n.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v))
                  and str(getattr(v, "__module__", None)).startswith("x_transformers"))


def _safeformer_module(path: str):
    try:
        return importlib.import_module("safeformer" + path[len("x_transformers"):])
    except ModuleNotFoundError:
        return None


def census() -> tuple[list[str], list[str], list[str]]:
    """``(provided, listed as not provided, missing and unlisted)``, as ``module.name`` keys."""
    provided, listed, missing = [], [], []
    for path in _xt_modules():
        mod = _safeformer_module(path)
        for name in _public_names(path):
            key = f"{path}.{name}"
            if mod is not None and hasattr(mod, name):
                provided.append(key)
            elif key in NOT_PROVIDED or (mod is None and path in NOT_PROVIDED):
                listed.append(key)
            else:
                missing.append(key)
    return provided, listed, missing


def test_every_x_transformers_name_is_provided_or_listed_with_a_reason():
    _, _, missing = census()
    assert not missing, f"x-transformers names neither provided nor in xt_helpers.NOT_PROVIDED: {missing}"


def test_no_stale_or_reasonless_entries():
    paths = set(_xt_modules())
    stale = []
    for key, reason in NOT_PROVIDED.items():
        assert isinstance(reason, str) and len(reason) > 10, f"NOT_PROVIDED[{key!r}] has no reason"
        if key in paths:  # a whole module
            if _safeformer_module(key) is not None:
                stale.append(key)
            continue
        path, name = key.rsplit(".", 1)
        assert path in paths, f"NOT_PROVIDED[{key!r}]: no x-transformers module {path}"
        assert name in _public_names(path), f"NOT_PROVIDED[{key!r}]: x-transformers' {path} has no {name}"
        mod = _safeformer_module(path)
        if mod is not None and hasattr(mod, name):
            stale.append(key)
    assert not stale, f"NOT_PROVIDED entries that are now provided (remove them): {stale}"


def _xt_fn(path: str, name: str):
    return getattr(importlib.import_module(path), name)


def _sf_fn(path: str, name: str):
    return getattr(_safeformer_module(path), name)


def _same(a, b, what: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all()), what
    else:
        assert a == b and type(a) is type(b), what


# ----------------------------------------------------------------------------------------------------
# parity of the helpers provided, at every x-transformers path they are re-exported at
# ----------------------------------------------------------------------------------------------------

_X = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
_P = torch.rand(3, 8, generator=torch.Generator().manual_seed(1))
_P[0, :3] = 0.0

PLAIN_CASES = {  # name -> list of (args, kwargs)
    "exists": [((None,), {}), ((0,), {})],
    "identity": [((5, 1), {"a": 2})],
    "first": [(([3, 4],), {}), (([],), {"default": 7})],
    "is_empty": [(([],), {}), (([1],), {})],
    "cast_tuple": [((1,), {}), ((1, 3), {}), (((1, 2), 3), {}), (([1], 2), {})],
    "divisible_by": [((6, 3), {}), ((7, 3), {})],
    "join": [((["a", "b"],), {}), ((["a", "b"], "-"), {})],
    "at_most_one_of": [((True, False, False), {}), ((True, True), {})],
    "compact": [(([1, None, 2],), {})],
    "or_reduce": [(([torch.tensor([True, False]), torch.tensor([False, False])],), {})],
    "maybe_and_mask": [((None, torch.tensor([True, False]), torch.tensor([True, True])), {}), ((None,), {})],
    "string_begins_with": [(("ab", "abc"), {}), (("b", "abc"), {})],
    "group_dict_by_key": [((lambda k: k > 1, {1: "a", 2: "b"}), {})],
    "group_by_key_prefix": [(("x_", {"x_a": 1, "b": 2}), {})],
    "groupby_prefix_and_trim": [(("x_", {"x_a": 1, "b": 2}), {})],
    "linear_schedule": [((0.25,), {})],
    "cosine_schedule": [((torch.linspace(0, 1, 5),), {})],
    "log": [((_P,), {}), ((_P, 1e-3), {})],
    "max_neg_value": [((_X,), {}), ((_X.half(),), {})],
    "l2norm": [((_X,), {}), ((_X, 2), {}), ((torch.zeros(2, 4),), {})],
    "l1norm": [((_X,), {}), ((_X, 0), {})],
    "softclamp": [((_X * 10, 5.0), {})],
    "pad_at_dim": [((_X, (1, 2)), {}), ((_X, (2, 0), 0, 3.0), {}), ((_X, (0, 0)), {}), ((_X, (1, -1)), {"dim": -1})],
    "align_right": [((torch.arange(12).view(3, 4), torch.tensor([2, 4, 0])), {}),
                    ((torch.arange(12).view(3, 4), torch.tensor([1, 3, 4]), -1), {})],
    "rotate_half": [((_X,), {})],
    "transpose": [((_X,), {})],
}
PLAIN_CASES["default"] = [((None, 3), {}), ((2, 3), {}), ((None, lambda: 4), {})]

SEEDED = {"gumbel_noise": [((_X,), {})],
          "gumbel_sample": [((_X,), {}), ((_X, 0.5), {}), ((_X, 0.0), {})]}


def _provided_pairs(names) -> list[tuple[str, str]]:
    pairs = []
    for path in _xt_modules():
        mod = _safeformer_module(path)
        for name in _public_names(path):
            if name in names and mod is not None and hasattr(mod, name):
                pairs.append((path, name))
    return pairs


@pytest.mark.parametrize("path,name", _provided_pairs(PLAIN_CASES), ids=lambda v: v)
def test_helper_gives_x_transformers_result(path, name):
    for args, kwargs in PLAIN_CASES[name]:
        try:
            want = _xt_fn(path, name)(*args, **kwargs)
        except Exception:  # x-transformers fails on this input (e.g. a tuple-only cast): skip the case
            continue
        _same(_sf_fn(path, name)(*args, **kwargs), want, f"{path}.{name}{args}")


@pytest.mark.parametrize("path,name", _provided_pairs({"default"}), ids=lambda v: v)
def test_default_keeps_each_modules_meaning(path, name):
    d = lambda: 4  # noqa: E731
    want, got = _xt_fn(path, name)(None, d), _sf_fn(path, name)(None, d)
    assert (want is d) == (got is d) and (want == 4) == (got == 4)
    lin = torch.nn.Linear(1, 1)

    def outcome(fn):
        try:
            return fn(None, lin) is lin
        except TypeError:  # a module called with no input, as x-transformers' own default does there
            return "TypeError"

    assert outcome(_xt_fn(path, name)) == outcome(_sf_fn(path, name))


@pytest.mark.parametrize("path,name", _provided_pairs(SEEDED), ids=lambda v: v)
def test_random_helper_gives_x_transformers_result_seeded(path, name):
    for args, kwargs in SEEDED[name]:
        torch.manual_seed(3)
        want = _xt_fn(path, name)(*args, **kwargs)
        torch.manual_seed(3)
        _same(_sf_fn(path, name)(*args, **kwargs), want, f"{path}.{name}")


def test_nonautoregressive_helpers_as_x_transformers():
    from x_transformers import nonautoregressive_wrapper as xnar

    from safeformer import nonautoregressive_wrapper as snar
    _same(snar.log(_P), xnar.log(_P), "log")
    _same(snar.log(_P, 1e-3), xnar.log(_P, 1e-3), "log eps")
    t = torch.linspace(0, 1, 7)
    _same(snar.cosine_schedule(t), xnar.cosine_schedule(t), "cosine_schedule")
    assert snar.linear_schedule(0.3) == xnar.linear_schedule(0.3)
    import random
    random.seed(5)
    want = [xnar.coin_flip() for _ in range(8)] + [xnar.sample_prob(0.3) for _ in range(8)]
    random.seed(5)
    assert [snar.coin_flip() for _ in range(8)] + [snar.sample_prob(0.3) for _ in range(8)] == want


def test_x_transformers_module_small_callables():
    from x_transformers import x_transformers as xx
    for name, args in (("always", (3,)), ("not_equals", (3,)), ("equals", (3,))):
        assert getattr(sfx, name)(*args)(3) == getattr(xx, name)(*args)(3)
        assert getattr(sfx, name)(*args)(4) == getattr(xx, name)(*args)(4)
    assert sfx.maybe(lambda x: x + 1)(None) is None and sfx.maybe(lambda x: x + 1)(2) == 3
    assert sfx.maybe()(5) == xx.maybe()(5)
    d1, d2 = {"a": 1, "b": 2}, {"a": 1, "b": 2}
    assert sfx.pick_and_pop(["a"], d1) == xx.pick_and_pop(["a"], d2) and d1 == d2
    assert sfx.default(None, None, lambda: 3) == xx.default(None, None, lambda: 3) == 3
    assert sfx.default(None, None) is xx.default(None, None) is None


# ----------------------------------------------------------------------------------------------------
# clamps where x-transformers' helper gives NaN or inf, and clear argument errors
# ----------------------------------------------------------------------------------------------------


def test_logs_and_gumbel_noise_are_finite_where_x_transformers_are_not():
    from safeformer import nonautoregressive_wrapper as snar
    zero_h = torch.zeros(4, dtype=torch.float16)
    assert torch.isinf(xt.autoregressive_wrapper.log(zero_h)).all()  # 1e-20 rounds to 0 in float16
    assert torch.isfinite(sf.autoregressive_wrapper.log(zero_h)).all()
    assert torch.isfinite(xh.log(torch.zeros(3), eps=0.0)).all()
    assert torch.isfinite(snar.log(torch.tensor([-1.0, 0.0]))).all()  # x-transformers: NaN for -1
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        assert torch.isfinite(xh.gumbel_noise(torch.zeros(20000, dtype=dtype))).all()
        assert torch.isfinite(xh.gumbel_noise_uniform(torch.zeros(20000, dtype=dtype))).all()


@pytest.mark.parametrize("call,exc,text", [
    (lambda: xh.log([1.0]), TypeError, "t"),
    (lambda: xh.log(torch.ones(2, dtype=torch.long)), TypeError, "t"),
    (lambda: xh.log(torch.ones(2), eps=-1.0), ValueError, "eps"),
    (lambda: xh.l2norm(torch.ones(2, 5), groups=2), ValueError, "groups"),
    (lambda: xh.softclamp(torch.ones(2), 0.0), ValueError, "value"),
    (lambda: xh.softclamp(torch.ones(2), True), TypeError, "value"),
    (lambda: xh.pad_at_dim(torch.ones(2), (1,)), TypeError, "pad"),
    (lambda: xh.pad_at_dim(torch.ones(2), (1, 1), dim=3), ValueError, "dim"),
    (lambda: xh.gumbel_sample(torch.full((2, 3), float("-inf"))), ValueError, "logits"),
    (lambda: xh.gumbel_sample(torch.tensor([[0.0, float("nan")]])), ValueError, "logits"),
    (lambda: xh.gumbel_sample(torch.ones(2, 3), temperature=-1.0), ValueError, "temperature"),
    (lambda: xh.gumbel_sample_dim(torch.ones(2, 3), dim=2), ValueError, "dim"),
    (lambda: xh.align_right(torch.ones(2, 3), torch.tensor([1, 4])), ValueError, "lens"),
    (lambda: xh.align_right(torch.ones(2, 3), torch.tensor([1.0, 2.0])), TypeError, "lens"),
    (lambda: xh.rotate_half(torch.ones(2, 3)), ValueError, "x"),
    (lambda: xh.max_neg_value(torch.ones(2, dtype=torch.long)), TypeError, "tensor"),
    (lambda: xh.or_reduce([]), ValueError, "masks"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_tensor_helpers_refuse_bad_arguments_by_name(call, exc, text):
    with pytest.raises(exc, match=text):
        call()


# ----------------------------------------------------------------------------------------------------
# top_k takes x-transformers' argument order
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args,kwargs", [((0.5,), {}), ((0.25, 3), {}), ((0.1,), {"k": 5}), ((1.0,), {})], ids=str)
def test_top_k_positional_as_x_transformers(args, kwargs):
    x = torch.randn(4, 37, generator=torch.Generator().manual_seed(2))
    want = xt.autoregressive_wrapper.top_k(x, *args, **kwargs)
    _same(sf.top_k(x, *args, **kwargs), want, f"top_k{args}{kwargs}")
    _same(sf.autoregressive_wrapper.top_k(x, *args, **kwargs), want, "at x-transformers' path")


@pytest.mark.parametrize("second", [3, 1, True])
def test_top_k_refuses_a_count_in_frac_num_tokens_place(second):
    with pytest.raises(TypeError, match="frac_num_tokens is a fraction in \\(0, 1\\]"):
        sf.top_k(torch.randn(2, 9), second)


def test_top_k_signature_is_x_transformers():
    got = inspect.signature(sf.top_k).parameters
    want = inspect.signature(xt.autoregressive_wrapper.top_k).parameters
    assert [(p.name, p.default, p.kind) for p in got.values()] == [(p.name, p.default, p.kind) for p in want.values()]


def test_census_counts_printed():
    provided, listed, missing = census()
    print(f"x-transformers names: {len(provided) + len(listed) + len(missing)}, provided {len(provided)}, "
          f"not provided (listed) {len(listed)}, unlisted {len(missing)}")
