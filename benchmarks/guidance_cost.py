"""What classifier-free guidance costs at sampling time, measured in one run.

Three ways to generate N tokens from the same conditional decoder, same prompts, same context:

  (a) plain     conditional sampling only (``cond_scale=1.0``: the unconditional branch never runs);
  (b) batched   CFG as safeformer runs it: conditional and unconditional branches as ONE forward
                of 2b samples sharing one KV cache;
  (c) two-pass  CFG as separate CFG libraries run it: two forwards of b samples each, two KV caches.

All three run greedy (no RNG), with the KV cache, through the same generation loop
(``safeformer.decoding.generation.generate_tokens``); (b) and (c) produce the same tokens, checked below.
Repeats are interleaved in rounds (a, b, c; then b, c, a; ...). The main number is the median over
rounds of each method's time divided by (a)'s time in the same round (runs close in time share the
machine's load); the ratio of the medians is shown beside it. Absolute times are printed only on a
GPU (DESIGN.md: on a shared CPU only ratios mean something). On a CPU the run uses ``--threads``
threads (default 1: on a busy machine, extra threads mostly measure the other processes).

Usage:
    python benchmarks/guidance_cost.py                      # small, CPU-friendly (well under 2 minutes)
    python benchmarks/guidance_cost.py --dim 512 --depth 8 --batch 16 --tokens 256 --device cuda
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from safeformer import Decoder, TransformerWrapper
from safeformer.decoding.generation import generate_tokens

RESULTS = Path(__file__).resolve().parent / "results" / "guidance_cost.md"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32, help="N, new tokens per sample")
    p.add_argument("--context-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--cond-scale", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: 1 on CPU, torch's default on GPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args()


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        where = f"GPU {torch.cuda.get_device_name(device)}"
    else:
        where = f"CPU {platform.processor() or platform.machine()}"
    return (f"{where}; {os.cpu_count()} cores, torch {torch.__version__} using {torch.get_num_threads()} threads; "
            f"Python {platform.python_version()}")


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if args.threads is not None or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    torch.manual_seed(0)
    net = TransformerWrapper(
        num_tokens=args.vocab, max_seq_len=args.prompt_len + args.tokens,
        attn_layers=Decoder(dim=args.dim, depth=args.depth, heads=args.heads, dim_head=args.dim // args.heads,
                            cross_attend=True, rotary_pos_emb=True),
    ).to(device).eval()
    b = args.batch
    prompts = torch.randint(0, args.vocab, (b, args.prompt_len), device=device)
    lengths = torch.randint(1, args.prompt_len + 1, (b,), device=device)
    mask = torch.arange(args.prompt_len, device=device)[None] >= (args.prompt_len - lengths[:, None])  # left pad
    context = torch.randn(b, args.context_len, args.dim, device=device)
    ctx_lengths = torch.randint(0, args.context_len + 1, (b,), device=device)
    context_mask = torch.arange(args.context_len, device=device)[None] < ctx_lengths[:, None]

    common = dict(mask=mask, context=context, context_mask=context_mask, temperature=0.0, cache_kv=True)
    runs = {
        "(a) plain conditional": dict(cond_scale=1.0),
        "(b) batched CFG (2b, one cache)": dict(cond_scale=args.cond_scale),
        "(c) two passes (b + b, two caches)": dict(cond_scale=args.cond_scale, _two_pass=True),
    }

    def run(kw) -> tuple[float, torch.Tensor]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = generate_tokens(net, prompts, args.tokens, **common, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0, out

    outputs = {name: run(kw)[1] for name, kw in runs.items()}  # warm-up, and the tokens to compare
    names = list(runs)
    same = torch.equal(outputs[names[1]], outputs[names[2]])
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.repeats):  # interleaved, rotating the order so no method always goes first
        order = names[r % 3 :] + names[: r % 3]
        for name in order:
            times[name].append(run(runs[name])[0])
    med = {name: statistics.median(ts) for name, ts in times.items()}
    paired = {name: statistics.median(t / a for t, a in zip(times[name], times[names[0]])) for name in names}
    spread = {name: sorted(t / a for t, a in zip(times[name], times[names[0]])) for name in names}
    base = med[names[0]]

    gpu = device.type == "cuda"
    lines = [
        "# Cost of classifier-free guidance at sampling time",
        "",
        f"Machine: {machine(device)}.",
        f"Model: Decoder dim={args.dim} depth={args.depth} heads={args.heads}, cross-attention to a context of "
        f"{args.context_len} positions (random padding), vocab {args.vocab}. Batch b={b}, left-padded prompts of "
        f"up to {args.prompt_len} tokens, N={args.tokens} new tokens, greedy, KV cache, cond_scale={args.cond_scale}.",
        f"{args.repeats} interleaved rounds after one warm-up run each; per-round ratio = time / plain's time in "
        f"the same round.",
        "",
        "| method | median per-round ratio | ratio of medians | per-round ratio, 25%-75% |"
        + (" median ms | ms per token |" if gpu else ""),
        "|---|---:|---:|---:|" + ("---:|---:|" if gpu else ""),
    ]
    for name in names:
        q = spread[name]
        row = (f"| {name} | {paired[name]:.2f}x | {med[name] / base:.2f}x | "
               f"{q[len(q) // 4]:.2f}x - {q[(3 * len(q)) // 4]:.2f}x |")
        if gpu:
            row += f" {med[name] * 1e3:.1f} | {med[name] * 1e3 / args.tokens:.2f} |"
        lines.append(row)
    lines += [
        "",
        "Batched CFG / two passes (median per-round ratio): "
        f"{statistics.median(b / c for b, c in zip(times[names[1]], times[names[2]])):.2f}x "
        f"(below 1: one batched forward is cheaper than two).",
        f"Batched CFG and two passes generate the same tokens: {same}.",
    ]
    if not gpu:
        lines.append("Absolute times are not reported on a CPU (shared machine); ratios only.")
    table = "\n".join(lines) + "\n"
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
