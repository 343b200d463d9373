"""Model builders and one small case per public module, for the contract tests of the model stack.

- building: ``seeded_module`` (fixed weights, norms perturbed), ``copy_weights``, ``set_backend``,
  ``set_unpadded``; the sizes every model test uses (tiny: the suite runs on 2 shared cores);
- attention roles: ``stack_roles`` names each ``Attention`` of a stack, ``track_roles`` tells a
  ``kernels.NaNKernel`` which one is running, ``capture_attention`` records their outputs;
- ``CASES``: per public module a factory, an input builder, how to run it, which rows of which attention
  are dead, how to plant garbage in masked positions, how to run a sample alone, and how to decode with a
  KV cache. ``test_contract_models.py`` runs every clause (docs/safety.md, S1-S9) over them.

Shape legend: b batch, n sequence positions, i queries, j keys / context positions, h query heads,
h_kv key/value heads, d head dim, c model width, c_ctx context width, v vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

import safeformer as sf

from .kernels import NaNKernel
from .masks import Scenario, causal_dead, ctx_dead, full_dead, plant
from .numerics import INF, NAN

__all__ = [
    "DIM", "HEADS", "DIM_HEAD", "CTX_DIM", "VOCAB", "MAX_SEQ",
    "param_grads", "seeded_module", "copy_weights", "set_backend", "set_unpadded", "attention_modules",
    "stack_roles", "track_roles", "capture_attention", "greedy_generate",
    "Inputs", "Case", "AttentionSelfCase", "AttentionSelfPaddingCase", "AttentionPastKVCase", "AttentionCrossCase",
    "EncoderCase", "DecoderCase", "CrossAttenderCase", "TransformerWrapperCase", "PrefixWrapperCase",
    "AdaptiveDecoderCase", "ContinuousWrapperCase", "XTransformerCase", "UnpaddedCase", "AttentionMemKVCase",
    "DecoderMemKVCase", "DecoderSinkBiasCase", "MemoryTokensWrapperCase", "SoftclampWrapperCase", "CASES", "UNPADDED_CASES",
    "ALL_CASES",
]

# Tiny sizes: every test file of the model stack together must run in about a minute on 2 cores.
DIM, HEADS, DIM_HEAD, CTX_DIM = 16, 2, 8, 12
VOCAB, MAX_SEQ = 19, 16

# ----------------------------------------------------------------------------------------------------
# building
# ----------------------------------------------------------------------------------------------------


def param_grads(model: nn.Module) -> dict[str, Tensor | None]:
    """``{name: grad clone}`` for every parameter (``None`` where no gradient arrived)."""
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def seeded_module(factory: Callable[[], nn.Module], seed: int = 0, perturb_norms: bool = True) -> nn.Module:
    """Build ``factory()`` with seeded weights; norm gains/biases get noise so they are not 1/0."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = factory()
        if perturb_norms:
            with torch.no_grad():
                for m in model.modules():
                    if isinstance(m, (nn.LayerNorm, sf.RMSNorm)):
                        for p in m.parameters():
                            p.add_(0.3 * torch.randn_like(p))
    return model


def copy_weights(dst: nn.Module, src: nn.Module) -> nn.Module:
    """Load ``src``'s weights into ``dst`` (casting dtypes) and return ``dst``."""
    dst.load_state_dict({k: v.to(dst.state_dict()[k].dtype) for k, v in src.state_dict().items()})
    return dst


def set_backend(model: nn.Module, backend: str) -> nn.Module:
    """Set the ``attend`` backend of every ``Attention`` inside ``model`` (for modules without the argument)."""
    for m in model.modules():
        if isinstance(m, sf.Attention):
            m.backend = backend
    return model


def attention_modules(model: nn.Module) -> list[sf.Attention]:
    return [m for m in model.modules() if isinstance(m, sf.Attention)]


def set_unpadded(model: nn.Module, value) -> nn.Module:
    """Set ``unpadded`` on every layer stack of ``model`` (False: the padded path, explicitly)."""
    for m in model.modules():
        if isinstance(m, sf.AttentionLayers):
            m.unpadded = value
    return model


# ----------------------------------------------------------------------------------------------------
# attention roles
# ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def track_roles(model: nn.Module, roles: dict[int, str], kernel: NaNKernel) -> Iterator[None]:
    """While inside, ``kernel.role`` names the ``Attention`` that is running (by ``roles[id(module)]``)."""
    handles = []
    for m in attention_modules(model):
        role = roles.get(id(m))

        def pre(_mod, _args, role=role):
            kernel.role = role

        handles.append(m.register_forward_pre_hook(pre))
    try:
        yield
    finally:
        for hd in handles:
            hd.remove()


@contextlib.contextmanager
def capture_attention(model: nn.Module, roles: dict[int, str]) -> Iterator[list[tuple[str, sf.Attention, Tensor, tuple]]]:
    """Record ``(role, module, output (b, i, c), positional inputs)`` of every ``Attention`` call."""
    seen: list[tuple[str, sf.Attention, Tensor, tuple]] = []
    handles = []
    for m in attention_modules(model):
        role = roles.get(id(m))

        def hook(mod, args, output, role=role):
            seen.append((role, mod, output[0] if isinstance(output, tuple) else output, args))

        handles.append(m.register_forward_hook(hook))
    try:
        yield seen
    finally:
        for hd in handles:
            hd.remove()


def stack_roles(layers: sf.AttentionLayers, prefix: str) -> dict[int, str]:
    """``{id(attention): "<prefix>.self" | "<prefix>.cross"}`` for the blocks of a layer stack."""
    return {id(layer.mixer): f"{prefix}.{kind}" for kind, layer in zip(layers.layer_kinds, layers.layers) if kind != "ff"}


# ----------------------------------------------------------------------------------------------------
# generation
# ----------------------------------------------------------------------------------------------------


def greedy_generate(model: sf.TransformerWrapper, prompt: Tensor, mask: Tensor | None, steps: int, **kwargs) -> Tensor:
    """Greedy decoding with the KV cache: ``(b, steps)`` new token ids after a (left-padded) prompt."""
    logits, cache = model(prompt, mask=mask, return_cache=True, **kwargs)
    nxt = logits[:, -1].argmax(-1, keepdim=True)
    out = [nxt]
    for _ in range(steps - 1):
        logits, cache = model(nxt, cache=cache, return_cache=True)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
    return torch.cat(out, dim=1)


# ----------------------------------------------------------------------------------------------------
# one small case per public module
# ----------------------------------------------------------------------------------------------------


@dataclass
class Inputs:
    """The inputs of one call: ``args`` positional, ``kwargs`` keyword; ``leaves`` the float tensors
    that take gradients (by name, also found in args/kwargs)."""

    args: list
    kwargs: dict
    leaves: dict[str, Tensor] = field(default_factory=dict)
    planted: dict[str, Tensor] = field(default_factory=dict)  # leaf name -> (b, n) where garbage was put


