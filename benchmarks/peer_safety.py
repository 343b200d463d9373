"""Peer safety comparison: the same adversarial masks against safeformer, x-transformers and torch.nn.

Every library runs the same small job: a causal decoder over token ids that cross-attends to a
context (one layer: self-attention, cross-attention, feed-forward; pre-norm). The libraries:

  safeformer             TransformerWrapper(Decoder(cross_attend=True))
  xt flash / xt no-flash x-transformers TransformerWrapper(Decoder(cross_attend=True, attn_flash=...))
  torch MHA              a decoder built by hand from two nn.MultiheadAttention (self, cross),
                         called with need_weights=False except in case 7
  torch TransformerDecoder
                         nn.TransformerDecoder(nn.TransformerDecoderLayer(norm_first=True)), with
                         tgt_mask (causal), tgt_key_padding_mask and memory_key_padding_mask

The cases (masks in each library's own convention; torch's True = ignore is converted):

  1 all-padding context     sample 1's context_mask is all False (CFG's dropped condition)
  2 left padding + causal   sample 0 has 3 left-padded tokens: its first 3 rows see no real key
  3 zero-length context     context of shape (b, 0, c)
  4 NaN/inf in padded ctx   padded context positions hold NaN, +inf, -inf
  5 all targets ignored     next-token loss whose every target is ignore_index (each library's loss:
                            safeformer.safe_cross_entropy, x-transformers' AutoregressiveWrapper,
                            torch's F.cross_entropy)
  6 float16, max q.k = 1e4  the model in float16 (model.half()), its self-attention q/k projections
                            scaled so that the largest attention logit (q.k * d^-0.5, measured in
                            float32 before the cast) is 1e4; padding in tokens and context
  6b ... autocast           the same with float32 weights under torch.autocast(dtype=float16)
  7 MHA need_weights=True   case 1 with nn.MultiheadAttention's default need_weights=True (MHA only)

What is recorded, per case and library (what happens, as measured; an exception is "error"):

  out      outputs at real positions finite? (and whether padded positions were non-finite)
  grads    gradients of every parameter and of the context finite? (backward of a fixed random
           weighting of the outputs at real positions only)
  dead=0   the attention block's output (after its output projection) exactly 0 on dead rows?
           (read with a forward hook on the self- or cross-attention module)
  leak     do outputs at real positions change when only masked content changes (other values in
           padded context positions / padded tokens, or NaN/inf in case 4)? "no" = bitwise equal

Usage:
    python benchmarks/peer_safety.py                 # CPU, a few seconds
    python benchmarks/peer_safety.py --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import math
import os
import platform
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import safeformer
from safeformer import Decoder, TransformerWrapper, safe_cross_entropy

RESULTS = Path(__file__).resolve().parent / "results" / "peer_safety.md"
V, D, H, B, N, J, MAX_LEN = 50, 32, 4, 3, 6, 5, 16
IGNORE = -100
NOTES: dict[str, list[str]] = {}  # per case, measured facts printed under the table


# ----------------------------------------------------------------------------------------------------
# The libraries, behind one interface
# ----------------------------------------------------------------------------------------------------


class Lib:
    """One library's decoder. ``forward`` takes safeformer-convention masks (True = real)."""

    name = "?"
    need_weights = False

    def __init__(self, device: torch.device):
        self.device = device
        torch.manual_seed(0)
        model = self.build()
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # move every weight off its init, as training would (biases init at 0 included)
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        self.model = model.to(device).train()

    def build(self) -> nn.Module:
        raise NotImplementedError

    def forward(self, tokens: Tensor, mask: Tensor, context: Tensor, context_mask: Tensor) -> Tensor:
        raise NotImplementedError

    def attention_modules(self) -> dict[str, nn.Module]:
        """``{"self": module, "cross": module}``; their first output is the block's output."""
        raise NotImplementedError

    def qk(self) -> tuple[nn.Module, Callable[[], list[Tensor]]]:
        """The self-attention module, and the q/k weights and biases (``[wq, bq, wk, bk]``, None allowed)."""
        raise NotImplementedError

    def loss_all_ignored(self, tokens: Tensor, context: Tensor, context_mask: Tensor) -> Tensor:
        logits = self.forward(tokens, torch.ones_like(tokens, dtype=torch.bool), context, context_mask)
        target = torch.full_like(tokens, IGNORE)
        return F.cross_entropy(logits.transpose(1, 2), target, ignore_index=IGNORE)


