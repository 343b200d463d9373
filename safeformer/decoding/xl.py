"""Transformer-XL training and sampling over segments, with test-time training (x-transformers'
``x_transformers.xl_autoregressive_wrapper``: the same names, keywords and math).

``XLAutoregressiveWrapper(net, ...)`` splits a long sequence into segments of ``net.max_seq_len`` tokens and
runs them in order, each attending to the memories (``TransformerWrapper(max_mem_len=...)``) the earlier
segments left. Optionally some modules are test-time trained: their weights become per-sample fast weights
(``TTTModuleWrapper``), updated by a gradient step after every segment.

Shapes: ``b`` batch, ``n`` tokens, ``c`` model width, ``v`` vocabulary.

Differences from x-transformers (safety): ``forward`` accepts a padding ``mask`` (True = real token): padded
positions count in no loss, reach no memory a real token sees (the memories carry their masks, through every
segment and every sampling step; padded memory slots are cut before real ones at ``max_mem_len``), and reach no
test-time update (a sample with no counted label in a segment keeps its fast weights). Sampling recomputes the
current segment at every step (memories and a KV cache do not combine here), with the same tokens as
x-transformers' cached loop. A sequence of one position, or an empty batch, gives a loss of exactly 0 with zero
gradients; ``generate`` checks its arguments as ``AutoregressiveWrapper.generate`` does; test-time training also
runs under ``torch.inference_mode``; options that memories cannot serve are refused when the wrapper is built.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import reduce

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vmap

from ..core import xt_helpers as _xt_helpers
from ..core.losses import masked_mean, safe_cross_entropy
from ..core.masks import check_token_ids, validate_mask
from ..core.xt_helpers import default, divisible_by, exists, is_empty  # noqa: F401  (x-transformers' helpers)
from ..core.xt_helpers import first_of_iter as first  # noqa: F401
from ..stack.layers import Encoder
from ..stack.stack_forward import mems_unsupported
from ..stack.wrapper_forward import Mems, _new_mems
from ..stack.xt_extras import eval_decorator
from .generation import NOTHING_TO_DRAW, check_pad_value, check_sampling, draw, top_k

transpose = _xt_helpers.transpose  # x-transformers' helper of this module (a local name of the same spelling below)

__all__ = [
    "EpisodicMemories", "EpisodicMemoryWrapper", "LowRankLinear", "TTTMetaLearningTargetKLLoss",
    "TTTModuleWrapper", "TTTNextLatentPredictionLoss", "XLAutoregressiveWrapper", "newtonschulz5",
]


def _exists(v) -> bool:
    return v is not None


def _resolve_path(root: nn.Module, path: str) -> str:
    """``path`` (x-transformers' dotted module path, which is safeformer's: the module trees are the same), checked
    to name a submodule of ``root``."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"a module path must be a non-empty dotted string, got {path!r}")
    mod, seen = root, []
    for name in path.split("."):
        child = mod._modules.get(name) if isinstance(mod, nn.Module) else None
        if child is None:
            raise ValueError(f"module path {path!r}: {type(mod).__name__} at {'.'.join(seen) or '<root>'!r} has no "
                             f"submodule {name!r}")
        seen.append(name)
        mod = child
    return path


def _get_module(root: nn.Module, path: str) -> nn.Module:
    return reduce(getattr, path.split("."), root)


def _set_module(root: nn.Module, path: str, new: nn.Module) -> None:
    *parts, last = path.split(".")
    setattr(reduce(getattr, parts, root), last, new)


def newtonschulz5(t: Tensor, steps: int = 5, eps: float = 1e-7, coefs=(3.4445, -4.7750, 2.0315)) -> tuple[Tensor, bool]:
    """Muon's orthogonalisation (Newton-Schulz, Keller Jordan et al.) of each matrix ``(..., i, j)`` of ``t``;
    ``(t, False)`` unchanged for a tensor of fewer than 3 dimensions (a per-sample vector)."""
    if t.dim() < 3:
        return t, False
    transpose = t.shape[-2] > t.shape[-1]
    if transpose:
        t = t.transpose(-1, -2)
    shape = t.shape
    t = t.reshape(-1, *shape[-2:])
    t = t / t.norm(dim=(-1, -2), keepdim=True).clamp(min=eps)
    a, b, c = coefs
    for _ in range(steps):
        A = t @ t.transpose(-1, -2)
        B = b * A + c * A @ A
        t = a * t + B @ t
    t = t.reshape(shape)
    return (t.transpose(-1, -2) if transpose else t), True


# ------------------------------------------------------------------------------------------------------
# modules
# ------------------------------------------------------------------------------------------------------


class EpisodicMemories(nn.Module):
    """Learned key/value slots for every self-attention block: ``mem_kv (2, depth, heads, seq_len, dim_head)``
    (keys then values), initialised N(0, 0.02)."""

    def __init__(self, depth: int, heads: int, seq_len: int, dim_head: int):
        super().__init__()
        self.mem_kv = nn.Parameter(torch.randn(2, depth, heads, seq_len, dim_head))
        nn.init.normal_(self.mem_kv, std=0.02)

    def forward(self) -> Tensor:
        return self.mem_kv