class Case:
    """A public module and how to drive it; subclasses fill in the specifics."""

    name = "case"
    has_context = False
    decodes = False  # has a KV-cache path
    scalar_output = False  # XTransformer returns a loss

    def make(self, backend: str = "auto") -> nn.Module:
        raise NotImplementedError

    def build(self, backend: str = "auto", dtype: torch.dtype = torch.float32) -> nn.Module:
        """The module with this case's fixed weights, on ``backend``, in ``dtype``."""
        return seeded_module(lambda: self.make(backend)).to(dtype)

    def inputs(self, sc: Scenario, dtype: torch.dtype = torch.float32) -> Inputs:
        raise NotImplementedError

    def run(self, model: nn.Module, inp: Inputs) -> Tensor:
        return model(*inp.args, **inp.kwargs)

    def key_len(self, sc: Scenario, role: str) -> int:
        """How many keys the attention of ``role`` sees (0: it never reaches a kernel)."""
        return sc.j if role.endswith("cross") else sc.n

    def real(self, sc: Scenario) -> Tensor | None:
        """``(b, n)`` output rows that belong to real positions (the ones S4 compares)."""
        return sc.seq_mask

    def roles(self, model: nn.Module) -> dict[int, str]:
        raise NotImplementedError

    def dead(self, sc: Scenario) -> dict[str, Tensor]:
        """``{role: (b, i) dead queries}`` for each attention role."""
        raise NotImplementedError

    def plant(self, inp: Inputs, sc: Scenario, value: float) -> Inputs:
        """The same inputs with ``value`` (or garbage ids) at every masked position."""
        raise NotImplementedError

    def alone(self, inp: Inputs, sc: Scenario, s: int) -> Inputs:
        """Sample ``s`` alone, its padding removed."""
        raise NotImplementedError

    def decode(self, model: nn.Module, inp: Inputs, sc: Scenario, prefix: int) -> Tensor:
        """Run the first ``prefix`` positions at once, then one position per step with the KV cache."""
        raise NotImplementedError

    def bad_calls(self, model: nn.Module, inp: Inputs) -> list[tuple[str, Callable[[], object], type, str]]:
        """S9: ``(what, call, exception type, text the message must contain)``."""
        raise NotImplementedError

    def unknown_kwarg(self) -> Callable[[], object]:
        raise NotImplementedError

    def pooled(self, model: nn.Module, inp: Inputs, sc: Scenario) -> tuple[Tensor, Tensor]:
        """S8: ``(pooled (b, c), per-position outputs (b, n, c))``, the mean over real positions."""
        out = self.run(model, inp)
        return sf.masked_mean(out, sc.seq_mask, dim=1), out


def _randn(g: torch.Generator, *shape: int, dtype=torch.float32, grad: bool = True) -> Tensor:
    t = torch.randn(*shape, generator=g).to(dtype)
    return t.requires_grad_(grad)


def _plant_float(t: Tensor, where: Tensor, value: float) -> Tensor:
    """``t`` with ``value`` at positions ``where (b, n)``, as a new leaf with the same requires_grad."""
    return plant(t.detach(), where, value).requires_grad_(t.requires_grad)


def _garbage_ids(ids: Tensor, where: Tensor, g: torch.Generator) -> Tensor:
    junk = torch.randint(-(10**6), 10**6, ids.shape, generator=g)
    return torch.where(where, junk, ids)


class AttentionSelfCase(Case):
    """``Attention`` as causal self-attention with GQA, qk-norm and projection biases; the mask kills
    padded rows and padded keys: ``(b, i, j) = pad_q & pad_k`` (+ causal)."""

    name = "Attention-self"
    decodes = True

    def make(self, backend="auto"):
        return sf.Attention(DIM, heads=4, dim_head=DIM_HEAD, kv_heads=2, qk_norm=True, bias=True, backend=backend)

    @staticmethod
    def mask_of(seq_mask: Tensor) -> Tensor:
        return seq_mask[:, :, None] & seq_mask[:, None, :]  # (b, i, j)

    def inputs(self, sc, dtype=torch.float32):
        x = _randn(sc.generator(), sc.b, sc.n, DIM, dtype=dtype)
        return Inputs([x], dict(mask=self.mask_of(sc.seq_mask), causal=True), {"x": x})


    def roles(self, model):
        return {id(model): "self"}

    def dead(self, sc):
        return {"self": ~sc.seq_mask | causal_dead(sc.seq_mask)}

    def plant(self, inp, sc, value):
        x = _plant_float(inp.args[0], ~sc.seq_mask, value)
        return Inputs([x], dict(inp.kwargs), {"x": x}, {"x": ~sc.seq_mask})

    def alone(self, inp, sc, s):
        x = inp.args[0][s : s + 1, sc.seq_mask[s]]
        return Inputs([x], dict(causal=True), {"x": x})

    def decode(self, model, inp, sc, prefix):
        x, mask = inp.args[0], inp.kwargs["mask"]
        out, kv = model(x[:, :prefix], mask=mask[:, :prefix, :prefix], causal=True, return_intermediates=True)
        outs = [out]
        for t in range(prefix, sc.n):  # x-transformers' decoding: the intermediates are the cache
            out, kv = model(x[:, t : t + 1], mask=mask[:, t : t + 1, : t + 1], causal=True, cache=kv,
                            return_intermediates=True)
            outs.append(out)
        return torch.cat(outs, dim=1)

    def bad_calls(self, model, inp):
        x = inp.args[0]
        b, n = x.shape[:2]
        return [
            ("int mask", lambda: model(x, mask=torch.ones(b, n, dtype=torch.long)), TypeError, "mask"),
            ("float mask", lambda: model(x, mask=torch.ones(b, n)), TypeError, "mask"),
            ("mask of wrong shape", lambda: model(x, mask=torch.ones(b, n + 1, dtype=torch.bool)), ValueError, "mask"),
            ("mask of 5 dims", lambda: model(x, mask=torch.ones(b, 1, 1, n, n, dtype=torch.bool)), ValueError, "mask"),
            ("mask on another device", lambda: model(x, mask=torch.ones(b, n, dtype=torch.bool, device="meta")), ValueError, "mask"),
            ("context of wrong width", lambda: model(x, torch.randn(b, 3, DIM + 1)), ValueError, "context"),
        ]

    def unknown_kwarg(self):
        return lambda: sf.Attention(DIM, heads=2, dim_head=DIM_HEAD, qknorm=True)


class AttentionSelfPaddingCase(AttentionSelfCase):
    """``Attention`` alone as causal self-attention with the documented ``(b, j)`` padding mask (no
    query mask): padded positions of ``x`` are padding as queries too (their output exactly 0), so NaN
    there reaches no output and no gradient, without a stack zeroing ``x`` first."""

    name = "Attention-self-padding"

    def inputs(self, sc, dtype=torch.float32):
        x = _randn(sc.generator(), sc.b, sc.n, DIM, dtype=dtype)
        return Inputs([x], dict(mask=sc.seq_mask, causal=True), {"x": x})

    def decode(self, model, inp, sc, prefix):
        x, mask = inp.args[0], inp.kwargs["mask"]
        out, inter = model(x[:, :prefix], mask=mask[:, :prefix], causal=True, return_intermediates=True)
        outs = [out]
        for t in range(prefix, sc.n):  # the keys/values from return_intermediates, as past_kv
            out, inter = model(x[:, t : t + 1], mask=mask[:, : t + 1], causal=True, past_kv=inter.cached_kv,
                               return_intermediates=True)
            outs.append(out)
        return torch.cat(outs, dim=1)


