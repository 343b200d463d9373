"""What the safety of ``safeformer.core.attend`` costs over bare ``F.scaled_dot_product_attention``.

Both contenders get the same q, k, v and the same key padding mask. Bare SDPA gets the mask as
``(b, 1, 1, j)`` (the limit for the op: the one kernel call, nothing else); ``attend`` gets the
``(b, j)`` mask and does everything its safety needs (dead rows exactly 0, masked keys/values kept out
of every output and gradient). The bare kernel is not safe (NaN planted in a padded value reaches its
gradients): it is timed, not trusted.

Two kinds of rows:

- self-attention shapes (i = j; b=4): the last sample fully padded (every row of it is a dead row),
  the others random lengths; forward only (under ``torch.no_grad``) and forward+backward (gradients of
  q, k, v);
- decode shapes: one query (i = 1) against a cache of j keys (b = 1 and 16), forward only under
  ``torch.no_grad`` (a generation step); with random left padding per sample (``(b, j)`` mask), and
  with no mask at all.

Usage:
    python benchmarks/attend_overhead.py            # about 3 minutes on a 2-core CPU
    python benchmarks/attend_overhead.py --quick    # smoke run, < 30 s
    python benchmarks/attend_overhead.py --lengths 128 512 1024 2048 --batch 8 --device cuda
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import base_parser, interleaved, machine, markdown_table, pick_inner, ratio_cells, setup, write_results

from safeformer import attend


def kernels_of(fn) -> str:
    """The attention kernel(s) one call of ``fn`` dispatches to, from ``torch.profiler``'s op names."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    low = {e.name.lower() for e in prof.events()}
    found = [name for name, key in (("cudnn", "cudnn_attention"), ("flash", "flash_attention"),
                                     ("efficient", "efficient_attention"), ("math", "attention_math"))
             if any(key in n for n in low)]
    return "+".join(found) or "other"

TARGET = 1.05  # attend / SDPA, forward+backward, at sequence 1024
TARGET_SHORT = 1.10  # attend / SDPA at sequence 128 (forward, forward+backward) and at every decode shape
DECODE_KEYS = (64, 256, 1024, 2048)
DECODE_BATCHES = (1, 16)


def contenders(q, k, v, mask, grad_out):
    """Forward and forward+backward callables for bare SDPA and for ``attend`` on the same inputs."""
    mask4 = None if mask is None else mask[:, None, None, :]  # (b, 1, 1, j): what bare SDPA gets
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def fwd_sdpa():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask4)

    def fwd_attend():
        with torch.no_grad():
            return attend(q, k, v, mask=mask)

    def bwd_sdpa():
        F.scaled_dot_product_attention(*leaves, attn_mask=mask4).backward(grad_out)
        for t in leaves:
            t.grad = None

    def bwd_attend():
        attend(*leaves, mask=mask).backward(grad_out)
        for t in leaves:
            t.grad = None

    return fwd_sdpa, fwd_attend, bwd_sdpa, bwd_attend