class EpisodicMemoryWrapper(nn.Module):
    """``net`` whose self-attention blocks each also see ``episodic_mem_len`` learned key/value slots
    (``self_attn_additional_kv``; padded path)."""

    def __init__(self, net: nn.Module, episodic_mem_len: int):
        super().__init__()
        self.net = net
        stack = getattr(net, "attn_layers", None)
        blocks = [blk.mixer for blk in getattr(stack, "layers", []) if getattr(blk, "kind", None) == "self"]
        if not blocks:
            raise ValueError("episodic_mem_len needs a network with self-attention blocks (net.attn_layers)")
        self.episodic_mems = EpisodicMemories(depth=len(blocks), heads=blocks[0].kv_heads,
                                              seq_len=episodic_mem_len, dim_head=blocks[0].dim_head)

    def get_additional_kv(self, batch_size: int) -> list[tuple[Tensor, Tensor]]:
        mem_kv = self.episodic_mems()
        if mem_kv.dim() == 5:
            mem_kv = mem_kv[None].expand(batch_size, *mem_kv.shape)  # (b, 2, depth, h, a, d)
        mem_k, mem_v = mem_kv.unbind(dim=1)
        return list(zip(mem_k.unbind(dim=1), mem_v.unbind(dim=1)))

    def forward(self, x: Tensor, **kwargs):
        kwargs.update(self_attn_additional_kv=self.get_additional_kv(x.shape[0]))
        return self.net(x, **kwargs)


class LowRankLinear(nn.Module):
    """A linear layer whose weight is ``weight_a (out, r) @ weight_b (r, in)`` (``weight_b`` starts at 0, so the
    layer starts as its bias alone), replacing ``module``'s weight: the test-time memories live in the two factors."""

    def __init__(self, module: nn.Module, low_rank_dim: int):
        super().__init__()
        weight = getattr(module, "weight", None)
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            raise ValueError("ttt_low_rank_paths: low rank only replaces a module with a 2-dimensional weight")
        out_dim, in_dim = weight.shape
        if isinstance(low_rank_dim, bool) or not isinstance(low_rank_dim, int) or not 0 < low_rank_dim < min(out_dim, in_dim):
            raise ValueError(f"low rank dim ({low_rank_dim!r}) must be a positive integer less than the minimum of the "
                             f"input ({in_dim}) and output ({out_dim}) dimensions of the weight matrix")
        self.weight_a = nn.Parameter(torch.randn(out_dim, low_rank_dim))
        self.weight_b = nn.Parameter(torch.zeros(low_rank_dim, in_dim))
        bias = getattr(module, "bias", None)
        self.bias = nn.Parameter(bias.detach().clone()) if isinstance(bias, Tensor) else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight_a @ self.weight_b, self.bias)