class AttentionPastKVCase(Case):
    """``Attention`` handed keys/values by the user: ``past_kv`` (b, h_kv, p, d) with the context layout
    as its padding (garbage planted at its masked slots), then causal self-attention of new tokens."""

    name = "Attention-past-kv"

    def make(self, backend="auto"):
        return sf.Attention(DIM, heads=4, dim_head=DIM_HEAD, kv_heads=2, backend=backend)

    def _mask(self, sc: Scenario) -> Tensor:
        return torch.cat((sc.ctx_mask, sc.seq_mask), dim=1)  # (b, p + n)

    def inputs(self, sc, dtype=torch.float32):
        g = sc.generator()
        x = _randn(g, sc.b, sc.n, DIM, dtype=dtype)
        pk = _randn(g, sc.b, 2, sc.j, DIM_HEAD, dtype=dtype)
        pv = _randn(g, sc.b, 2, sc.j, DIM_HEAD, dtype=dtype)
        return Inputs([x], dict(mask=self._mask(sc), causal=True, past_kv=(pk, pv)), {"x": x, "past_k": pk, "past_v": pv})


    def key_len(self, sc, role):
        return sc.j + sc.n

    def roles(self, model):
        return {id(model): "self"}

    def dead(self, sc):
        full = self._mask(sc)
        seen = causal_dead(full)[:, sc.j:]  # bottom-right causal over p + n keys, the last n queries
        return {"self": ~sc.seq_mask | seen}

    def plant(self, inp, sc, value):
        x = _plant_float(inp.args[0], ~sc.seq_mask, value)
        pk, pv = inp.kwargs["past_kv"]
        where = (~sc.ctx_mask)[:, None, :, None].expand_as(pk)
        pk2, pv2 = _plant_float(pk, where, value), _plant_float(pv, where, value)
        kw = dict(inp.kwargs, past_kv=(pk2, pv2))
        return Inputs([x], kw, {"x": x, "past_k": pk2, "past_v": pv2},
                      {"x": ~sc.seq_mask, "past_k": where, "past_v": where})

    def alone(self, inp, sc, s):
        x = inp.args[0][s : s + 1, sc.seq_mask[s]]
        pk, pv = inp.kwargs["past_kv"]
        keep = sc.ctx_mask[s]
        return Inputs([x], dict(causal=True, past_kv=(pk[s : s + 1, :, keep], pv[s : s + 1, :, keep])), {"x": x})

    def bad_calls(self, model, inp):
        x = inp.args[0]
        pk, pv = inp.kwargs["past_kv"]
        mask = inp.kwargs["mask"]
        return [
            ("past_kv of wrong batch", lambda: model(x, mask=mask, past_kv=(pk[:1], pv[:1])), ValueError, "past_kv"),
            ("past_kv of wrong head dim", lambda: model(x, past_kv=(pk[..., :-1], pv[..., :-1])), ValueError, "past_kv"),
            ("past_kv not a pair", lambda: model(x, past_kv=pk), ValueError, "past_kv"),
            ("past_kv of another dtype", lambda: model(x, past_kv=(pk.double(), pv.double())), ValueError, "past_kv"),
            ("int mask", lambda: model(x, mask=mask.long(), past_kv=(pk, pv)), TypeError, "mask"),
        ]

    def unknown_kwarg(self):
        return lambda: sf.Attention(DIM, heads=2, dim_head=DIM_HEAD, num_kv_heads=1)


class AttentionCrossCase(Case):
    """``Attention`` as cross-attention (GQA with one key/value head); the mask is the context padding."""

    name = "Attention-cross"
    has_context = True
    decodes = True

    def make(self, backend="auto"):
        return sf.Attention(DIM, heads=HEADS, dim_head=DIM_HEAD, kv_heads=1, dim_context=CTX_DIM, backend=backend)

    def inputs(self, sc, dtype=torch.float32):
        g = sc.generator()
        x = _randn(g, sc.b, sc.n, DIM, dtype=dtype)
        ctx = _randn(g, sc.b, sc.j, CTX_DIM, dtype=dtype)
        return Inputs([x, ctx], dict(mask=sc.ctx_mask), {"x": x, "context": ctx})


    def real(self, sc):
        return torch.ones(sc.b, sc.n, dtype=torch.bool)  # the queries carry no padding here

    def roles(self, model):
        return {id(model): "cross"}

    def dead(self, sc):
        return {"cross": ctx_dead(sc.ctx_mask, sc.n)}

    def plant(self, inp, sc, value):
        x = inp.args[0].detach().clone().requires_grad_()
        ctx = _plant_float(inp.args[1], ~sc.ctx_mask, value)
        return Inputs([x, ctx], dict(inp.kwargs), {"x": x, "context": ctx}, {"context": ~sc.ctx_mask})

    def alone(self, inp, sc, s):
        x, ctx = inp.args[0][s : s + 1], inp.args[1][s : s + 1, sc.ctx_mask[s]]
        return Inputs([x, ctx], {}, {"x": x, "context": ctx})

    def decode(self, model, inp, sc, prefix):
        x, ctx = inp.args
        out, inter = model(x[:, :prefix], ctx, mask=sc.ctx_mask, return_intermediates=True)
        outs = [out]
        for t in range(prefix, sc.n):  # the context's keys/values, kept by the intermediates
            outs.append(model(x[:, t : t + 1], context_mask=sc.ctx_mask, cache=inter))
        return torch.cat(outs, dim=1)

    def bad_calls(self, model, inp):
        x, ctx = inp.args
        b, j = ctx.shape[:2]
        return [
            ("int mask", lambda: model(x, ctx, mask=torch.ones(b, j, dtype=torch.int32)), TypeError, "mask"),
            ("float mask", lambda: model(x, ctx, mask=torch.ones(b, j)), TypeError, "mask"),
            ("mask of wrong shape", lambda: model(x, ctx, mask=torch.ones(b + 1, j + 1, dtype=torch.bool)), ValueError, "mask"),
            ("mask on another device", lambda: model(x, ctx, mask=torch.ones(b, j, dtype=torch.bool, device="meta")), ValueError, "mask"),
            ("context of wrong width", lambda: model(x, torch.randn(b, j, CTX_DIM + 2)), ValueError, "context"),
        ]

    def unknown_kwarg(self):
        return lambda: sf.Attention(DIM, heads=2, dim_head=DIM_HEAD, context_dim=CTX_DIM)


