"""Decoding on a ``StaticKVCache``: after the prompt, the model's own forward at one position per step.

After the prompt (the prefill, an ordinary forward that returns a ``KVCache``), ``StaticStep`` builds a
``StaticKVCache`` (``stack/decode_step.py``: preallocated slots owned by the attention blocks, checked once) and
each step calls ``net(new, cache=static)``: the wrapper's forward, its stack's, every block's and every
attention's, at one position, with no value read back to the host. With ``compile=True`` the steps run on fixed
shapes (attention over every slot with the validity mask) and that forward is compiled once
(``torch.compile(net, fullgraph=True)``; on a GPU with CUDA graphs, ``mode="reduce-overhead"``).

``static_reason(net)`` says why a net cannot decode this way (the engine then uses the dynamic cache, which runs
every option). A net with ``logits_dim > num_tokens`` may sample an id that is no token: its steps record it on the
device, and ``StaticStep.check_tokens`` (the engine's periodic host check) raises the dynamic cache's ``ValueError``.

The engine may hand an adapter instead of a wrapper (a looped net's ``looped.NetCall``, a probabilistic continuous
net's raw head): one whose class has ``static_net`` names the wrapper the step runs (``None``: the adapter needs
the dynamic cache, ``static_refusal`` says why), ``static_loop`` its loop settings (``build_static_cache``'s
``loop``) and ``static_read(out)`` how the adapter lays out the step's output for the engine.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.cache import KVCache
from ..core.static_cache import StaticKVCache
from ..stack.decode_step import build_static_cache, step_refusal

__all__ = ["StaticKVCache", "StaticStep", "build_static_cache", "static_reason", "compile_options", "capacity_bucket"]



def static_reason(net) -> str | None:
    """Why ``net`` (a wrapper, or an adapter naming one: see the module docstring) cannot decode on a
    ``StaticKVCache`` (``None`` when it can)."""
    if hasattr(type(net), "static_net"):
        inner = net.static_net
        if inner is None:
            return net.static_refusal
        net = inner
    return step_refusal(net)


def _target(net) -> tuple:
    """``(wrapper, loop settings or None, output reader or None)`` of the engine's ``net``."""
    if not hasattr(type(net), "static_net"):
        return net, None, None
    return net.static_net, net.static_loop, net.static_read


def compile_options(device, mode: str | None = None) -> dict:
    """How the step is compiled on ``device``: the keywords for ``torch.compile`` besides ``fullgraph``.

    A GPU: ``mode="reduce-overhead"`` (CUDA graphs: the fixed-shape step is recorded once and replayed,
    no launch per kernel). A CPU: inductor's C++ wrapper (``cpp_wrapper``), which calls the generated
    kernels from C++ rather than from Python (measured here: a 4-layer dim-256 step 1.0 ms eager, 0.77 ms
    compiled with the Python wrapper, 0.54 ms with the C++ one). ``mode`` given: that mode, as asked.
    """
    if mode is not None:
        return {"mode": mode}
    if torch.device(device).type == "cuda":
        return {"mode": "reduce-overhead"}
    return {"options": {"cpp_wrapper": True}}


def capacity_bucket(needed: int, bucket: int = 64) -> int:
    """The compiled step's capacity for ``needed`` slots: rounded up to a multiple of ``bucket``, so that
    generations of nearby lengths share one compiled graph (its shapes include the capacity)."""
    return -(-needed // bucket) * bucket


class StaticStep:
    """The decode steps of one generation on a ``StaticKVCache``: ``step(new) -> out (B, ...)``.

    Args:
        net: a ``TransformerWrapper`` (``new``: token ids ``(B, 1)``) or ``ContinuousTransformerWrapper``
            (``new``: vectors ``(B, 1, dim_in)``) the step can run (``static_reason``).
        cache: the prefill's ``KVCache``.
        capacity: slots for the prefill plus every new position.
        compile: fixed shapes and ``net``'s forward compiled (``torch.compile(fullgraph=True)``, one graph).
        fast: let the attention blocks run plain projections on fused weights (``build_static_cache``).

    ``net`` may be an adapter naming the wrapper (``static_net``), its loop settings (``static_loop``) and how to lay
    out the step's output (``static_read``): see the module docstring.
    """

    def __init__(self, net, cache: KVCache, capacity: int, *, compile: bool = False, compile_mode: str | None = None,
                 fast: bool = True):
        net, loop, self.read = _target(net)
        self.net = net
        self.cache = build_static_cache(net, cache, capacity, fixed=compile, fast=fast, loop=loop)
        self.compiled = compile
        self._fn = net
        # attn_hybrid_module's torch.nn RNN: dynamo traces it only with allow_rnn (its default refuses RNN modules)
        self._rnn = compile and any(isinstance(m, torch.nn.RNNBase) for m in net.modules())
        if compile:
            self._fn = torch.compile(net, fullgraph=True, dynamic=False,
                                     **compile_options(self.cache.count.device, compile_mode))

    def step(self, new: Tensor) -> Tensor:
        """The output ``(B, ...)`` (logits, or values; a probabilistic head's ``(2, B, d)``) for the position after the
        cache, ``new (B, 1, ...)`` being written at the next slot. Raises ``ValueError`` when the cache is full."""
        c = self.cache
        if not self.compiled:
            out = self._fn(new, cache=c).select(-2, -1)  # (a probabilistic head's (2, B, 1, d): its new position too)
        else:
            if c.length >= c.capacity:
                raise ValueError(f"the static cache is full ({c.capacity} slots)")
            if self._rnn:
                with torch._dynamo.config.patch(allow_rnn=True):
                    out = self._fn(new, cache=c)
            else:
                out = self._fn(new, cache=c)
            out = out.select(-2, -1)  # the compiled forward advances the slot tensor, not the host count
            c.length += 1
        return out if self.read is None else self.read(out)

    def select(self, index: Tensor) -> None:
        """Keep (repeat, reorder) the samples ``index (B',)`` (beam search)."""
        self.cache.index_select_(index)

    def check_tokens(self) -> None:
        """Raise the dynamic cache's ``ValueError`` when a step was fed a token id outside the vocabulary (a net with
        ``logits_dim > num_tokens`` records it on the device: ``StaticKVCache.check_tokens``, one host read)."""
        self.cache.check_tokens()