class TTTModuleWrapper(nn.Module):
    """A module whose parameters may be replaced by per-sample fast weights ``batch_params`` (a dict of ``(b, ...)``
    tensors): the module then runs once per sample (``torch.func.vmap`` over ``functional_call``).

    The fast weights change only in ``XLAutoregressiveWrapper.init_ttt`` / ``update_ttt`` / ``reset``, never inside a
    forward: a KV-cached decode (dynamic or static) calls this module at each step with the fast weights it holds
    then. The static decode step never reads the wrapped module's parameters as a plain ``nn.Linear``'s (no fused
    projection, no feed-forward plan: this is no ``nn.Linear``); it calls this module, as the dynamic path does."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.batch_params = None

    def reset(self) -> None:
        self.batch_params = None

    @staticmethod
    def reset_all(module: nn.Module) -> None:
        for mod in module.modules():
            if isinstance(mod, TTTModuleWrapper):
                mod.reset()

    def forward(self, *args, **kwargs):
        if self.batch_params is None:
            return self.module(*args, **kwargs)

        def call_single(params, *single):
            return functional_call(self.module, params, single, kwargs)

        return vmap(call_single)(self.batch_params, *args)


class TTTMetaLearningTargetKLLoss(nn.Module):
    """A learned test-time loss: ``KL(softmax(to_prediction(h)) || softmax(to_meta_prediction(encoder(h))))`` per
    position, ``h`` the network's last hidden states (``intermediates.last_layer_hiddens``); padded positions'
    rows are 0 (the encoder sees only real positions)."""

    def __init__(self, *, dim: int, num_classes: int, depth: int = 1, heads: int = 4, dim_head: int = 64, **kwargs):
        super().__init__()
        self.encoder = Encoder(dim=dim, depth=depth, heads=heads, attn_dim_head=dim_head, **kwargs)
        self.to_prediction = nn.Linear(dim, num_classes)
        self.to_meta_prediction = nn.Linear(dim, num_classes)

    def forward(self, intermediates, mask: Tensor | None = None) -> Tensor:
        hiddens = intermediates.last_layer_hiddens
        pred = self.to_prediction(hiddens)
        meta_pred = self.to_meta_prediction(self.encoder(hiddens, mask=mask))
        loss = F.kl_div(meta_pred.log_softmax(dim=-1), pred.softmax(dim=-1), reduction="none").sum(dim=-1)  # (b, n)
        return loss if mask is None else torch.where(mask, loss, 0.0)


class TTTNextLatentPredictionLoss(nn.Module):
    """A test-time loss from a small MLP predicting the next position's latent (the last predicts the first;
    target detached): ``smooth_l1`` or ``mse`` per position, 0 where the next label is masked."""

    def __init__(self, *, dim: int, hidden_dim: int | None = None, num_layers: int = 3, loss_type: str = "smooth_l1"):
        super().__init__()
        hidden_dim = dim if hidden_dim is None else hidden_dim
        layers: list[nn.Module] = [nn.LayerNorm(dim)]
        for i in range(num_layers):
            last = i == num_layers - 1
            layers.append(nn.Linear(dim if i == 0 else hidden_dim, dim if last else hidden_dim))
            if not last:
                layers.append(nn.GELU())
        self.predictor = nn.Sequential(*layers)
        if loss_type not in ("smooth_l1", "mse"):
            raise ValueError(f"unknown loss type {loss_type!r} (smooth_l1 or mse)")
        self.loss_fn = F.smooth_l1_loss if loss_type == "smooth_l1" else F.mse_loss

    def forward(self, intermediates, mask: Tensor | None = None) -> Tensor:
        hiddens = intermediates.last_layer_hiddens
        pred = self.predictor(hiddens)
        target = torch.cat((hiddens[:, 1:], hiddens[:, :1]), dim=1).detach()
        loss = self.loss_fn(pred, target, reduction="none").mean(dim=-1)  # (b, n)
        if mask is not None:
            loss = torch.where(torch.cat((mask[:, 1:], mask[:, :1]), dim=1), loss, 0.0)
        return loss


# ------------------------------------------------------------------------------------------------------
# the wrapper
# ------------------------------------------------------------------------------------------------------


def _check_stack_takes_mems(stack) -> None:
    """The wrapper runs every segment with Transformer-XL memories (``mems`` / ``return_mems``): a stack option they
    cannot serve is refused when it is built, naming ``mems`` and the option, instead of at the second segment."""
    if stack is None or not hasattr(stack, "layers"):
        return
    reason = mems_unsupported(stack)
    if reason is not None:
        raise ValueError(f"XLAutoregressiveWrapper runs every segment with Transformer-XL memories (mems / "
                         f"return_mems), which cannot be combined with {reason}")


def _ttt_path_maps(ttt_module_paths, ttt_low_rank_paths, has_episodic_mem: bool) -> tuple[tuple, dict]:
    """``(paths_map, low_rank)``: the ``(source, target)`` pairs of the modules to test-time train (each low-rank
    path its own pair, last) and the rank of each low-rank path; with episodic memories, a path is inside the
    memory wrapper's ``net`` (``'episodic_mems'`` excepted)."""

    def pair(item) -> tuple[str, str]:
        if isinstance(item, str):
            return item, item
        if isinstance(item, (tuple, list)) and len(item) == 2:
            return tuple(item)
        raise ValueError(f"ttt_module_paths entries must be a path or a (source, target) pair, got {item!r}")

    prefix = lambda p: p if not has_episodic_mem or p == "episodic_mems" else f"net.{p}"  # noqa: E731
    paths = tuple(tuple(prefix(p) for p in pair(item)) for item in ttt_module_paths)
    low_rank = {}
    for item in ttt_low_rank_paths:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"ttt_low_rank_paths entries must be (path, low_rank_dim) pairs, got {item!r}")
        low_rank[prefix(item[0])] = item[1]
    return paths + tuple((p, p) for p in low_rank), low_rank


def _wrap_ttt_modules(net: nn.Module, paths_map, low_rank: dict) -> dict[str, TTTModuleWrapper]:
    """A ``TTTModuleWrapper`` put in place of the module each path of ``paths_map`` names (around a ``LowRankLinear``
    for a low-rank path), keyed by the path as given."""
    wrappers: dict[str, TTTModuleWrapper] = {}
    for source, target in paths_map:
        for path in (source, target):
            if path in wrappers:
                continue
            real = _resolve_path(net, path)
            mod = _get_module(net, real)
            if isinstance(mod, TTTModuleWrapper):
                raise ValueError(f"ttt module path {path!r} names a module wrapped already (two spellings of one "
                                 "module?)")
            if path in low_rank:
                mod = LowRankLinear(mod, low_rank[path])
            wrapper = TTTModuleWrapper(mod)
            _set_module(net, real, wrapper)
            wrappers[path] = wrapper
    return wrappers