class _StackCase(Case):
    """Shared by the layer stacks: ``model(x, mask=, context=, context_mask=)``."""

    causal = False
    cls: type = sf.Encoder

    def config(self) -> dict:
        raise NotImplementedError

    def make(self, backend="auto"):
        return self.cls(**self.config(), backend=backend)

    def inputs(self, sc, dtype=torch.float32):
        g = sc.generator()
        x = _randn(g, sc.b, sc.n, DIM, dtype=dtype)
        kwargs: dict = dict(mask=sc.seq_mask)
        leaves = {"x": x}
        if self.has_context:
            ctx = _randn(g, sc.b, sc.j, CTX_DIM, dtype=dtype)
            kwargs.update(context=ctx, context_mask=sc.ctx_mask)
            leaves["context"] = ctx
        return Inputs([x], kwargs, leaves)

    def roles(self, model):
        return stack_roles(model, "main")

    def dead(self, sc):
        out = {"main.self": causal_dead(sc.seq_mask) if self.causal else full_dead(sc.seq_mask)}
        if self.has_context:
            out["main.cross"] = ctx_dead(sc.ctx_mask, sc.n)
        return out

    def plant(self, inp, sc, value):
        x = _plant_float(inp.args[0], ~sc.seq_mask, value)
        kwargs, leaves, planted = dict(inp.kwargs), {"x": x}, {"x": ~sc.seq_mask}
        if self.has_context:
            kwargs["context"] = leaves["context"] = _plant_float(inp.kwargs["context"], ~sc.ctx_mask, value)
            planted["context"] = ~sc.ctx_mask
        return Inputs([x], kwargs, leaves, planted)

    def alone(self, inp, sc, s):
        x = inp.args[0][s : s + 1, sc.seq_mask[s]]
        kwargs, leaves = {}, {"x": x}
        if self.has_context:
            kwargs["context"] = leaves["context"] = inp.kwargs["context"][s : s + 1, sc.ctx_mask[s]]
        return Inputs([x], kwargs, leaves)

    def decode(self, model, inp, sc, prefix):
        x, kw = inp.args[0], inp.kwargs
        first = {k: v for k, v in kw.items() if k != "mask"}
        out, cache = model(x[:, :prefix], mask=kw["mask"][:, :prefix], return_cache=True, **first)
        outs = [out]
        for t in range(prefix, sc.n):
            out, cache = model(x[:, t : t + 1], mask=kw["mask"][:, t : t + 1], cache=cache, return_cache=True)
            outs.append(out)
        return torch.cat(outs, dim=1)

    def bad_calls(self, model, inp):
        x, kw = inp.args[0], inp.kwargs
        b, n = x.shape[:2]
        calls = [
            ("int mask", lambda: model(x, mask=torch.ones(b, n, dtype=torch.long)), TypeError, "mask"),
            ("float mask", lambda: model(x, mask=torch.ones(b, n)), TypeError, "mask"),
            ("mask of wrong shape", lambda: model(x, mask=torch.ones(b, n + 1, dtype=torch.bool)), ValueError, "mask"),
            ("(i, j) mask as padding", lambda: model(x, mask=torch.ones(n, n, dtype=torch.bool)) if b != n else model(x, mask=torch.ones(n + 1, n, dtype=torch.bool)), ValueError, "mask"),
            ("mask on another device", lambda: model(x, mask=torch.ones(b, n, dtype=torch.bool, device="meta")), ValueError, "mask"),
            ("x of wrong width", lambda: model(torch.randn(b, n, DIM + 1)), ValueError, "x"),
        ]
        if self.has_context:
            ctx, cm = kw["context"], kw["context_mask"]
            j = ctx.shape[1]
            calls += [
                ("context of wrong width", lambda: model(x, context=torch.randn(b, j, CTX_DIM + 1)), ValueError, "context"),
                ("context of wrong batch", lambda: model(x, context=torch.randn(b + 1, j, CTX_DIM)), ValueError, "context"),
                ("context_mask without context", lambda: model(x, context_mask=cm), ValueError, "context_mask"),
                ("int context_mask", lambda: model(x, context=ctx, context_mask=cm.long()), TypeError, "context_mask"),
                ("float context_mask", lambda: model(x, context=ctx, context_mask=cm.float()), TypeError, "context_mask"),
                ("context_mask of wrong shape", lambda: model(x, context=ctx, context_mask=torch.ones(b, j + 1, dtype=torch.bool)), ValueError, "context_mask"),
            ]
        else:
            calls.append(("context without cross-attention", lambda: model(x, context=torch.randn(b, 2, DIM)), ValueError, "context"))
        return calls

    def unknown_kwarg(self):
        return lambda: self.cls(**self.config(), rotary_emb=True)


class EncoderCase(_StackCase):
    """``Encoder`` with ALiBi and RMSNorm."""

    name = "Encoder"
    cls = sf.Encoder

    def config(self):
        return dict(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, alibi_pos_bias=True, use_rmsnorm=True)


class DecoderCase(_StackCase):
    """``Decoder`` with cross-attention, rotary positions, GQA and GEGLU."""

    name = "Decoder"
    cls = sf.Decoder
    causal = True
    has_context = True
    decodes = True

    def config(self):
        return dict(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, kv_heads=1, cross_attend=True,
                    dim_context=CTX_DIM, rotary_pos_emb=True, ff_glu=True)


class CrossAttenderCase(_StackCase):
    """``CrossAttender`` with qk-norm and SwiGLU; ``mask`` only marks padded queries."""

    name = "CrossAttender"
    cls = sf.CrossAttender
    has_context = True
    decodes = True

    def config(self):
        return dict(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, dim_context=CTX_DIM, attn_qk_norm=True,
                    ff_glu=True, ff_swish=True)

    def dead(self, sc):
        return {"main.cross": ctx_dead(sc.ctx_mask, sc.n)}

    def decode(self, model, inp, sc, prefix):
        # a CrossAttender's queries are independent: the cache only keeps the context's keys/values
        x, kw = inp.args[0], inp.kwargs
        out, cache = model(x[:, :prefix], mask=kw["mask"][:, :prefix], context=kw["context"],
                           context_mask=kw["context_mask"], return_cache=True)
        outs = [out]
        for t in range(prefix, sc.n):
            outs.append(model(x[:, t : t + 1], mask=kw["mask"][:, t : t + 1], cache=cache))
        return torch.cat(outs, dim=1)

    def bad_calls(self, model, inp):
        x = inp.args[0]
        calls = super().bad_calls(model, inp)
        calls.append(("no context", lambda: model(x), ValueError, "context"))
        return calls


class _TokenCase(_StackCase):
    """A ``TransformerWrapper`` case: token ids (garbage ids at padded positions) and one float input
    ``kwargs[side]`` (the leaf ``leaf``) laid out as the context (garbage at its masked positions)."""

    side = leaf = "context"
    alone_kwargs: dict = {}

    def plant(self, inp, sc, value):
        ids = _garbage_ids(inp.args[0], ~sc.seq_mask, sc.generator())
        side = _plant_float(inp.kwargs[self.side], ~sc.ctx_mask, value)
        return Inputs([ids], {**inp.kwargs, self.side: side}, {self.leaf: side}, {self.leaf: ~sc.ctx_mask})

    def alone(self, inp, sc, s):
        ids = inp.args[0][s : s + 1, sc.seq_mask[s]]
        side = inp.kwargs[self.side][s : s + 1, sc.ctx_mask[s]]
        return Inputs([ids], {self.side: side, **self.alone_kwargs}, {self.leaf: side})


