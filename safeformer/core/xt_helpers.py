"""x-transformers' small helper functions, re-exported at x-transformers' module paths.

x-transformers defines a helper again in each module, sometimes with a different meaning under the same name
(``default(val, d)`` in most modules, ``default(*args)`` calling a callable in ``x_transformers.x_transformers``;
``log(t, eps=1e-20)`` clamps, the non-autoregressive ``log(t, eps=1e-10)`` adds). Each meaning is one function
here; the thin modules (``safeformer.x_transformers``, ``safeformer.autoregressive_wrapper``, ...) import the
one of their x-transformers module under x-transformers' name.

Helpers that take tensors check them (a ``TypeError`` or ``ValueError`` naming the argument). Where
x-transformers' helper gives NaN or inf from finite input, these clamp instead (each docstring says where):
the logs clamp at ``max(eps, the dtype's smallest normal)`` (float16 underflows x-transformers' ``1e-20`` to 0),
so the Gumbel noise built on them is finite in every floating dtype. Otherwise the numbers are x-transformers'
(``tests/test_xt_name_census.py``). Names of x-transformers' modules not provided are listed in
``NOT_PROVIDED`` with the reason.
"""

from __future__ import annotations

import math
from functools import wraps
from random import random

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "exists", "default", "default_lazy", "default_lazy_unless_module", "default_first", "identity", "first",
    "first_of_iter", "is_empty", "cast_tuple", "cast_tuple_depth", "divisible_by", "join", "at_most_one_of",
    "compact", "maybe", "always", "not_equals", "equals", "or_reduce", "maybe_and_mask", "pick_and_pop",
    "group_dict_by_key", "string_begins_with", "group_by_key_prefix", "groupby_prefix_and_trim", "sample_prob",
    "coin_flip", "linear_schedule", "cosine_schedule", "log", "log_add_eps", "max_neg_value", "l2norm",
    "l2norm_dim", "l1norm", "softclamp", "gumbel_noise", "gumbel_sample", "gumbel_noise_uniform",
    "gumbel_sample_dim", "pad_at_dim", "align_right", "rotate_half", "transpose", "NOT_PROVIDED",
]


# ----------------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------------