def _fast_weights_step(xl, source: str, target: str, grads, stepped: Tensor, create_graph: bool) -> dict[str, Tensor]:
    """The fast weights of ``target`` after one test-time step along the gradients ``grads`` of ``source``'s:
    ``w - lr * g - lr * wd * w`` for the samples ``stepped (b,)`` (others keep theirs), matrix gradients
    orthogonalised first with ``ttt_use_muon`` (and stepped with ``ttt_muon_lr``). ``xl``: the wrapper."""
    src, tgt = xl.ttt_wrappers[source], xl.ttt_wrappers[target]
    if len(src.batch_params) != len(tgt.batch_params):
        raise ValueError(f"source module {source} and target module {target} must have the same number of "
                         "parameters")
    if xl.ttt_use_muon:
        grads, muon = zip(*[newtonschulz5(g, steps=xl.ttt_muon_steps) if g is not None else (None, False)
                            for g in grads])
    else:
        muon = (False,) * len(grads)
    new = {}
    for (s_name, s_p), (t_name, t_p), g, is_muon in zip(src.batch_params.items(), tgt.batch_params.items(),
                                                       grads, muon):
        if s_p.shape != t_p.shape:
            raise ValueError(f"source parameter {source}.{s_name} {tuple(s_p.shape)} and target parameter "
                             f"{target}.{t_name} {tuple(t_p.shape)} must have the same shape")
        if g is not None:
            lr = xl.ttt_muon_lr if is_muon else xl.ttt_lr
            t_p = torch.where(stepped.view(-1, *[1] * (t_p.dim() - 1)), t_p - lr * g - lr * xl.ttt_wd * t_p, t_p)
        if not create_graph:
            t_p = t_p.detach().requires_grad_()
        new[t_name] = t_p
    return new


