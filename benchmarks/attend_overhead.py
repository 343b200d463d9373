"""What the safety of ``safeformer.attend`` costs over bare ``F.scaled_dot_product_attention``.

Both contenders get the same q, k, v and the same key padding mask, whose last sample is fully padded
(every row of it is a dead row) and whose other samples have random lengths. Bare SDPA gets the mask
as ``(b, 1, 1, j)`` (the limit for the op: the one kernel call, nothing else); ``attend`` gets the
``(b, j)`` mask and does everything its safety needs (select masked keys/values and dead queries to 0,
hand the kernel a mask without dead rows, zero the dead rows after). Rows: several sequence lengths,
forward only (under ``torch.no_grad``) and forward+backward (gradients of q, k, v). The bare kernel is
not safe (NaN planted in a padded value reaches its gradients): it is timed, not trusted.

Usage:
    python benchmarks/attend_overhead.py            # about 2-3 minutes on a 2-core CPU
    python benchmarks/attend_overhead.py --quick    # smoke run, < 30 s
    python benchmarks/attend_overhead.py --lengths 128 512 1024 2048 --batch 8 --device cuda
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import base_parser, interleaved, machine, markdown_table, pick_inner, ratio_cells, setup, write_results

from safeformer import attend

TARGET = 1.05  # attend / SDPA, forward+backward, at sequence 1024


def contenders(q, k, v, mask, grad_out):
    """Forward and forward+backward callables for bare SDPA and for ``attend`` on the same inputs."""
    mask4 = mask[:, None, None, :]  # (b, 1, 1, j): what bare SDPA gets
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


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="sequence lengths (i = j)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim-head", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args()
    device = setup(args)
    dtype = getattr(torch, args.dtype)
    lengths = args.lengths or ([64, 256] if args.quick else [128, 512, 1024])
    rounds = args.rounds or (6 if args.quick else 40)
    b, h, d = args.batch, args.heads, args.dim_head
    # enough work per sample for the timer; fewer calls at long sequences
    target_s = 0.02 if args.quick else 0.08

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
            inner = pick_inner(pair[0], device, target_s)
            t = interleaved({"sdpa": pair[0], "attend": pair[1]}, rounds=rounds, device=device, inner=inner)
            row = [n, mode, *ratio_cells(t, "attend")]
            if device.type == "cuda":
                row += [f"{t.median('sdpa') * 1e3:.3f}", f"{t.median('attend') * 1e3:.3f}"]
            rows.append(row)
            label = f"seq {n} {mode}"
            ratios[label] = round(t.ratio("attend"), 4)
            if n == 1024 and mode == "forward+backward":
                targets[label] = TARGET

    header = ["seq (i = j)", "pass", "attend / SDPA (median per-round)", "ratio of medians", "per-round 25%-75%"]
    if device.type == "cuda":
        header += ["SDPA ms", "attend ms"]
    lines = [
        "# attend (safe) vs bare F.scaled_dot_product_attention",
        "",
        f"Machine: {machine(device)}.",
        f"Inputs: b={b}, h={h}, d={d}, {args.dtype}, self-attention shapes (i = j); key padding mask (b, j) with "
        f"random lengths and the last sample fully padded (all its rows dead). SDPA gets the same mask as "
        f"(b, 1, 1, j). {rounds} interleaved rounds (order rotates), each sample the mean of several calls; "
        f"ratio = attend time / SDPA time in the same round.",
        "",
        *markdown_table(header, rows),
        "",
        f"Target: attend / SDPA <= {TARGET:.2f}x for forward+backward at sequence 1024.",
    ]
    for label, tgt in targets.items():
        lines.append(f"Measured at {label}: {ratios[label]:.3f}x ({'met' if ratios[label] <= tgt else 'NOT met'}).")
    if device.type != "cuda":
        lines.append("Absolute times are not reported on a CPU (shared machine); ratios only.")
    write_results("attend_overhead", args, lines, ratios, targets, "attend / bare SDPA (padding mask with dead rows)")


if __name__ == "__main__":
    main()