class TransformerWrapperCase(_TokenCase):
    """``TransformerWrapper`` over a cross-attending ``Decoder`` with absolute positions."""

    name = "TransformerWrapper"
    has_context = True
    causal = True
    decodes = True

    def make(self, backend="auto"):
        return sf.TransformerWrapper(
            num_tokens=VOCAB, max_seq_len=MAX_SEQ,
            attn_layers=sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, cross_attend=True,
                                   dim_context=CTX_DIM, backend=backend),
        )

    def roles(self, model):
        return stack_roles(model.attn_layers, "main")

    def inputs(self, sc, dtype=torch.float32):
        g = sc.generator()
        ids = torch.randint(0, VOCAB, (sc.b, sc.n), generator=g)
        ctx = _randn(g, sc.b, sc.j, CTX_DIM, dtype=dtype)
        return Inputs([ids], dict(mask=sc.seq_mask, context=ctx, context_mask=sc.ctx_mask), {"context": ctx})

    def bad_calls(self, model, inp):
        ids, kw = inp.args[0], inp.kwargs
        b, n = ids.shape
        ctx, cm = kw["context"], kw["context_mask"]
        j = ctx.shape[1]
        nan_ctx = ctx.detach().clone()
        real = cm.nonzero()
        if len(real):
            nan_ctx[real[0][0], real[0][1], 0] = NAN
        else:  # no real context position: make one
            cm = torch.ones_like(cm)
            nan_ctx[:, :, 0] = NAN
        calls = [
            ("int mask", lambda: model(ids, mask=torch.ones(b, n, dtype=torch.long)), TypeError, "mask"),
            ("float mask", lambda: model(ids, mask=torch.ones(b, n)), TypeError, "mask"),
            ("mask of wrong shape", lambda: model(ids, mask=torch.ones(b, n + 1, dtype=torch.bool)), ValueError, "mask"),
            ("mask on another device", lambda: model(ids, mask=torch.ones(b, n, dtype=torch.bool, device="meta")), ValueError, "mask"),
            ("float token ids that are not whole numbers", lambda: model(ids.float() + 0.5), TypeError, "x"),
            ("context of wrong width", lambda: model(ids, context=torch.randn(b, j, CTX_DIM + 1)), ValueError, "context"),
            ("context_mask without context", lambda: model(ids, context_mask=kw["context_mask"]), ValueError, "context_mask"),
            ("int context_mask", lambda: model(ids, context=ctx, context_mask=kw["context_mask"].long()), TypeError, "context_mask"),
            ("context_mask of wrong shape", lambda: model(ids, context=ctx, context_mask=torch.ones(b, j + 1, dtype=torch.bool)), ValueError, "context_mask"),
            ("NaN in a real context position, check_finite=True",
             lambda: model(ids, context=nan_ctx, context_mask=cm, check_finite=True), ValueError, "context"),
        ]
        if len(real) and j > 0:
            calls.append(("NaN in a real context position, no mask, check_finite=True",
                          lambda: model(ids, context=nan_ctx, check_finite=True), ValueError, "context"))
        return calls

    def unknown_kwarg(self):
        return lambda: sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=MAX_SEQ, attn_layers=sf.Encoder(dim=DIM, depth=1), embed_dim=8)

    def pooled(self, model, inp, sc):
        pooled = model(*inp.args, **inp.kwargs, return_pooled=True)
        return pooled, model(*inp.args, **inp.kwargs, return_embeddings=True)


class PrefixWrapperCase(_TokenCase):
    """``TransformerWrapper`` over a rotary ``Decoder`` conditioned by a prefix: ``prepend_embeds (b, j, c)``
    with the context layout as its ``prepend_mask`` (all-False rows: no prefix; holes; zero length).
    Outputs are the tokens' (``excise_prepend_embeds=True``)."""

    name = "TransformerWrapper-prefix"
    causal = True
    decodes = True
    side, leaf, alone_kwargs = "prepend_embeds", "prefix", {"excise_prepend_embeds": True}

    def make(self, backend="auto"):
        return sf.TransformerWrapper(
            num_tokens=VOCAB, max_seq_len=MAX_SEQ,
            attn_layers=sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, rotary_pos_emb=True, backend=backend),
        )

    def roles(self, model):
        return stack_roles(model.attn_layers, "main")

    def dead(self, sc):
        return {"main.self": causal_dead(torch.cat((sc.ctx_mask, sc.seq_mask), dim=1))}

    def key_len(self, sc, role):
        return sc.j + sc.n

    def inputs(self, sc, dtype=torch.float32):
        g = sc.generator()
        ids = torch.randint(0, VOCAB, (sc.b, sc.n), generator=g)
        pre = _randn(g, sc.b, sc.j, DIM, dtype=dtype)
        kw = dict(mask=sc.seq_mask, prepend_embeds=pre, prepend_mask=sc.ctx_mask, excise_prepend_embeds=True)
        return Inputs([ids], kw, {"prefix": pre})

    def bad_calls(self, model, inp):
        ids, kw = inp.args[0], inp.kwargs
        pre, pm = kw["prepend_embeds"], kw["prepend_mask"]
        b, m = pm.shape
        _, cache = model(ids, prepend_embeds=pre, prepend_mask=pm, return_cache=True)
        return [
            ("prepend_mask without prepend_embeds", lambda: model(ids, prepend_mask=pm), ValueError, "prepend_mask"),
            ("prefix of wrong width", lambda: model(ids, prepend_embeds=torch.randn(b, m, DIM + 1)), ValueError, "prepend_embeds"),
            ("int prepend_mask", lambda: model(ids, prepend_embeds=pre, prepend_mask=pm.long()), TypeError, "prepend_mask"),
            ("prepend_mask of wrong shape", lambda: model(ids, prepend_embeds=pre, prepend_mask=pm[:, :-1] if m else torch.ones(b, 1, dtype=torch.bool)), ValueError, "prepend_mask"),
            ("a prefix with a cache", lambda: model(ids[:, :1], prepend_embeds=pre, cache=cache), ValueError, "prepend_embeds"),
            ("integer prefix", lambda: model(ids, prepend_embeds=torch.ones(b, m, DIM, dtype=torch.long)), TypeError, "prepend_embeds"),
        ]

    def unknown_kwarg(self):
        return lambda: sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=MAX_SEQ, attn_layers=sf.Decoder(dim=DIM, depth=1), prepend_dim=3)

    def pooled(self, model, inp, sc):
        kw = dict(inp.kwargs)
        kw["prepend_mask"] = torch.zeros_like(kw["prepend_mask"])  # pooled over the tokens only
        pooled = model(*inp.args, **kw, return_pooled=True)
        return pooled, model(*inp.args, **kw, return_embeddings=True)