class XLAutoregressiveWrapper(nn.Module):
    """Next-token loss and sampling over segments of ``net.max_seq_len`` tokens with Transformer-XL memories,
    optionally with test-time training (x-transformers' ``XLAutoregressiveWrapper``).

    Args:
        net: a ``TransformerWrapper`` (give it ``max_mem_len`` for memories).
        ignore_index: the label that counts in no loss.
        pad_value: what ``generate`` writes after an ``eos_token``.
        tbptt_steps: the memories (and fast weights) are detached after every ``tbptt_steps`` segments
            (truncated backpropagation through time); more than 1 with test-time training.
        ttt_module_paths: modules to test-time train: dotted paths (x-transformers' paths, e.g.
            ``'attn_layers.layers.0.1.to_v'``, ``'attn_layers.layers.1.1.ff.0.0'``: the module trees are the same), or ``(source, target)`` pairs (the source's gradient updates the target,
            same parameter shapes); ``'episodic_mems'`` with ``episodic_mem_len``.
        ttt_lr, ttt_wd: the fast weights' step: ``w - lr * grad - lr * wd * w``.
        ttt_use_muon, ttt_muon_steps, ttt_muon_lr: orthogonalise matrix gradients (Newton-Schulz) and step them
            with ``ttt_muon_lr``.
        ttt_low_rank_paths: ``(path, r)`` pairs: the module's weight replaced by a rank-``r`` product
            (``LowRankLinear``) that holds the test-time memories (trained itself too).
        ttt_custom_loss_module: a module ``(intermediates, mask) -> loss (b, n) or (b,)`` for the test-time
            gradient instead of the next-token loss; ``ttt_next_latent_loss``: use ``TTTNextLatentPredictionLoss``.
        episodic_mem_len: learned key/value slots per self-attention block (``EpisodicMemoryWrapper``).
    """

    def __init__(
        self,
        net: nn.Module,
        ignore_index: int = -100,
        pad_value: int = 0,
        tbptt_steps: int = 1,
        ttt_module_paths=(),
        ttt_lr: float = 1e-3,
        ttt_wd: float = 0.01,
        ttt_use_muon: bool = False,
        ttt_muon_steps: int = 5,
        ttt_muon_lr: float = 1e-2,
        ttt_low_rank_paths=(),
        ttt_custom_loss_module: nn.Module | None = None,
        ttt_next_latent_loss: bool = False,
        episodic_mem_len: int = 0,
    ):
        super().__init__()
        for name, v in (("tbptt_steps", tbptt_steps), ("ttt_muon_steps", ttt_muon_steps)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if isinstance(episodic_mem_len, bool) or not isinstance(episodic_mem_len, int) or episodic_mem_len < 0:
            raise ValueError(f"episodic_mem_len must be a non-negative integer, got {episodic_mem_len!r}")
        if not hasattr(net, "max_seq_len"):
            raise ValueError("XLAutoregressiveWrapper needs a network with max_seq_len (a TransformerWrapper)")
        check_pad_value(pad_value)
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
        _check_stack_takes_mems(getattr(net, "attn_layers", None))
        self.pad_value = pad_value
        self.ignore_index = ignore_index
        self.tbptt_steps = tbptt_steps
        self.max_seq_len = net.max_seq_len
        self.output_is_log_prob = bool(getattr(net, "output_is_log_prob", False))
        self.ttt_lr, self.ttt_wd = ttt_lr, ttt_wd
        self.ttt_use_muon, self.ttt_muon_steps, self.ttt_muon_lr = ttt_use_muon, ttt_muon_steps, ttt_muon_lr
        self.ttt_custom_loss_module = ttt_custom_loss_module
        if ttt_next_latent_loss:
            if ttt_custom_loss_module is not None:
                raise ValueError("ttt_custom_loss_module and ttt_next_latent_loss cannot both be set")
            dim = getattr(getattr(net, "attn_layers", None), "dim", None)
            if dim is None:
                raise ValueError("ttt_next_latent_loss needs a network with attn_layers.dim")
            self.ttt_custom_loss_module = TTTNextLatentPredictionLoss(dim=dim)

        self.has_episodic_mem = episodic_mem_len > 0
        if self.has_episodic_mem:
            net = EpisodicMemoryWrapper(net, episodic_mem_len)
        self.net = net

        self.ttt_paths_map, self.ttt_low_rank_paths_map = _ttt_path_maps(ttt_module_paths, ttt_low_rank_paths,
                                                                         self.has_episodic_mem)
        # one wrapper per path (keyed by the path as given), at the module it names
        self.ttt_wrappers: dict[str, TTTModuleWrapper] = _wrap_ttt_modules(net, self.ttt_paths_map,
                                                                           self.ttt_low_rank_paths_map)
        if self.has_ttt and tbptt_steps <= 1:
            raise ValueError("tbptt_steps must be greater than 1 if ttt is turned on")
        stack = getattr(self.net.net if self.has_episodic_mem else self.net, "attn_layers", None)
        if self.has_ttt and hasattr(stack, "packable"):  # fast weights run per sample: never on packed tokens
            stack.packable = False

    @property
    def has_ttt(self) -> bool:
        return len(self.ttt_wrappers) > 0

    def _loss_fn(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Per-position loss ``(b, n)``; ignored labels give 0 (their logits are not read)."""
        if self.output_is_log_prob:
            valid = labels != self.ignore_index
            picked = logits.gather(-1, torch.where(valid, labels, 0)[..., None])[..., 0]
            return torch.where(valid, -picked, 0.0)
        return safe_cross_entropy(logits, labels, ignore_index=self.ignore_index, reduction="none")

    def init_ttt(self, batch: int) -> None:
        """Fast weights for a new batch: every wrapped module's parameters repeated per sample."""
        for wrapper in self.ttt_wrappers.values():
            wrapper.batch_params = {name: p[None].expand(batch, *p.shape) for name, p in wrapper.module.named_parameters()}

    def update_ttt(self, logits: Tensor, chunk_labels: Tensor, create_graph: bool = False, intermediates=None) -> None:
        """One test-time step of the fast weights on this segment's loss (masked labels count in none)."""
        if not self.has_ttt:
            return
        mask = chunk_labels != self.ignore_index
        stepped = mask.any(dim=-1)  # (b,): a sample without a counted label keeps its fast weights (no decay)
        if self.ttt_custom_loss_module is not None:
            if intermediates is None:
                raise ValueError("update_ttt needs the intermediates with ttt_custom_loss_module")
            loss_t = self.ttt_custom_loss_module(intermediates, mask=mask)
            per_batch = masked_mean(loss_t, mask, dim=-1) if loss_t.dim() > 1 else loss_t
        else:
            per_batch = masked_mean(self._loss_fn(logits, chunk_labels), mask, dim=-1)
        params = [p for source, _ in self.ttt_paths_map for p in self.ttt_wrappers[source].batch_params.values()]
        grads = torch.autograd.grad(per_batch.sum(), params, create_graph=create_graph, retain_graph=create_graph,
                                    allow_unused=True)
        at = 0
        for source, target in self.ttt_paths_map:
            k = len(self.ttt_wrappers[source].batch_params)
            these, at = grads[at:at + k], at + k
            self.ttt_wrappers[target].batch_params = _fast_weights_step(self, source, target, these, stepped,
                                                                        create_graph)

    def _segment(self, net, tokens: Tensor, mems, mask: Tensor | None, **kwargs):
        """``net`` on one segment with its memories (their padded slots moved first, see ``_compact_mems``):
        ``(logits, intermediates)``."""
        if mask is not None:
            kwargs["mask"] = mask
        return net(tokens, mems=_compact_mems(mems), return_mems=True, return_intermediates=True, **kwargs)

    @property
    def _wrapper(self) -> nn.Module:
        """The ``TransformerWrapper`` (inside the episodic-memory wrapper, if any)."""
        return self.net.net if self.has_episodic_mem else self.net

    @torch.no_grad()
    @eval_decorator
    def generate(self, start_tokens: Tensor, seq_len: int, eos_token: int | None = None, temperature: float = 1.0,
                 filter_logits_fn=top_k, filter_kwargs: dict | None = None, mems=None, **kwargs) -> Tensor:
        """Sample ``seq_len`` tokens after ``start_tokens (b, t)`` (or ``(t,)``), the prompt's earlier segments
        read into the memories first (x-transformers' segment schedule); with test-time training the prompt
        trains the fast weights (also under ``torch.inference_mode``). ``temperature=0`` is greedy (a callable
        ``filter_logits_fn`` still applies; the built-in filters keep the best token and are skipped); otherwise the
        filter, then the temperature (x-transformers' order). With ``eos_token`` sampling stops once every sample
        has sampled it, the positions after each sample's first one set to ``pad_value`` (x-transformers instead
        fills the positions before it, prompt included, and counts an eos in the prompt). ``mems`` (with their
        masks, as ``return_mems`` gives them, or ``mem_masks=``): the memories of earlier segments; their padded
        slots stay masked at every step. Returns ``(b, <= seq_len)`` (``(<= seq_len,)``).

        Raises:
            ValueError, TypeError: a bad argument, named (as ``AutoregressiveWrapper.generate``); a row with no
                token left to draw (``logits``).
        """
        if "mask" in kwargs or "cache" in kwargs:
            raise ValueError("XLAutoregressiveWrapper.generate takes unpadded prompts and keeps no KV cache: pass "
                             "neither mask nor cache")
        fn = _check_generate(getattr(self._wrapper, "num_tokens", None), start_tokens, seq_len, eos_token, temperature,
                             filter_logits_fn, filter_kwargs)
        mems = _with_masks(mems, kwargs.pop("mem_masks", None))
        squeeze = start_tokens.dim() == 1
        if squeeze:
            start_tokens = start_tokens[None]
        if seq_len == 0 or start_tokens.shape[0] == 0:  # empty in, empty out
            out = start_tokens.new_full((start_tokens.shape[0], seq_len), self.pad_value)
            return out[0] if squeeze else out
        args = (start_tokens, seq_len, eos_token, temperature, fn, filter_kwargs, mems, kwargs)
        if self.has_ttt and torch.is_inference_mode_enabled():
            with torch.inference_mode(False), torch.no_grad():  # as under no_grad: the test-time steps need autograd
                out = self._generate(*_outside_inference(args))
        else:
            out = self._generate(*args)
        return out[0] if squeeze else out

    def _generate(self, start_tokens: Tensor, seq_len: int, eos_token, temperature: float, fn, filter_kwargs, mems,
                  kwargs: dict) -> Tensor:
        """``generate`` on checked arguments (``start_tokens (b, t)``)."""
        max_seq_len = self.max_seq_len
        batch, t = start_tokens.shape
        *leading, remainder = start_tokens.split(max_seq_len, dim=-1)
        grad_ctx = torch.enable_grad if self.has_ttt else nullcontext

        with grad_ctx():
            if self.has_ttt:
                self.init_ttt(batch)
            for idx, chunk in enumerate(leading):
                logits, inter = self._segment(self.net, chunk, mems, None, **kwargs)
                mems = inter.mems
                if self.has_ttt:
                    labels = start_tokens[:, idx * max_seq_len + 1:(idx + 1) * max_seq_len + 1]
                    if labels.shape[1] < chunk.shape[1]:  # the prompt ends here: the last position has no label
                        labels = torch.cat((labels, labels.new_full((batch, 1), self.ignore_index)), dim=1)
                    self.update_ttt(logits, labels, create_graph=False, intermediates=inter)

        if self.has_ttt and remainder.shape[-1] > 1:  # test-time train on the rest of the prompt
            with grad_ctx():
                logits, inter = self._segment(self.net, remainder[:, :-1], mems, None, **kwargs)
                mems = inter.mems
                self.update_ttt(logits, remainder[:, 1:], create_graph=False, intermediates=inter)

        net = self.net
        if self.has_episodic_mem:  # the learned slots once, not per token
            kwargs.update(self_attn_additional_kv=net.get_additional_kv(batch))
            net = net.net

        # a row left with nothing to draw (a callable filter): flagged on the device, read after each step
        nothing = torch.zeros((), dtype=torch.bool, device=start_tokens.device)
        # x-transformers' schedule: the segment starting at curr_pos is recomputed at every step (there, from a KV
        # cache) with the memories curr_mems; after each step the memories become curr_mems and the new positions'
        # hiddens (a fresh segment: all its positions; then the one new token), taken over at segment boundaries
        curr_pos = len(leading) * max_seq_len
        curr_mems, fresh = mems, True
        out = start_tokens
        for _ in range(seq_len):
            length = out.shape[-1]
            boundary = length % max_seq_len == 0
            if boundary:
                curr_pos, curr_mems, fresh = length, mems, True
            x = out[:, curr_pos:]
            if x.shape[-1] == 0:  # ends exactly on a segment boundary: the last full segment again, afresh
                x = out[:, curr_pos - max_seq_len:]
            if boundary or (length + 1) % max_seq_len == 0:  # the memories are read at a boundary only
                logits, inter = net(x, mems=curr_mems, return_intermediates=True, **kwargs)
                mems = _step_mems(net, curr_mems, inter.hiddens, x.shape[1] if fresh else 1)
            else:
                logits = net(x, mems=curr_mems, **kwargs)
            fresh = False
            logits = logits[:, -1]
            if temperature > 0 and fn is not None:  # x-transformers' order: the filter, then the temperature
                sample = draw(fn(logits, **(filter_kwargs or {})), temperature, None, None, nothing)
            else:
                sample = draw(logits, temperature, fn, filter_kwargs, nothing)
            if bool(nothing):
                raise ValueError(NOTHING_TO_DRAW)
            sample = sample[:, None]
            if boundary:
                curr_pos, curr_mems, fresh = length, mems, True
            out = torch.cat((out, sample), dim=-1)
            if eos_token is not None:  # the sampled tokens only (x-transformers also reads the prompt)
                is_eos = out[:, t:] == eos_token
                if bool(is_eos.any(dim=-1).all()):
                    after = (is_eos.long().cumsum(dim=-1) - is_eos.long()) > 0  # strictly after the first eos
                    out = torch.cat((out[:, :t], out[:, t:].masked_fill(after, self.pad_value)), dim=-1)
                    break
        return out[:, t:]

    def forward(self, x: Tensor, mems=None, dropout_mems: bool = False, ttt_recurrent_steps: int = 1,
                mask: Tensor | None = None, **kwargs) -> Tensor:
        """The next-token loss of ``x (b, n)`` over segments: the mean per sample of each segment's loss, weighted
        by the segment's share of the positions (x-transformers' weighting). ``mask (b, n)``: padding (True =
        real); a label counts when it and its input are real, and a segment with no counted label of a sample
        steps none of its fast weights. ``mems`` (with their masks, as ``return_mems`` gives them, or
        ``mem_masks=``): the memories of earlier segments. ``dropout_mems``: every segment without memories;
        ``ttt_recurrent_steps``: run each segment that many times, test-time training after each.

        A sequence of one position, or a batch of no sample, gives exactly 0 with zero gradients
        (``AutoregressiveWrapper``'s convention). With test-time training the loss is also computed under
        ``torch.inference_mode`` (the same value as under ``torch.no_grad``, returned without a graph).

        Raises:
            ValueError, TypeError: a bad argument, named.
        """
        if isinstance(ttt_recurrent_steps, bool) or not isinstance(ttt_recurrent_steps, int) or ttt_recurrent_steps < 1:
            raise ValueError(f"ttt_recurrent_steps must be a positive integer, got {ttt_recurrent_steps!r}")
        if ttt_recurrent_steps > 1 and not self.has_ttt:
            raise ValueError("ttt must be turned on (ttt_module_paths) to use ttt_recurrent_steps")
        if not isinstance(dropout_mems, bool):
            raise TypeError(f"dropout_mems must be True or False, got {dropout_mems!r}")
        check_token_ids(x, "x")
        if mask is not None:
            validate_mask(mask, "mask", shape=tuple(x.shape), device=x.device)
        mems = _with_masks(mems, kwargs.pop("mem_masks", None))
        args = (x, mems, dropout_mems, ttt_recurrent_steps, mask, kwargs)
        if self.has_ttt and torch.is_inference_mode_enabled():
            with torch.inference_mode(False), torch.no_grad():  # as under no_grad: the test-time steps need autograd
                return self._forward(*_outside_inference(args)).detach()
        return self._forward(*args)

    def _forward(self, x: Tensor, mems, dropout_mems: bool, ttt_recurrent_steps: int, mask: Tensor | None,
                 kwargs: dict) -> Tensor:
        """``forward`` on checked arguments."""
        ignore_index, max_seq_len = self.ignore_index, self.max_seq_len
        inp, labels = x[:, :-1], x[:, 1:]
        in_mask = None
        if mask is not None:
            in_mask = mask[:, :-1]
            labels = torch.where(mask[:, 1:] & in_mask, labels, ignore_index)
        batch, seq_len = inp.shape
        split_x, split_labels = inp.split(max_seq_len, dim=-1), labels.split(max_seq_len, dim=-1)
        split_mask = in_mask.split(max_seq_len, dim=-1) if in_mask is not None else (None,) * len(split_x)
        total_loss = 0.0
        grad_ctx = torch.enable_grad if self.has_ttt else nullcontext
        with grad_ctx():
            if self.has_ttt:  # under grad, also inside an outer no_grad
                self.init_ttt(batch)
            for idx, (chunk, chunk_labels, chunk_mask) in enumerate(zip(split_x, split_labels, split_mask)):
                last_chunk = idx == len(split_x) - 1
                detach = (idx + 1) % self.tbptt_steps == 0
                for step in range(ttt_recurrent_steps):
                    last_step = step == ttt_recurrent_steps - 1
                    logits, inter = self._segment(self.net, chunk, None if dropout_mems else mems, chunk_mask,
                                                  detach_mems=detach, **kwargs)
                    if last_step:
                        mems = inter.mems
                        valid = chunk_labels != ignore_index
                        per_batch = masked_mean(self._loss_fn(logits, chunk_labels), valid, dim=-1)
                        # no sample, or no position (a sequence of one token): exactly 0, the graph kept (S8)
                        mean = per_batch.mean() if batch else per_batch.sum()
                        total_loss = total_loss + mean * (chunk.shape[-1] / seq_len if seq_len else 1.0)
                    if (last_chunk and last_step) or not self.has_ttt:
                        continue
                    self.update_ttt(logits, chunk_labels, create_graph=self.training, intermediates=inter)
                if detach:
                    for wrapper in self.ttt_wrappers.values():
                        wrapper.batch_params = {k: v.detach().requires_grad_(v.requires_grad)
                                                for k, v in wrapper.batch_params.items()}
        return total_loss


def _check_generate(num_tokens, start_tokens, seq_len, eos_token, temperature, filter_logits_fn, filter_kwargs):
    """``XLAutoregressiveWrapper.generate``'s arguments checked (``AutoregressiveWrapper.generate``'s checks, with its
    names; ``num_tokens``: the net's vocabulary, if it has one): returns the filter function."""
    if not isinstance(start_tokens, Tensor) or start_tokens.dim() not in (1, 2):
        raise ValueError(f"start_tokens must be token ids of shape (b, t) or (t,), got "
                         f"{getattr(start_tokens, 'shape', type(start_tokens).__name__)}")
    if start_tokens.dtype.is_floating_point or start_tokens.dtype == torch.bool or start_tokens.is_complex():
        raise TypeError(f"start_tokens must hold integer token ids, got dtype {start_tokens.dtype}")
    if start_tokens.shape[-1] == 0:
        raise ValueError("start_tokens must hold at least one token per sample (got t = 0 positions)")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be an integer >= 0, got {seq_len!r}")
    fn = check_sampling(temperature, filter_logits_fn, filter_kwargs)
    if eos_token is not None and (isinstance(eos_token, bool) or not isinstance(eos_token, int)):
        raise TypeError(f"eos_token must be an int or None, got {eos_token!r}")
    if eos_token is not None and isinstance(num_tokens, int) and not 0 <= eos_token < num_tokens:
        raise ValueError(f"eos_token must be a token id in [0, num_tokens={num_tokens}), got {eos_token}")
    return fn


def _with_masks(mems, mem_masks):
    """``mems`` as a ``Mems`` carrying ``mem_masks`` (when given), so that the masks follow the memories from
    segment to segment; unchanged without ``mem_masks``. The network checks both."""
    if mem_masks is None:
        return mems
    if mems is None:
        raise ValueError("mem_masks was given without mems")
    if not isinstance(mems, (list, tuple)):
        raise ValueError(f"mems must be a list of one (b, m, c) tensor per self-attention block, got "
                         f"{type(mems).__name__}")
    out = Mems(mems)
    out.masks = list(mem_masks) if isinstance(mem_masks, (list, tuple)) else mem_masks
    return out


def _compact_mems(mems):
    """``mems`` with each memory's masked slots moved before its real ones (the order of each kept): positions count
    the real slots only, so this changes no result, but cutting memories to ``max_mem_len`` (from the front) then
    drops padding before any real slot, as the sample alone would keep them. Memories without masks, or malformed
    ones (the network names what is wrong), are returned as they are."""
    masks = getattr(mems, "masks", None)
    if masks is None or not isinstance(mems, (list, tuple)):
        return mems
    per = list(masks) if isinstance(masks, (list, tuple)) else [masks] * len(mems)
    if len(per) != len(mems) or not all(
            isinstance(t, Tensor) and t.dim() == 3 and (mm is None or (
                isinstance(mm, Tensor) and mm.dtype == torch.bool and mm.shape == t.shape[:2] and mm.device == t.device))
            for t, mm in zip(mems, per)):
        return mems
    orders: dict = {}  # one permutation per distinct mask: blocks that shared a mask share the new one
    new, new_masks = [], []
    for t, mm in zip(mems, per):
        if mm is None:
            new.append(t)
            new_masks.append(None)
            continue
        if id(mm) not in orders:
            order = torch.sort(mm.to(torch.uint8), dim=1, stable=True).indices  # masked (0) first, order kept
            orders[id(mm)] = (order, mm.gather(1, order))
        order, kept = orders[id(mm)]
        new.append(t.gather(1, order[..., None].expand_as(t)))
        new_masks.append(kept)
    out = Mems(new)
    out.masks = new_masks
    return out


def _outside_inference(obj, memo: dict | None = None):
    """``obj`` with every inference tensor (made under ``torch.inference_mode``) copied to an ordinary one, through
    lists, tuples and dicts (a ``Mems`` keeps its masks; a tensor met twice is copied once): test-time training
    records a graph, which an inference tensor cannot join."""
    memo = {} if memo is None else memo
    if isinstance(obj, Tensor):
        if not obj.is_inference():
            return obj
        if id(obj) not in memo:
            memo[id(obj)] = obj.clone()
        return memo[id(obj)]
    if isinstance(obj, Mems):
        out = Mems(_outside_inference(t, memo) for t in obj)
        out.masks = _outside_inference(obj.masks, memo)
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_outside_inference(t, memo) for t in obj)
    if isinstance(obj, dict):
        return {k: _outside_inference(v, memo) for k, v in obj.items()}
    return obj


def _step_mems(net, mems, hiddens: list[Tensor], new: int) -> Mems:
    """x-transformers' memories after a cached sampling step: the old memories (rotated by ``shift_mem_down``, as
    the network reads them) then the hiddens of the ``new`` last positions (what its cached forward computed), the
    last ``max_mem_len``. The masks of the old memories come along (the new positions are real), and their padded
    slots are moved first (``_compact_mems``), so the cut drops padding before a real slot."""
    tail = [h[:, h.shape[1] - new:] for h in hiddens]
    masks = None
    if mems is not None:
        mems = _compact_mems(mems)
        masks = getattr(mems, "masks", None)
        mems = list(mems)
        k = net.shift_mem_down
        if k:
            mems = [*mems[k:], *mems[:k]]
            if isinstance(masks, (list, tuple)):
                masks = [*masks[k:], *masks[:k]]
    return _new_mems(net, mems, masks, tail, None, True)

# x-transformers' names that its module of this path imports from another (the same objects as there)
from ..core.xt_helpers import cast_tuple  # noqa: E402, F401
from .generation import top_p  # noqa: E402, F401