def _float_tensor(t, name: str, fn: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: {name} must be a tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{fn}: {name} must be a floating-point tensor, got dtype {t.dtype}")


def _number(v, name: str, fn: str, *, positive: bool = False, nonneg: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise TypeError(f"{fn}: {name} must be a finite real number, got {v!r}")
    if positive and not v > 0:
        raise ValueError(f"{fn}: {name} must be > 0, got {v!r}")
    if nonneg and not v >= 0:
        raise ValueError(f"{fn}: {name} must be >= 0, got {v!r}")
    return v


def _int(v, name: str, fn: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{fn}: {name} must be an int, got {v!r}")
    return v


def _dim(t: Tensor, dim, name: str, fn: str) -> int:
    _int(dim, name, fn)
    if not -t.ndim <= dim < t.ndim:
        raise ValueError(f"{fn}: {name}={dim} is out of range for a tensor of {t.ndim} dims")
    return dim


def _check_sample_logits(logits: Tensor, dim: int, fn: str, name: str) -> None:
    """A row with nothing to draw (all ``-inf``) or holding NaN would silently give a meaningless index."""
    if logits.shape[dim] == 0:
        raise ValueError(f"{fn}: {name} has no entry along dim {dim}")
    bad = torch.isnan(logits).any() | torch.isneginf(logits).all(dim).any()
    if bool(bad):
        raise ValueError(f"{fn}: {name} holds NaN or a row of all -inf (nothing to draw)")


# ----------------------------------------------------------------------------------------------------
# plain helpers (no tensors)
# ----------------------------------------------------------------------------------------------------


def exists(val) -> bool:
    """``val is not None``."""
    return val is not None


def default(val, d):
    """``val`` unless it is ``None``, else ``d`` (most of x-transformers' modules)."""
    return val if exists(val) else d


def default_lazy(val, d):
    """``val`` unless ``None``, else ``d()`` when ``d`` is callable, else ``d`` (``multi_input``, ``xval``)."""
    if exists(val):
        return val
    return d() if callable(d) else d


def default_lazy_unless_module(val, d):
    """As ``default_lazy``, but an ``nn.Module`` ``d`` is returned, not called (``continuous``)."""
    if exists(val):
        return val
    return d() if not isinstance(d, nn.Module) and callable(d) else d


def default_first(*args):
    """The first argument that is not ``None`` (called when callable), else ``None``
    (``x_transformers.x_transformers.default``)."""
    for arg in args:
        if exists(arg):
            return arg() if callable(arg) else arg
    return None


def identity(t, *args, **kwargs):
    """``t`` (other arguments ignored)."""
    return t


def first(it, default=None):
    """``it[0]``, or ``default`` when ``it`` is empty."""
    return it[0] if len(it) > 0 else default


def first_of_iter(it, default=None):
    """The first item of the iterable ``it``, or ``default`` (``xl_autoregressive_wrapper.first``)."""
    return next(iter(it), default)


def is_empty(x) -> bool:
    """``len(x) == 0``."""
    return len(x) == 0


def cast_tuple(t, length=1):
    """``t`` if a tuple, else ``(t,) * length``."""
    return t if isinstance(t, tuple) else (t,) * length


def cast_tuple_depth(val, depth=1):
    """``val`` if a tuple, else ``(val,) * depth`` (``x_transformers.x_transformers.cast_tuple``)."""
    return val if isinstance(val, tuple) else (val,) * depth


def divisible_by(num, den) -> bool:
    """``num % den == 0``."""
    return (num % den) == 0


def join(arr, delimiter=", ") -> str:
    """``delimiter.join(arr)``."""
    return delimiter.join(arr)


def at_most_one_of(*bools) -> bool:
    """True when at most one argument is true."""
    return sum(map(int, bools)) <= 1


def compact(arr) -> list:
    """The items of ``arr`` that are not ``None``."""
    return [*filter(exists, arr)]


def maybe(fn=None):
    """``fn`` made to pass ``None`` through unchanged (``identity`` when ``fn`` is ``None``)."""
    if not exists(fn):
        fn = identity

    @wraps(fn)
    def inner(x, *args, **kwargs):
        if not exists(x):
            return x
        return fn(x, *args, **kwargs)

    return inner


class always:
    """A callable that returns ``val`` whatever it is given."""

    def __init__(self, val):
        self.val = val

    def __call__(self, *args, **kwargs):
        return self.val


class not_equals:
    """A callable ``x -> x != val``."""

    def __init__(self, val):
        self.val = val

    def __call__(self, x, *args, **kwargs):
        return x != self.val


class equals:
    """A callable ``x -> x == val``."""

    def __init__(self, val):
        self.val = val

    def __call__(self, x, *args, **kwargs):
        return x == self.val


def or_reduce(masks):
    """The elementwise or of a non-empty sequence of masks."""
    if len(masks) == 0:
        raise ValueError("or_reduce: masks must not be empty")
    head, *body = masks
    for rest in body:
        head = head | rest
    return head


def maybe_and_mask(*masks):
    """The elementwise and of the masks that are not ``None`` (``None`` when none is given)."""
    masks = compact(masks)
    if len(masks) == 0:
        return None
    mask, *rest = masks
    for m in rest:
        mask = mask & m
    return mask


def pick_and_pop(keys, d: dict) -> dict:
    """``{key: d.pop(key)}`` for each key (``d`` loses them)."""
    values = tuple(d.pop(key) for key in keys)
    return dict(zip(keys, values))


def group_dict_by_key(cond, d: dict):
    """``(matching, other)``: ``d``'s items split by ``cond(key)``."""
    out = [{}, {}]
    for key in d.keys():
        out[int(not bool(cond(key)))][key] = d[key]
    return (*out,)


def string_begins_with(prefix: str, s: str) -> bool:
    """``s.startswith(prefix)``."""
    return s.startswith(prefix)


def group_by_key_prefix(prefix: str, d: dict):
    """``d`` split into the items whose key starts with ``prefix`` and the rest."""
    return group_dict_by_key(lambda key: string_begins_with(prefix, key), d)


def groupby_prefix_and_trim(prefix: str, d: dict):
    """``(items with the prefix, the prefix cut from their keys; the other items)``."""
    with_prefix, rest = group_dict_by_key(lambda key: string_begins_with(prefix, key), d)
    trimmed = {key[len(prefix):]: value for key, value in with_prefix.items()}
    return trimmed, rest


def sample_prob(prob) -> bool:
    """True with probability ``prob`` (Python's ``random``)."""
    return random() < prob


def coin_flip() -> bool:
    """``sample_prob(0.5)``."""
    return sample_prob(0.5)


def linear_schedule(t):
    """``1 - t``."""
    return 1 - t


def cosine_schedule(t: Tensor) -> Tensor:
    """``cos(t * pi / 2)`` of a tensor ``t``."""
    _float_tensor(t, "t", "cosine_schedule")
    return torch.cos(t * math.pi / 2)


# ----------------------------------------------------------------------------------------------------
# tensor helpers
# ----------------------------------------------------------------------------------------------------


def log(t: Tensor, eps: float = 1e-20) -> Tensor:
    """``log(t.clamp(min=eps))``. Differs from x-transformers only where it gives ``-inf``: the floor is
    ``max(eps, smallest normal of t's dtype)`` (float16 rounds ``1e-20`` to 0), so the result is finite;
    ``eps`` must be >= 0."""
    _float_tensor(t, "t", "log")
    _number(eps, "eps", "log", nonneg=True)
    return t.clamp(min=max(eps, torch.finfo(t.dtype).tiny)).log()


def log_add_eps(t: Tensor, eps: float = 1e-10) -> Tensor:
    """``log(t + eps)`` (``nonautoregressive_wrapper.log``). x-transformers' gives NaN for ``t < -eps`` and
    ``-inf`` where ``t + eps`` rounds to 0; here ``t + eps`` is clamped at the dtype's smallest normal (no
    change for ``t >= 0`` in float32, bfloat16 and float64)."""
    _float_tensor(t, "t", "log")
    _number(eps, "eps", "log", nonneg=True)
    return (t + eps).clamp(min=torch.finfo(t.dtype).tiny).log()


def max_neg_value(tensor: Tensor) -> float:
    """``-finfo(tensor.dtype).max``."""
    _float_tensor(tensor, "tensor", "max_neg_value")
    return -torch.finfo(tensor.dtype).max


def l2norm(t: Tensor, groups: int = 1) -> Tensor:
    """Unit L2 norm over each of ``groups`` equal slices of the last dim (a zero slice stays 0)."""
    _float_tensor(t, "t", "l2norm")
    _int(groups, "groups", "l2norm")
    if t.ndim == 0 or groups < 1 or t.shape[-1] % groups:
        raise ValueError(f"l2norm: groups={groups} must be >= 1 and divide the last dim of t {tuple(t.shape)}")
    g = t.unflatten(-1, (groups, t.shape[-1] // groups))
    return F.normalize(g, p=2, dim=-1).flatten(-2)


def l2norm_dim(t: Tensor, dim: int = -1) -> Tensor:
    """Unit L2 norm along ``dim`` (``next_latent_wrapper.l2norm``; a zero vector stays 0)."""
    _float_tensor(t, "t", "l2norm")
    _dim(t, dim, "dim", "l2norm")
    return F.normalize(t, p=2, dim=dim)


def l1norm(t: Tensor, dim: int = -1, eps: float = 1e-8) -> Tensor:
    """Unit L1 norm along ``dim``, ``eps`` the smallest denominator (``attend.l1norm``)."""
    _float_tensor(t, "t", "l1norm")
    _dim(t, dim, "dim", "l1norm")
    _number(eps, "eps", "l1norm", positive=True)
    return F.normalize(t, p=1, dim=dim, eps=eps)


def softclamp(t: Tensor, value: float) -> Tensor:
    """``tanh(t / value) * value``; ``value`` must be > 0 (0 gives NaN in x-transformers)."""
    _float_tensor(t, "t", "softclamp")
    _number(value, "value", "softclamp", positive=True)
    return (t / value).tanh() * value


def gumbel_noise(t: Tensor) -> Tensor:
    """Gumbel(0, 1) noise of ``t``'s shape, ``-log(-log(u))``, ``u = rand_like(t)``, with ``log`` above:
    finite in every floating dtype (x-transformers' is ``-inf`` for ``u = 0`` in float16)."""
    _float_tensor(t, "t", "gumbel_noise")
    return -log(-log(torch.rand_like(t)))


def gumbel_sample(logits: Tensor, temperature: float = 1.0, eps: float = 1e-6) -> Tensor:
    """``argmax(logits / max(temperature, eps) + gumbel_noise(logits))`` over the last dim. A row of all
    ``-inf`` or a NaN is a ``ValueError`` (x-transformers returns an index; one host sync)."""
    _float_tensor(logits, "logits", "gumbel_sample")
    if logits.ndim == 0:
        raise ValueError("gumbel_sample: logits must have at least 1 dim")
    _number(temperature, "temperature", "gumbel_sample", nonneg=True)
    _number(eps, "eps", "gumbel_sample", positive=True)
    _check_sample_logits(logits, -1, "gumbel_sample", "logits")
    noise = gumbel_noise(logits)
    return ((logits / max(temperature, eps)) + noise).argmax(dim=-1)


def gumbel_noise_uniform(t: Tensor) -> Tensor:
    """``nonautoregressive_wrapper.gumbel_noise``: ``u`` from ``uniform_(0, 1)``, logs by ``log_add_eps``
    (finite in every floating dtype; x-transformers' is ``+inf`` where ``u`` rounds to 1 in float16)."""
    _float_tensor(t, "t", "gumbel_noise")
    noise = torch.zeros_like(t).uniform_(0, 1)
    return -log_add_eps(-log_add_eps(noise))


def gumbel_sample_dim(t: Tensor, temperature: float = 1.0, dim: int = -1) -> Tensor:
    """``nonautoregressive_wrapper.gumbel_sample``: ``argmax(t / max(temperature, 1e-10) + noise)`` along
    ``dim``; a row of all ``-inf`` or a NaN is a ``ValueError``."""
    _float_tensor(t, "t", "gumbel_sample")
    if t.ndim == 0:
        raise ValueError("gumbel_sample: t must have at least 1 dim")
    _dim(t, dim, "dim", "gumbel_sample")
    _number(temperature, "temperature", "gumbel_sample", nonneg=True)
    _check_sample_logits(t, dim, "gumbel_sample", "t")
    return ((t / max(temperature, 1e-10)) + gumbel_noise_uniform(t)).argmax(dim=dim)


def pad_at_dim(t: Tensor, pad: tuple[int, int], dim: int = -1, value: float = 0.0) -> Tensor:
    """``t`` padded by ``pad = (before, after)`` positions of ``value`` along ``dim`` (negative: cropped)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"pad_at_dim: t must be a tensor, got {type(t).__name__}")
    if (not isinstance(pad, (tuple, list)) or len(pad) != 2
            or any(isinstance(p, bool) or not isinstance(p, int) for p in pad)):
        raise TypeError(f"pad_at_dim: pad must be a pair of ints (before, after), got {pad!r}")
    if tuple(pad) == (0, 0):
        return t
    _dim(t, dim, "dim", "pad_at_dim")
    dims_from_right = (-dim - 1) if dim < 0 else (t.ndim - dim - 1)
    return F.pad(t, (*((0, 0) * dims_from_right), *pad), value=value)


def align_right(t: Tensor, lens: Tensor, pad_id=0) -> Tensor:
    """Each row of ``t (b, n, ...)`` with its first ``lens[b]`` positions moved to the right end, ``pad_id``
    before them (one host sync)."""
    if not isinstance(t, Tensor) or t.ndim < 2:
        raise TypeError("align_right: t must be a tensor of at least 2 dims (b, n, ...)")
    if not isinstance(lens, Tensor) or lens.dtype.is_floating_point or lens.dtype == torch.bool or lens.is_complex():
        raise TypeError("align_right: lens must be an integer tensor (b,)")
    batch, seq_len = t.shape[:2]
    if lens.shape != (batch,):
        raise ValueError(f"align_right: lens must have shape ({batch},), got {tuple(lens.shape)}")
    if batch and not bool(((lens >= 0) & (lens <= seq_len)).all()):
        raise ValueError(f"align_right: lens must lie in [0, {seq_len}]")
    if batch == 0:
        return t
    pad_lens = seq_len - lens.long()
    max_pad_len = int(pad_lens.amax())
    batch_arange = torch.arange(batch, device=t.device)[..., None]
    seq_arange = torch.arange(seq_len, device=t.device)
    t = pad_at_dim(t, (max_pad_len, 0), value=pad_id, dim=1)
    offset = max_pad_len - pad_lens
    return t[batch_arange, seq_arange + offset[..., None].to(t.device), ...]


def rotate_half(x: Tensor) -> Tensor:
    """Interleaved pairs ``(a, b) -> (-b, a)`` over the last dim (even)."""
    _float_tensor(x, "x", "rotate_half")
    if x.ndim == 0 or x.shape[-1] % 2:
        raise ValueError(f"rotate_half: the last dim of x must be even, got shape {tuple(x.shape)}")
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def transpose(t: Tensor) -> Tensor:
    """The last two dims swapped."""
    if not isinstance(t, Tensor) or t.ndim < 2:
        raise TypeError("transpose: t must be a tensor of at least 2 dims")
    return t.transpose(-1, -2)


# ----------------------------------------------------------------------------------------------------
# what is not provided
# ----------------------------------------------------------------------------------------------------


def _module(desc: str) -> str:
    return f"module not ported: {desc}"


_XT = "x_transformers.x_transformers."
_ATTEND_INTERNAL = "an internal helper of x-transformers' Attend; safeformer's attend replaces it"

NOT_PROVIDED: dict[str, str] = {
    # whole modules (every name of the module)
    "x_transformers.discover_wrapper": _module("the TPR-encoder / discover decoder wrapper"),
    "x_transformers.full_bandwidth": _module("FullBandwidth, latent recirculation across blocks with transitions"),
    "x_transformers.gpt_lejepa": _module("LatentAutoregressive (GPT with a LeJEPA latent objective)"),
    "x_transformers.recirculation": _module("Recirculation / RecirculationMixer"),
    "x_transformers.xm_latent_decoder": _module("XMLatentDecoder (multi-hypothesis latent decoder)"),
    # top level
    "x_transformers.default_device": "picks xpu/cuda/mps/cpu implicitly; safeformer places nothing by itself",
    # attend
    "x_transformers.attend.Intermediates": "safeformer's Attend returns its own intermediates (AttnIntermediate)",
    "x_transformers.attend.default_device": "picks xpu/cuda/mps/cpu implicitly; safeformer places nothing by itself",
    "x_transformers.attend.pack_one": _ATTEND_INTERNAL,
    "x_transformers.attend.unpack_one": _ATTEND_INTERNAL,
    # the same objects, imported by x-transformers into another of its modules
    "x_transformers.x_transformers.Intermediates": "safeformer's Attend returns its own intermediates (AttnIntermediate)",
    "x_transformers.x_transformers.default_device": "picks xpu/cuda/mps/cpu implicitly; safeformer places nothing by itself",
    "x_transformers.x_transformers.pack_one": _ATTEND_INTERNAL,
    "x_transformers.x_transformers.unpack_one": _ATTEND_INTERNAL,
    "x_transformers.attend.once": "a print-once decorator of x-transformers' Attend (kernel notices)",
        "x_transformers.attend.selective_attn": "selective attention is not an option of safeformer's attend",
    "x_transformers.attend.qk_l2_dist_squared": _ATTEND_INTERNAL + " (attn_l2_distance is built in)",
    "x_transformers.attend.one_hot_straight_through": _ATTEND_INTERNAL + " (attn_gumbel_softmax is built in)",
    "x_transformers.attend.sparse_topk_attn": "sparse top-k attention is refused by safeformer's Attend",
    "x_transformers.attend.create_causal_mask": "safeformer.masks.causal_mask (True = may attend) replaces it",
    "x_transformers.attend.onnx_create_causal_mask": "an ONNX-export variant of create_causal_mask; not ported",
    # autoregressive_wrapper
    "x_transformers.autoregressive_wrapper.modify_cached_kv": "edits Intermediates.cached_kv in place; "
    "safeformer's cache is a KVCache (edit attn_intermediates[i].cached_kv, read back when passed as cache)",
    "x_transformers.autoregressive_wrapper.contrastive_decode_fn": "contrastive decoding is not ported",
    # belief_state_wrapper
    "x_transformers.belief_state_wrapper.DetachMultiple": "an autograd helper of x-transformers' belief-state "
    "loss; safeformer's BeliefStateWrapper computes it without",
    # continuous
    "x_transformers.continuous.sample_from_mean_variance": "an internal of x-transformers' continuous sampling; "
    "safeformer's ContinuousAutoregressiveWrapper samples with a capped log variance",
    "x_transformers.continuous.batch_masked_mean": "an internal masked mean of x-transformers' continuous loss",
    "x_transformers.continuous.GaussianNLL": "an internal loss module of x-transformers' continuous wrapper",
    # dpo
    "x_transformers.dpo.freeze_all_layers_": "an internal of x-transformers' DPO (the reference model is frozen "
    "by safeformer's DPO itself)",
    "x_transformers.dpo.log_prob_from_model_and_seq": "an internal of x-transformers' DPO (safeformer's reads the "
    "masks differently: dpo_xt_masks)",
    "x_transformers.dpo.masked_mean": "an internal of x-transformers' DPO (it trims the mask one position)",
    # entropy_based_tokenizer
    "x_transformers.entropy_based_tokenizer.calc_entropy_from_logits": "an internal entropy helper; a row of "
    "all -inf logits gives NaN there",
    "x_transformers.entropy_based_tokenizer.get_accumulated_threshold_mask": "an internal of x-transformers' "
    "EntropyBasedTokenizer",
    # free_transformer
    "x_transformers.free_transformer.pack_with_inverse": "an einops pack/unpack internal of x-transformers' "
    "FreeTransformer",
    # nonautoregressive_wrapper
    "x_transformers.nonautoregressive_wrapper.top_k": "its top_k(logits, thres=0.9) keeps ceil((1 - thres) * v) "
    "by a threshold; safeformer.autoregressive_wrapper.top_k is x-transformers' other top_k",
    # xl_autoregressive_wrapper
    "x_transformers.xl_autoregressive_wrapper.get_module_by_path": "an internal of x-transformers' test-time "
    "training (safeformer maps x-transformers' paths itself)",
    "x_transformers.xl_autoregressive_wrapper.set_module_by_path": "an internal of x-transformers' test-time "
    "training (safeformer maps x-transformers' paths itself)",
    "x_transformers.xl_autoregressive_wrapper.repeat_batch": "an einops internal of x-transformers' test-time "
    "training",
    "x_transformers.xl_autoregressive_wrapper.pack_one_with_inverse": "an einops pack/unpack internal of "
    "x-transformers' test-time training",
    # x_transformers.x_transformers: helpers
    _XT + "disable_autocast": "an internal decorator; safeformer picks its precision per operation",
    _XT + "detach_all": "an internal pytree helper of x-transformers' forward",
    _XT + "resolve_repeat_blocks_to_layer_execute_order": "an internal of x-transformers' repeat_blocks; "
    "safeformer's AttentionLayers takes repeat_blocks= itself",
    _XT + "orthog_project": "an internal of orthog_residual (built into safeformer's blocks)",
    _XT + "get_cached_kvs": "reads Intermediates.cached_kv; safeformer's cache is a KVCache",
    _XT + "calc_entropy": "an internal entropy helper; a row of all -inf logits gives NaN there",
    _XT + "calc_z_loss": "an internal of return_attn_z_loss (built into safeformer's TransformerWrapper)",
    "x_transformers.multi_input.calc_z_loss": "an internal of return_attn_z_loss (built into safeformer's TransformerWrapper)",
    _XT + "init_zero_": "an internal init helper of x-transformers' modules",
    _XT + "init_depth_scaled_": "an internal init helper of x-transformers' modules",
    _XT + "dropout_seq": "an internal of x-transformers' sequence dropout (safeformer's wrappers drop by mask)",
    _XT + "shift": "an internal of ShiftTokens (shift_tokens is built into safeformer's blocks)",
    _XT + "apply_polar_pos_emb": "an internal of polar_pos_emb (built into safeformer's attention)",
    _XT + "sinkhorn": "an internal of hyper-connections; safeformer.block.sinkhorn is safeformer's own (not re-exported)",
    _XT + "softclamp_gelu": "an internal activation of ff_glu_softclamp (built into safeformer's FeedForward)",
    _XT + "softclamp_silu": "an internal activation of ff_glu_softclamp (built into safeformer's FeedForward)",
}

_XT_INTERNAL_MODULES = {
    "SoLU": "the SoLU activation (FeedForward(solu=True)) is not among safeformer's FeedForward options",
    "CoPE": "attn_use_cope is built into safeformer's attention; the module itself is not exposed",
    "DataDependentAlibi": "attn_data_dependent_alibi is built into safeformer's attention; the module is not exposed",
    "PerRowDataDependentAlibi": "attn_data_dependent_alibi_per_row is built into safeformer's attention; the module is not exposed",
    "PolarEmbedding": "polar_pos_emb is built into safeformer's attention; the module is not exposed",
    "LoRALinear": "an internal low-rank linear of x-transformers' attention; not exposed",
    "AdaptiveLayerNorm": "use_adaptive_layernorm is built in; the module is not exposed (AdaptiveRMSNorm is)",
    "MultiheadRMSNorm": "an internal per-head norm of x-transformers' attention; not exposed",
    "Derf": "use_derf is built into safeformer's norms; the module is not exposed",
    "OrthogonalResidualUpdate": "orthog_residual is built into safeformer's blocks; the module is not exposed",
    "MVSplitResidualUpdate": "safeformer.block.MVSplitResidualUpdate is safeformer's own (its call takes a mask); not re-exported",
    "HyperConnection": "safeformer.block.HyperConnection is safeformer's own (its call differs); not re-exported",
    "GatedMultiResidual": "safeformer.nn.block.GatedMultiResidual (gated_multi_residual) is safeformer's own (its "
    "prepare / forward calls differ); not re-exported",
    "DynamicLIMe": "safeformer.block.DynamicLIMe is safeformer's own (its call differs); not re-exported",
    "ShiftTokens": "shift_tokens is built into safeformer's blocks; the module is not exposed",
    "FoldAxially": "attn_hybrid_fold_axial_dim is built into safeformer's attention; the module is not exposed",
    "AdaptiveLayerScale": "use_adaptive_layerscale is built in; the module is not exposed",
    "ConcatCombine": "unet_skips' combine; safeformer.block.ConcatCombine is safeformer's own (not re-exported)",
}
NOT_PROVIDED.update({_XT + name: reason for name, reason in _XT_INTERNAL_MODULES.items()})