class AdaptiveDecoderCase(DecoderCase):
    """``Decoder`` with adaptive LayerNorm and adaptive layerscale driven by ``condition (b, K)``, beside
    its cross-attention; samples whose context is empty also have their condition dropped
    (``condition_mask`` False), and their condition rows hold garbage."""

    name = "Decoder-adaptive"
    K = 5

    def config(self):
        return dict(super().config(), use_adaptive_layernorm=True, use_adaptive_layerscale=True, dim_condition=self.K,
                    adaptive_null="learned")

    def build(self, backend="auto", dtype=torch.float32):
        model = super().build(backend, dtype)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():  # adaptive projections start at 0: make them matter
            for mod in model.modules():
                if isinstance(mod, (sf.nn.modules.AdaptiveNorm, sf.nn.block.AdaptiveLayerScale)):
                    for p in mod.parameters():
                        p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            model.null_condition.copy_(torch.randn(self.K, generator=g))
        return model

    @staticmethod
    def cond_mask(sc: Scenario) -> Tensor:
        return sc.ctx_mask.any(1) if sc.j else torch.zeros(sc.b, dtype=torch.bool)

    def inputs(self, sc, dtype=torch.float32):
        inp = super().inputs(sc, dtype)
        cond = _randn(torch.Generator().manual_seed(sc.seed + 99), sc.b, self.K, dtype=dtype)
        inp.kwargs.update(condition=cond, condition_mask=self.cond_mask(sc))
        inp.leaves["condition"] = cond
        return inp

    def plant(self, inp, sc, value):
        out = super().plant(inp, sc, value)
        dropped = ~self.cond_mask(sc)
        cond = _plant_float(inp.kwargs["condition"], dropped, value)
        out.kwargs["condition"] = out.leaves["condition"] = cond
        out.planted["condition"] = dropped
        return out

    def alone(self, inp, sc, s):
        out = super().alone(inp, sc, s)
        out.kwargs.update(condition=inp.kwargs["condition"][s : s + 1], condition_mask=self.cond_mask(sc)[s : s + 1])
        return out

    def bad_calls(self, model, inp):
        x, kw = inp.args[0], inp.kwargs
        cond, cm = kw["condition"], kw["condition_mask"]
        b = x.shape[0]
        calls = [
            ("condition of wrong width", lambda: model(x, condition=torch.randn(b, self.K + 1)), ValueError, "condition"),
            ("condition_mask without condition", lambda: model(x, condition_mask=cm), ValueError, "condition_mask"),
            ("int condition_mask", lambda: model(x, condition=cond, condition_mask=cm.long()), TypeError, "condition_mask"),
            ("condition_mask of wrong shape", lambda: model(x, condition=cond, condition_mask=cm[:-1]), ValueError, "condition_mask"),
            ("integer condition", lambda: model(x, condition=torch.ones(b, self.K, dtype=torch.long)), TypeError, "condition"),
        ]
        return calls + [c for c in super().bad_calls(model, inp) if "context" in c[0] or "mask" in c[0]]

    def unknown_kwarg(self):
        return lambda: sf.Decoder(dim=DIM, depth=1, use_adaptive_layernorm=True, dim_condtion=3)


class ContinuousWrapperCase(_StackCase):
    """``ContinuousTransformerWrapper`` over a cross-attending ``Encoder`` with projection biases."""

    name = "ContinuousTransformerWrapper"
    has_context = True
    DIM_IN, DIM_OUT = 5, 7

    def make(self, backend="auto"):
        return sf.ContinuousTransformerWrapper(
            dim_in=self.DIM_IN, dim_out=self.DIM_OUT, max_seq_len=MAX_SEQ,
            attn_layers=sf.Encoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, cross_attend=True,
                                   dim_context=CTX_DIM, attn_bias=True, backend=backend),
        )

    def roles(self, model):
        return stack_roles(model.attn_layers, "main")

    def inputs(self, sc, dtype=torch.float32):
        g = sc.generator()
        x = _randn(g, sc.b, sc.n, self.DIM_IN, dtype=dtype)
        ctx = _randn(g, sc.b, sc.j, CTX_DIM, dtype=dtype)
        return Inputs([x], dict(mask=sc.seq_mask, context=ctx, context_mask=sc.ctx_mask), {"x": x, "context": ctx})

    def bad_calls(self, model, inp):
        x, kw = inp.args[0], inp.kwargs
        b, n = x.shape[:2]
        ctx, cm = kw["context"], kw["context_mask"]
        j = ctx.shape[1]
        nan_x = x.detach().clone()
        nan_x[0, 0, 0] = NAN
        all_real = torch.ones(b, n, dtype=torch.bool)
        nan_ctx = ctx.detach().clone()
        if j:
            nan_ctx[0, 0, 1] = INF
        ctx_real = torch.ones(b, j, dtype=torch.bool)
        calls = [
            ("int mask", lambda: model(x, mask=torch.ones(b, n, dtype=torch.uint8)), TypeError, "mask"),
            ("float mask", lambda: model(x, mask=torch.ones(b, n)), TypeError, "mask"),
            ("mask of wrong shape", lambda: model(x, mask=torch.ones(b, n - 1, dtype=torch.bool)), ValueError, "mask"),
            ("mask on another device", lambda: model(x, mask=torch.ones(b, n, dtype=torch.bool, device="meta")), ValueError, "mask"),
            ("x of wrong width", lambda: model(torch.randn(b, n, self.DIM_IN + 1)), ValueError, "x"),
            ("integer x", lambda: model(torch.ones(b, n, self.DIM_IN, dtype=torch.long)), TypeError, "x"),
            ("context of wrong width", lambda: model(x, context=torch.randn(b, j, CTX_DIM - 1)), ValueError, "context"),
            ("context_mask without context", lambda: model(x, context_mask=cm), ValueError, "context_mask"),
            ("int context_mask", lambda: model(x, context=ctx, context_mask=cm.int()), TypeError, "context_mask"),
            ("NaN in a real x position, check_finite=True", lambda: model(nan_x, mask=all_real, check_finite=True), ValueError, "x"),
        ]
        if j:
            calls.append(("inf in a real context position, check_finite=True",
                          lambda: model(x, context=nan_ctx, context_mask=ctx_real, check_finite=True), ValueError, "context"))
        return calls

    def unknown_kwarg(self):
        return lambda: sf.ContinuousTransformerWrapper(max_seq_len=MAX_SEQ, attn_layers=sf.Encoder(dim=DIM, depth=1), dim_input=3)

    def pooled(self, model, inp, sc):
        pooled = model(*inp.args, **inp.kwargs, return_pooled=True)
        return pooled, model(*inp.args, **inp.kwargs, return_embeddings=True)