class SafeformerLib(Lib):
    name = "safeformer"

    def build(self):
        return TransformerWrapper(num_tokens=V, max_seq_len=MAX_LEN,
                                  attn_layers=Decoder(dim=D, depth=1, heads=H, dim_head=D // H, cross_attend=True))

    def forward(self, tokens, mask, context, context_mask):
        return self.model(tokens, mask=mask, context=context, context_mask=context_mask)

    def attention_modules(self):
        kinds = self.model.attn_layers.layer_kinds
        layers = self.model.attn_layers.layers
        return {"self": layers[kinds.index("self")][1], "cross": layers[kinds.index("cross")][1]}

    def qk(self):
        attn = self.attention_modules()["self"]
        return attn, lambda: [attn.to_q.weight, attn.to_q.bias, attn.to_k.weight, attn.to_k.bias]

    def loss_all_ignored(self, tokens, context, context_mask):
        logits = self.forward(tokens, torch.ones_like(tokens, dtype=torch.bool), context, context_mask)
        return safe_cross_entropy(logits, torch.full_like(tokens, IGNORE), ignore_index=IGNORE)


class XTLib(Lib):
    def __init__(self, device, flash: bool):
        self.flash = flash
        self.name = "x-transformers flash" if flash else "x-transformers no-flash"
        super().__init__(device)

    def build(self):
        import x_transformers as xt

        return xt.TransformerWrapper(num_tokens=V, max_seq_len=MAX_LEN, attn_layers=xt.Decoder(
            dim=D, depth=1, heads=H, attn_dim_head=D // H, cross_attend=True, attn_flash=self.flash))

    def forward(self, tokens, mask, context, context_mask):
        return self.model(tokens, mask=mask, context=context, context_mask=context_mask)

    def attention_modules(self):
        layers, types = self.model.attn_layers.layers, self.model.attn_layers.layer_types
        return {"self": layers[types.index("a")][1], "cross": layers[types.index("c")][1]}

    def qk(self):
        attn = self.attention_modules()["self"]
        return attn, lambda: [attn.to_q.weight, attn.to_q.bias, attn.to_k.weight, attn.to_k.bias]

    def loss_all_ignored(self, tokens, context, context_mask):
        from x_transformers import AutoregressiveWrapper

        seq = torch.full((tokens.shape[0], tokens.shape[1] + 1), IGNORE, device=tokens.device)
        was = self.model.training
        loss = AutoregressiveWrapper(self.model, ignore_index=IGNORE)(seq, context=context, context_mask=context_mask)
        self.model.train(was)
        return loss


class _MHADecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, D), nn.Embedding(MAX_LEN, D)
        self.norm1, self.norm2, self.norm3, self.final = (nn.LayerNorm(D) for _ in range(4))
        self.self_attn = nn.MultiheadAttention(D, H, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(D, H, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.to_logits = nn.Linear(D, V, bias=False)
        self.need_weights = False

    def forward(self, tokens, mask, context, context_mask):
        n = tokens.shape[1]
        x = self.emb(tokens) + self.pos(torch.arange(n, device=tokens.device))
        causal = torch.ones(n, n, dtype=torch.bool, device=tokens.device).triu(1)  # torch: True = not allowed
        h = self.norm1(x)
        x = x + self.self_attn(h, h, h, attn_mask=causal, key_padding_mask=~mask, need_weights=self.need_weights)[0]
        h = self.norm2(x)
        x = x + self.cross_attn(h, context, context, key_padding_mask=~context_mask, need_weights=self.need_weights)[0]
        x = x + self.ff(self.norm3(x))
        return self.to_logits(self.final(x))


def _mha_qk(attn: nn.MultiheadAttention) -> list[Tensor]:
    w, b = attn.in_proj_weight, attn.in_proj_bias
    return [w[:D], b[:D], w[D:2 * D], b[D:2 * D]]


class MHALib(Lib):
    name = "torch MHA"

    def build(self):
        return _MHADecoder()

    def forward(self, tokens, mask, context, context_mask):
        self.model.need_weights = self.need_weights
        return self.model(tokens, mask, context, context_mask)

    def attention_modules(self):
        return {"self": self.model.self_attn, "cross": self.model.cross_attn}

    def qk(self):
        return self.model.self_attn, lambda: _mha_qk(self.model.self_attn)


class _TorchDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, D), nn.Embedding(MAX_LEN, D)
        layer = nn.TransformerDecoderLayer(D, H, dim_feedforward=4 * D, dropout=0.0, batch_first=True, norm_first=True)
        self.dec = nn.TransformerDecoder(layer, 1, norm=nn.LayerNorm(D))
        self.to_logits = nn.Linear(D, V, bias=False)

    def forward(self, tokens, mask, context, context_mask):
        n = tokens.shape[1]
        x = self.emb(tokens) + self.pos(torch.arange(n, device=tokens.device))
        causal = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device, dtype=x.dtype)
        out = self.dec(x, context, tgt_mask=causal, tgt_key_padding_mask=~mask,
                       memory_key_padding_mask=~context_mask, tgt_is_causal=True)
        return self.to_logits(out)


class TorchDecoderLib(Lib):
    name = "torch TransformerDecoder"

    def build(self):
        return _TorchDecoder()

    def forward(self, tokens, mask, context, context_mask):
        return self.model(tokens, mask, context, context_mask)

    def attention_modules(self):
        layer = self.model.dec.layers[0]
        return {"self": layer.self_attn, "cross": layer.multihead_attn}

    def qk(self):
        attn = self.model.dec.layers[0].self_attn
        return attn, lambda: _mha_qk(attn)


# ----------------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------------


def _run_probed(lib: Lib, tokens, mask, context, context_mask) -> tuple[Tensor, dict[str, Tensor]]:
    probes: dict[str, Tensor] = {}
    handles = []
    for kind, module in lib.attention_modules().items():
        def hook(_m, _i, out, kind=kind):
            probes[kind] = (out[0] if isinstance(out, tuple) else out).detach()
        handles.append(module.register_forward_hook(hook))
    try:
        out = lib.forward(tokens, mask, context, context_mask)
    finally:
        for h in handles:
            h.remove()
    return out, probes


def _fmt(x: float) -> str:
    return f"{x:.2g}"


def describe_out(out: Tensor, real: Tensor) -> str:
    finite = torch.isfinite(out.detach().float())
    real_ok = bool(finite[real].all())
    pad_ok = bool(finite[~real].all()) if bool((~real).any()) else True
    if real_ok and pad_ok:
        return "finite"
    if real_ok:
        return "finite (NaN/inf at padded positions)"
    return f"NaN/inf at {int((~finite[real]).any(-1).sum())} real position(s)"


def describe_grads(lib: Lib, extra: list[Tensor]) -> str:
    tensors = [p.grad for p in lib.model.parameters() if p.grad is not None] + [t.grad for t in extra if t.grad is not None]
    bad = [g for g in tensors if not bool(torch.isfinite(g.float()).all())]
    if not tensors:
        return "no gradient"
    return "finite" if not bad else f"NaN/inf in {len(bad)}/{len(tensors)} tensors"


def describe_dead(probe: Tensor | None, dead: Tensor | None) -> str:
    if dead is None or not bool(dead.any()):
        return "n/a"
    if probe is None:
        return "no probe"
    rows = probe.float()[dead]
    if not bool(torch.isfinite(rows).all()):
        return "NaN/inf"
    worst = float(rows.abs().max())
    return "yes" if worst == 0 else f"no (max abs {_fmt(worst)})"


def describe_leak(a: Tensor, b: Tensor, real: Tensor) -> str:
    ra, rb = a.detach().float()[real], b.detach().float()[real]
    if torch.equal(ra, rb):
        return "no"
    if not torch.equal(torch.isfinite(ra), torch.isfinite(rb)):
        return "yes (NaN/inf reaches real positions)"
    if not bool(torch.isfinite(ra).all()):
        fa, fb = ra[torch.isfinite(ra)], rb[torch.isfinite(rb)]
        if torch.equal(fa, fb):
            return "no change (NaN either way)"
    both = torch.isfinite(ra) & torch.isfinite(rb)
    diff = float((ra - rb)[both].abs().max()) if bool(both.any()) else math.nan
    return f"yes (max diff {_fmt(diff)})"


def _error(err: Exception) -> str:
    msg = " ".join(str(err).split()).replace("|", "/")
    return f"error: {type(err).__name__}: {msg[:90]}"


# ----------------------------------------------------------------------------------------------------
# The cases
# ----------------------------------------------------------------------------------------------------


def base_inputs(device, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (B, N), generator=gen).to(device)
    context = torch.randn(B, J, D, generator=gen).to(device=device, dtype=dtype)
    mask = torch.ones(B, N, dtype=torch.bool, device=device)
    context_mask = torch.ones(B, J, dtype=torch.bool, device=device)
    return tokens, mask, context, context_mask


def _grad_weights(shape, device, dtype) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=dtype)


def run_case(lib: Lib, case: str, device) -> dict[str, str]:
    """Run one case on one library; every field is a string for the table."""
    row = {"out": "", "grads": "", "dead=0": "n/a", "leak": "n/a"}
    tokens, mask, context, context_mask = base_inputs(device)
    autocast = contextlib.nullcontext()
    dead_kind, dead = None, None
    alt_tokens, alt_context = None, None  # the same inputs with only masked content changed

    if case == "1 all-padding context" or case == "7 MHA need_weights=True":
        context_mask[1] = False
        dead_kind, dead = "cross", torch.zeros(B, N, dtype=torch.bool, device=device)
        dead[1] = True
        alt_context = context.clone()
        alt_context[1] = torch.randn(J, D, generator=torch.Generator().manual_seed(5)).to(device) * 10
    elif case == "2 left padding + causal":
        mask[0, :3] = False
        dead_kind, dead = "self", ~mask
        alt_tokens = torch.where(mask, tokens, (tokens + 17) % V)
    elif case == "3 zero-length context":
        context, context_mask = context[:, :0], context_mask[:, :0]
        dead_kind, dead = "cross", torch.ones(B, N, dtype=torch.bool, device=device)
    elif case == "4 NaN/inf in padded ctx":
        context_mask[1, 3:] = False
        context_mask[2, 1:] = False
        alt_context = context.masked_fill(~context_mask[..., None], 0.0)  # the clean run to compare with
        context = alt_context.clone()  # the run measured: garbage in padded positions
        context[1, 3:] = float("nan")
        context[2, 1:3] = float("inf")
        context[2, 3:] = -float("inf")
    elif case.startswith("6"):
        mask[2, 4:] = False
        context_mask[1, 3:] = False
        alt_tokens = torch.where(mask, tokens, (tokens + 17) % V)
        alt_context = context.clone()
        alt_context[~context_mask] = 100.0
        NOTES.setdefault(case, []).append(f"{lib.name} {scale_qk(lib, tokens, mask, context, context_mask, 1e4):.4g}")
        if "autocast" in case:
            autocast = torch.autocast(device.type, dtype=torch.float16)
        else:
            lib.model.half()
            context, alt_context = context.half(), alt_context.half()

    real = mask
    if case == "5 all targets ignored":
        ctx = context.clone().requires_grad_(True)
        try:
            loss = lib.loss_all_ignored(tokens, ctx, context_mask)
            row["out"] = f"loss = {float(loss):.3g}"
            loss.backward()
            row["grads"] = describe_grads(lib, [ctx])
        except Exception as err:  # noqa: BLE001 - record whatever happens
            row["out"] = _error(err)
        return row

    stage = "out"
    try:
        ctx = context.clone().requires_grad_(True)
        with autocast:
            out, probes = _run_probed(lib, tokens, mask, ctx, context_mask)
        row["out"] = describe_out(out, real)
        if dead_kind is not None:
            row["dead=0"] = describe_dead(probes.get(dead_kind), dead)
        stage = "grads"
        w = _grad_weights(out.shape, device, out.dtype)
        (out[real] * w[real]).float().sum().backward()
        row["grads"] = describe_grads(lib, [ctx])
        if alt_tokens is not None or alt_context is not None:
            stage = "leak"
            with torch.no_grad(), autocast:
                a = lib.forward(tokens, mask, context, context_mask)
                b = lib.forward(tokens if alt_tokens is None else alt_tokens, mask,
                                context if alt_context is None else alt_context, context_mask)
            row["leak"] = describe_leak(a, b, real)
    except Exception as err:  # noqa: BLE001 - record whatever happens
        row[stage] = _error(err)
        if stage == "out":
            row["grads"] = "not run"
    return row


def scale_qk(lib: Lib, tokens, mask, context, context_mask, target: float) -> float:
    """Scale the self-attention's q and k projections so that max |q.k| * d^-0.5 == target (float32).

    Returns the largest logit measured again after the scaling.
    """
    c = math.sqrt(target / _max_logit(lib, tokens, mask, context, context_mask))
    _, weights = lib.qk()
    with torch.no_grad():
        for t in weights():
            if t is not None:
                t.mul_(c)
    return _max_logit(lib, tokens, mask, context, context_mask)


def _max_logit(lib: Lib, tokens, mask, context, context_mask) -> float:
    module, weights = lib.qk()
    seen: list[Tensor] = []
    handle = module.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            lib.forward(tokens, mask, context, context_mask)
    finally:
        handle.remove()
    x = seen[0].float()
    wq, bq, wk, bk = weights()
    q = F.linear(x, wq.float(), None if bq is None else bq.float())
    k = F.linear(x, wk.float(), None if bk is None else bk.float())
    dh = D // H
    q = q.reshape(*q.shape[:2], H, dh).transpose(1, 2)
    k = k.reshape(*k.shape[:2], H, dh).transpose(1, 2)
    return float((q @ k.transpose(-1, -2)).abs().max()) * dh**-0.5


CASES = (
    "1 all-padding context",
    "2 left padding + causal",
    "3 zero-length context",
    "4 NaN/inf in padded ctx",
    "5 all targets ignored",
    "6 float16, max q.k = 1e4",
    "6b float16 autocast, max q.k = 1e4",
    "7 MHA need_weights=True",
)


def make_libs(device) -> list[Callable[[], Lib]]:
    libs = [lambda: SafeformerLib(device)]
    try:
        import x_transformers  # noqa: F401

        libs += [lambda: XTLib(device, flash=True), lambda: XTLib(device, flash=False)]
    except ImportError:
        print("x-transformers is not installed: its columns are skipped")
    libs += [lambda: MHALib(device), lambda: TorchDecoderLib(device)]
    return libs


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        where = f"GPU {torch.cuda.get_device_name(device)}"
    else:
        where = f"CPU {platform.processor() or platform.machine()}"
    try:
        xt_version = importlib.metadata.version("x-transformers")
    except importlib.metadata.PackageNotFoundError:
        xt_version = "not installed"
    return (f"{where}; {os.cpu_count()} cores; torch {torch.__version__}; x-transformers {xt_version}; "
            f"safeformer {safeformer.__version__}; Python {platform.python_version()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    device = torch.device(args.device)
    try:  # x-transformers logs a rotary warning through loguru; keep the output to the table
        from loguru import logger

        logger.disable("x_transformers")
    except ImportError:
        pass

    start = time.perf_counter()
    rows = []
    for case in CASES:
        for make in make_libs(device):
            lib = make()
            if case.startswith("7"):
                if not isinstance(lib, MHALib):
                    continue
                lib.need_weights = True
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = run_case(lib, case, device)
            rows.append((case, lib.name, result))
    elapsed = time.perf_counter() - start

    header = ["case", "library", "out (real positions)", "grads", "dead rows = 0", "masked content leaks"]
    lines = [
        "# Peer safety: the same adversarial masks against safeformer, x-transformers and torch.nn",
        "",
        f"Machine: {machine(device)}; device `{device}`. Generated by `python benchmarks/peer_safety.py` "
        f"in {elapsed:.1f} s.",
        "",
        "Each library runs a one-layer causal decoder with cross-attention (dim 32, 4 heads, batch 3, "
        "6 tokens, 5 context positions), every weight moved off its init by N(0, 0.05^2) noise (as after "
        "training: biases that start at 0 are not 0 any more), in training mode with dropout 0. "
        "\"dead rows = 0\": the "
        "self- or cross-attention block's output on dead rows, after its output projection, is exactly 0. "
        "\"leaks\": outputs at real positions change when only masked content changes. \"n/a\": the case "
        "has no dead rows / no masked content to change. See the docstring of the script for each case.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    for case, name, r in rows:
        lines.append(f"| {case} | {name} | {r['out']} | {r['grads']} | {r['dead=0']} | {r['leak']} |")
    for case, notes in NOTES.items():
        lines += ["", f"Case {case}: largest self-attention logit q.k * d^-0.5 after scaling, measured in float32: "
                  + "; ".join(notes) + "."]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