def measure(pair, device, rounds: int, target_s: float):
    inner = pick_inner(pair[0], device, target_s)
    return interleaved({"sdpa": pair[0], "attend": pair[1]}, rounds=rounds, device=device, inner=inner)


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="sequence lengths (i = j)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim-head", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--decode-keys", type=int, nargs="*", default=None,
                   help=f"cache lengths of the decode rows (default {' '.join(map(str, DECODE_KEYS))}; none: skip)")
    args = p.parse_args()
    device = setup(args)
    dtype = getattr(torch, args.dtype)
    lengths = args.lengths or ([64, 256] if args.quick else [128, 512, 1024])
    decode_keys = args.decode_keys if args.decode_keys is not None else ([64, 1024] if args.quick else DECODE_KEYS)
    rounds = args.rounds or (6 if args.quick else 40)
    b, h, d = args.batch, args.heads, args.dim_head
    # enough work per sample for the timer; fewer calls at long sequences
    target_s = 0.02 if args.quick else 0.08
    cuda = device.type == "cuda"

    rows, ratios, targets = [], {}, {}
    for n in lengths:
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(b, h, n, d, generator=g).to(device, dtype) for _ in range(3))
        lengths_b = torch.randint(n // 4, n + 1, (b,), generator=g)
        lengths_b[-1] = 0  # a fully padded sample: all its rows are dead rows
        mask = (torch.arange(n)[None] < lengths_b[:, None]).to(device)  # (b, j)
        grad_out = torch.randn(b, h, n, d, generator=g).to(device, dtype)

        fwd_sdpa, fwd_attend, bwd_sdpa, bwd_attend = contenders(q, k, v, mask, grad_out)
        for mode, pair in (("forward", (fwd_sdpa, fwd_attend)), ("forward+backward", (bwd_sdpa, bwd_attend))):
            t = measure(pair, device, rounds, target_s)
            row = [f"self {n}", b, mode, *ratio_cells(t, "attend")]
            if cuda:
                row += [f"{t.median('sdpa') * 1e3:.3f}", f"{t.median('attend') * 1e3:.3f}"]
                row.append(f"{kernels_of(pair[0])} / {kernels_of(pair[1])}")
            rows.append(row)
            label = f"seq {n} {mode}"
            ratios[label] = round(t.ratio("attend"), 4)
            if n == 1024 and mode == "forward+backward":
                targets[label] = TARGET
            if n == 128:
                targets[label] = TARGET_SHORT

    # decode: one query against j cached keys (a generation step), forward only
    decode_target_s = target_s / 2  # a decode call is short: many calls per sample either way
    for bd in DECODE_BATCHES:
        for j in decode_keys:
            g = torch.Generator().manual_seed(1000 * bd + j)
            q = torch.randn(bd, h, 1, d, generator=g).to(device, dtype)
            k, v = (torch.randn(bd, h, j, d, generator=g).to(device, dtype) for _ in range(2))
            real = torch.randint(j // 4, j + 1, (bd,), generator=g)
            left = (torch.arange(j)[None] >= (j - real)[:, None]).to(device)  # (b, j): random left padding
            for padded, mask in (("padded", left), ("no mask", None)):
                fwd_sdpa, fwd_attend, _, _ = contenders(q, k, v, mask, None)
                t = measure((fwd_sdpa, fwd_attend), device, rounds, decode_target_s)
                row = [f"decode 1 x {j} ({padded})", bd, "forward", *ratio_cells(t, "attend")]
                if cuda:
                    row += [f"{t.median('sdpa') * 1e3:.3f}", f"{t.median('attend') * 1e3:.3f}"]
                    row.append(f"{kernels_of(fwd_sdpa)} / {kernels_of(fwd_attend)}")
                rows.append(row)
                label = f"decode b{bd} j{j} {padded}"
                ratios[label] = round(t.ratio("attend"), 4)
                targets[label] = TARGET_SHORT

    header = ["shape (i x j)", "batch", "pass", "attend / SDPA (median per-round)", "ratio of medians",
              "per-round 25%-75%"]
    if cuda:
        header += ["SDPA ms", "attend ms", "kernel (SDPA / attend, profiler)"]
    lines = [
        "# attend (safe) vs bare F.scaled_dot_product_attention",
        "",
        f"Machine: {machine(device)}.",
        f"Inputs: h={h}, d={d}, {args.dtype}. Self-attention shapes (i = j, b={b}): key padding mask (b, j) with "
        f"random lengths and the last sample fully padded (all its rows dead). Decode shapes (i = 1, forward "
        f"under no_grad): a cache of j keys with random left padding per sample ((b, j) mask), or no mask. "
        f"SDPA gets the same mask as (b, 1, 1, j). {rounds} interleaved rounds (order rotates), each sample the "
        f"mean of several calls; ratio = attend time / SDPA time in the same round.",
        "",
        *markdown_table(header, rows),
        "",
        f"Targets: attend / SDPA <= {TARGET:.2f}x for forward+backward at sequence 1024; <= {TARGET_SHORT:.2f}x at "
        f"sequence 128 (forward and forward+backward) and at every decode shape.",
    ]
    met = [label for label, tgt in targets.items() if ratios[label] <= tgt]
    missed = [label for label, tgt in targets.items() if ratios[label] > tgt]
    for label, tgt in targets.items():
        if not label.startswith("decode"):
            lines.append(f"Measured at {label}: {ratios[label]:.3f}x ({'met' if ratios[label] <= tgt else 'NOT met'}).")
    lines.append(f"Targets met: {len(met)} of {len(targets)}" + (f"; not met: {', '.join(missed)}." if missed else "."))
    if not cuda:
        lines.append("Absolute times are not reported on a CPU (shared machine); ratios only.")
    write_results("attend_overhead", args, lines, ratios, targets, "attend / bare SDPA (padding mask with dead rows; decode)")


if __name__ == "__main__":
    main()