class XTransformerCase(Case):
    """``XTransformer``: source = the context layout (``ctx_mask``), target = the sequence layout.

    Its output is the loss (a scalar); S4 compares the summed per-token losses of samples alone.
    Targets are right-padded through ``tgt_mask`` (left-padded targets: see test_wrappers.py).
    """

    name = "XTransformer"
    has_context = True
    decodes = True
    scalar_output = True
    SRC_VOCAB, TGT_VOCAB = 11, 13

    def make(self, backend="auto"):
        model = sf.XTransformer(dim=DIM, enc_num_tokens=self.SRC_VOCAB, enc_max_seq_len=MAX_SEQ,
                                dec_num_tokens=self.TGT_VOCAB, dec_max_seq_len=MAX_SEQ, enc_depth=1, dec_depth=1,
                                enc_heads=HEADS, dec_heads=HEADS, dim_head=DIM_HEAD, kv_heads=1)
        return set_backend(model, backend)  # XTransformer takes no backend argument

    @staticmethod
    def tgt_mask(sc: Scenario) -> Tensor:
        """The sequence layout right-aligned: each sample keeps its number of real tokens, at the start."""
        lengths = sc.seq_mask.sum(1)
        return sf.padding_mask(lengths, sc.n)

    def inputs(self, sc, dtype=torch.float32):
        g = sc.generator()
        src = torch.randint(0, self.SRC_VOCAB, (sc.b, sc.j), generator=g)
        tgt = torch.randint(0, self.TGT_VOCAB, (sc.b, sc.n), generator=g)
        return Inputs([src, tgt], dict(mask=sc.ctx_mask, tgt_mask=self.tgt_mask(sc)), {})

    def real(self, sc):
        return None

    def roles(self, model):
        return {**stack_roles(model.encoder.attn_layers, "enc"), **stack_roles(model.decoder.net.attn_layers, "dec")}

    def dead(self, sc):
        inp_mask = self.tgt_mask(sc)[:, :-1]
        return {
            "enc.self": full_dead(sc.ctx_mask),
            "dec.self": causal_dead(inp_mask),
            "dec.cross": ctx_dead(sc.ctx_mask, max(sc.n - 1, 0)),
        }

    def key_len(self, sc, role):
        return sc.n - 1 if role == "dec.self" else sc.j

    def plant(self, inp, sc, value):
        g = sc.generator()
        src = _garbage_ids(inp.args[0], ~sc.ctx_mask, g)
        tgt = _garbage_ids(inp.args[1], ~inp.kwargs["tgt_mask"], g)
        return Inputs([src, tgt], dict(inp.kwargs), {})

    def alone(self, inp, sc, s):
        src = inp.args[0][s : s + 1, sc.ctx_mask[s]]
        tgt = inp.args[1][s : s + 1, inp.kwargs["tgt_mask"][s]]
        return Inputs([src, tgt], {}, {})

    def decode(self, model, inp, sc, prefix):
        """Decoder logits ``(b, n, v)`` with the encoded source cached, step by step."""
        src, tgt = inp.args
        mask, tgt_mask = inp.kwargs["mask"], inp.kwargs["tgt_mask"]
        enc = model.encode(src, mask)
        out, cache = model.decoder.net(tgt[:, :prefix], mask=tgt_mask[:, :prefix], context=enc, context_mask=mask,
                                   return_cache=True)
        outs = [out]
        for t in range(prefix, sc.n):
            out, cache = model.decoder.net(tgt[:, t : t + 1], mask=tgt_mask[:, t : t + 1], cache=cache, return_cache=True)
            outs.append(out)
        return torch.cat(outs, dim=1)

    def full_logits(self, model, inp) -> Tensor:
        src, tgt = inp.args
        mask, tgt_mask = inp.kwargs["mask"], inp.kwargs["tgt_mask"]
        return model.decoder.net(tgt, mask=tgt_mask, context=model.encode(src, mask), context_mask=mask)

    def bad_calls(self, model, inp):
        src, tgt = inp.args
        mask = inp.kwargs["mask"]
        b, j = src.shape
        return [
            ("int source mask", lambda: model(src, tgt, mask=mask.long()), TypeError, "mask"),
            ("float source mask", lambda: model(src, tgt, mask=mask.float()), TypeError, "mask"),
            ("source mask of wrong shape", lambda: model(src, tgt, mask=torch.ones(b, j + 1, dtype=torch.bool)), ValueError, "mask"),
            ("source mask on another device", lambda: model(src, tgt, mask=torch.ones(b, j, dtype=torch.bool, device="meta")), ValueError, "mask"),
        ]  # errors about src, tgt and tgt_mask: test_wrappers.py (they name the wrong argument)

    def unknown_kwarg(self):
        return lambda: sf.XTransformer(dim=DIM, enc_num_tokens=5, enc_max_seq_len=4, dec_num_tokens=5,
                                       dec_max_seq_len=4, enc_layers=1)


class UnpaddedCase:
    """The same case run with ``AttentionLayers(unpadded=True)``: norms, projections, feed-forward and the
    output head on the real tokens only (the padded path is the base case's; ``set_unpadded``)."""

    unpadded = True

    def __init__(self, base: Case):
        self.base = base
        self.name = f"{base.name}-unpadded"

    def __getattr__(self, item):
        return getattr(self.base, item)

    def dead(self, sc):
        """Self-attention hands no kernel a dead row on this path (real tokens, compacted: each sees
        itself; padded positions are not computed); cross-attention keeps the padded query layout."""
        return {role: rows for role, rows in self.base.dead(sc).items() if not role.endswith(".self")}


def _no_dead(sc: Scenario, rows: int) -> Tensor:
    return torch.zeros(sc.b, rows, dtype=torch.bool)


def _nonzero_sinks(model: nn.Module) -> nn.Module:
    """Learned sinks start at 0; give them values, so that the sink's logit matters in every test."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, sf.Attention) and m.head_attn_sink is not None:
                m.head_attn_sink.copy_(torch.linspace(-1.0, 1.0, m.heads))
    return model


class AttentionMemKVCase(AttentionSelfPaddingCase):
    """``Attention`` alone (causal, ``(b, j)`` padding) with memory key/values and a learned sink
    (x-transformers' ``attn_num_mem_kv``, ``attn_head_learned_sink``): every query sees the memory
    keys, so no real row is dead; padded positions of ``x`` are still padding (output exactly 0)."""

    name = "Attention-memkv-sink"

    def make(self, backend="auto"):
        return _nonzero_sinks(sf.Attention(DIM, heads=4, dim_head=DIM_HEAD, kv_heads=2, qk_norm=True, bias=True,
                                           backend=backend, num_mem_kv=2, learned_sink=True))

    def dead(self, sc):
        return {"self": ~sc.seq_mask}  # padding; a left-padded real query is never dead here

    def unknown_kwarg(self):
        return lambda: sf.Attention(DIM, heads=2, dim_head=DIM_HEAD, num_mem_k=2)


class DecoderMemKVCase(DecoderCase):
    """``Decoder`` with cross-attention, memory key/values and learned sinks in every attention: no row
    is ever dead (a dropped context leaves the memory keys), and that must still be exact."""

    name = "Decoder-memkv-sink"
    memory_keys = True

    def config(self):
        return dict(super().config(), attn_num_mem_kv=2, attn_head_learned_sink=True)

    def make(self, backend="auto"):
        return _nonzero_sinks(super().make(backend))

    def dead(self, sc):
        return {"main.self": _no_dead(sc, sc.n), "main.cross": _no_dead(sc, sc.n)}


class DecoderSinkBiasCase(DecoderCase):
    """``Decoder`` with learned sinks and projection biases (``attn_bias``), no memory keys: a query whose
    only key is the sink is a dead row (its output, bias included, exactly 0), so a dropped or zero-length
    context is still an exact no-op."""

    name = "Decoder-sink-bias"

    def config(self):
        return dict(super().config(), attn_head_learned_sink=True, attn_bias=True)

    def make(self, backend="auto"):
        return _nonzero_sinks(super().make(backend))


def _nonzero_gates(model: nn.Module) -> nn.Module:
    """Gate projections start at zero; move them, so that the gates vary by position and head."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, sf.Attention):
                for gate in (m.to_v_gate, m.to_output_gate):
                    for p in ([] if gate is None else gate.parameters()):
                        p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


class DecoderGatedCase(DecoderCase):
    """``Decoder`` with cross-attention and gated attention (x-transformers' low-rank ``attn_gate_values`` per
    feature and ``attn_output_gate`` per head, ``attn_swiglu_values``, projection biases): the gates read
    the queries' input and the attention output, so padded queries must stay selected away and a dropped
    context an exact no-op (a dead row's output is 0 before the gate)."""

    name = "Decoder-gated"

    def config(self):
        return dict(super().config(), attn_gate_values=True, attn_gate_values_rank=4, attn_output_gate=True,
                    attn_output_gate_headwise=True, attn_swiglu_values=True, attn_bias=True)

    def make(self, backend="auto"):
        return _nonzero_gates(super().make(backend))


def _nonzero_head_gains(model: nn.Module) -> nn.Module:
    """Per-head q/k and value norm gains start uniform; move them, so that every head differs."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, sf.Attention):  # qk_norm_q_scale / qk_norm_k_scale, value_rmsnorm.gamma
                gains = (m.qk_norm_q_scale, m.qk_norm_k_scale, None if m.v_norm is None else m.v_norm.gamma)
                for gain in gains:
                    if gain is not None:
                        gain.add_(0.3 * torch.randn(gain.shape, generator=g, dtype=gain.dtype))
    return model


class DecoderHeadNormsCase(DecoderCase):
    """``Decoder`` with cross-attention, x-transformers' ``attn_qk_norm_dim_scale`` (per-head q/k gains),
    ``attn_value_rmsnorm`` (per-head value norms) and projection biases: a padded or masked position's
    value is the norm of the bias, never of what it held, and a dropped context stays an exact no-op."""

    name = "Decoder-headnorms"

    def config(self):
        return dict(super().config(), attn_qk_norm=True, attn_qk_norm_dim_scale=True, attn_value_rmsnorm=True,
                    attn_bias=True)

    def make(self, backend="auto"):
        return _nonzero_head_gains(super().make(backend))


class EncoderOrthogCase(EncoderCase):
    """``Encoder`` with x-transformers' ``attn_orthog_projected_values`` and ``_per_head`` (the output minus
    its projection onto the sequence's own values, over the whole sample) and projection biases: padded
    positions (whose value would be the bias) add nothing to the projection, so a sample alone equals it
    padded in a batch, and NaN planted there reaches nothing. No KV cache (refused), padded path only."""

    name = "Encoder-orthog"

    def config(self):
        return dict(super().config(), attn_orthog_projected_values=True, attn_orthog_projected_values_per_head=True,
                    attn_bias=True)


class DecoderValueResidualCase(DecoderCase):
    """``Decoder`` with cross-attention and x-transformers' ``add_value_residual`` (learned mix): every later
    attention mixes the first one's values of the same positions into its own, so masked slots of the
    first attention must stay out of every later one, cached decoding included, and a dropped context an
    exact no-op. Padded path only."""

    name = "Decoder-value-residual"

    def config(self):
        return dict(super().config(), depth=3, kv_heads=HEADS, add_value_residual=True, attn_bias=True)


class EncoderForgetCase(EncoderCase):
    """``Encoder`` with x-transformers' ``attn_data_dependent_alibi`` (forgetting transformer, both directions)
    instead of ALiBi, and projection biases: the forget gates are summed over the positions between query and
    key, so padded positions (whose gate would be the bias) must add nothing, and NaN planted there must
    reach neither the bias nor a gradient. No KV cache (refused), padded path only."""

    name = "Encoder-forget"

    def config(self):
        return dict(super().config(), alibi_pos_bias=False, attn_data_dependent_alibi=True,
                    attn_data_dependent_alibi_kwargs=dict(bias_init=1.0), attn_bias=True)


class MemoryTokensWrapperCase(TransformerWrapperCase):
    """``TransformerWrapper`` with memory tokens (x-transformers' ``num_memory_tokens``) before the
    sequence: the attention sees ``M + n`` rows; left-padded queries see the memory tokens (not dead);
    every row of a sample whose context is dropped is dead in cross-attention."""

    name = "TransformerWrapper-memory"
    M = 2

    def make(self, backend="auto"):
        return sf.TransformerWrapper(
            num_tokens=VOCAB, max_seq_len=MAX_SEQ, num_memory_tokens=self.M,
            attn_layers=sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, cross_attend=True,
                                   dim_context=CTX_DIM, rotary_pos_emb=True, backend=backend),
        )

    def key_len(self, sc, role):
        return sc.j if role.endswith("cross") else sc.n + self.M

    def dead(self, sc):
        return {"main.self": _no_dead(sc, sc.n + self.M), "main.cross": ctx_dead(sc.ctx_mask, sc.n + self.M)}


class SoftclampWrapperCase(TransformerWrapperCase):
    """``TransformerWrapper`` with x-transformers' ``l2norm_embed``, a tied head with
    ``tie_embedding_scale`` and ``attn_softclamp_logits`` in every attention: attention runs the explicit
    float32 path (no fused kernel), which must keep dead rows exactly 0 and masked slots out by itself."""

    name = "TransformerWrapper-softclamp-l2norm"
    explicit_attention = True  # no kernel call: the kernel-substitution clauses (S6, S7's scaling) do not apply

    def make(self, backend="auto"):
        return sf.TransformerWrapper(
            num_tokens=VOCAB, max_seq_len=MAX_SEQ, l2norm_embed=True, tie_embedding=True, tie_embedding_scale=0.5,
            attn_layers=sf.Decoder(dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, cross_attend=True,
                                   dim_context=CTX_DIM, attn_softclamp_logits=True, attn_logit_softclamp_value=5.0,
                                   backend=backend),
        )


CASES: list[Case] = [
    AttentionSelfCase(), AttentionSelfPaddingCase(), AttentionPastKVCase(), AttentionCrossCase(), EncoderCase(), DecoderCase(), CrossAttenderCase(),
    TransformerWrapperCase(), PrefixWrapperCase(), AdaptiveDecoderCase(), ContinuousWrapperCase(), XTransformerCase(),
    AttentionMemKVCase(), DecoderMemKVCase(), DecoderSinkBiasCase(), MemoryTokensWrapperCase(), SoftclampWrapperCase(),
    DecoderGatedCase(), DecoderHeadNormsCase(), EncoderOrthogCase(), DecoderValueResidualCase(),
    EncoderForgetCase(),
]
# more x-transformers options' cases, one file per family (each subclasses the cases above)
from .cases_attention import CASES as _ATTENTION_CASES  # noqa: E402
from .cases_modules import CASES as _MODULE_CASES  # noqa: E402
from .cases_residuals import CASES as _RESIDUAL_CASES  # noqa: E402
from .cases_stack import CASES as _STACK_CASES  # noqa: E402
from .cases_wrappers import CASES as _WRAPPER_CASES  # noqa: E402

CASES += _ATTENTION_CASES + _MODULE_CASES + _STACK_CASES + _RESIDUAL_CASES + _WRAPPER_CASES
# every case with a layer stack, again on the unpadded path (real tokens only); memory keys and sinks
# run on the padded path only (the stack refuses unpadded=True with them; such a case sets padded_only)
UNPADDED_CASES = [UnpaddedCase(c) for c in CASES
                  if not c.name.startswith("Attention-") and not getattr(c, "padded_only", False)
                  and c.name not in ("Decoder-memkv-sink", "Decoder-sink-bias", "TransformerWrapper-softclamp-l2norm",
                                     "Encoder-orthog", "Decoder-value-residual", "Encoder-forget")]
ALL_CASES = CASES + UNPADDED_CASES

# the core set: one case per public door (and the stack's unpadded path once), run in the quick tier; the
# option cases run in the full tier (tests/conftest.py reads ``case.core``)
CORE_CASES = ("Attention-self", "Attention-self-padding", "Attention-past-kv", "Attention-cross", "Encoder", "Decoder",
              "CrossAttender", "TransformerWrapper", "TransformerWrapper-prefix", "Decoder-adaptive",
              "ContinuousTransformerWrapper", "XTransformer", "TransformerWrapper-memory",
              "Decoder-unpadded", "TransformerWrapper-unpadded")
for _case in ALL_CASES:
    _case.core = _case.name in CORE_CASES

