"""Activation checkpointing: peak memory saved and time paid, as ratios, in one run.

A training step (forward, next-token loss, backward) of a causal decoder with padding, with and
without ``AttentionLayers(checkpoint_layers=True)``. Peak memory is measured as in ``memory.py`` (on the
CPU, a dispatch mode that sees every tensor every op allocates; on CUDA, the allocator's peak); time is
the median of interleaved rounds (``common.interleaved``).

Usage:
    python benchmarks/checkpointing.py           # dim 256, depth 6, batch 8, 512 tokens
    python benchmarks/checkpointing.py --quick   # a smoke run
"""

from __future__ import annotations

import torch
from common import base_parser, interleaved, machine, markdown_table, ratio_cells, setup, write_results
from memory import measure, tensor_bytes


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    device = setup(args)
    import safeformer as sf

    n = args.seq or (128 if args.quick else 512)
    rounds = args.rounds or (3 if args.quick else 9)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch, n), generator=g).to(device)
    mask = torch.ones(args.batch, n, dtype=torch.bool, device=device)
    mask[0, : n // 3] = False  # left padding: dead rows under the causal mask
    models = {}
    for ck in (False, True):
        torch.manual_seed(0)
        net = sf.TransformerWrapper(num_tokens=256, max_seq_len=n, attn_layers=sf.Decoder(
            dim=args.dim, depth=args.depth, heads=4, dim_head=args.dim // 4, checkpoint_layers=ck))
        models[ck] = sf.AutoregressiveWrapper(net).to(device).train()

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            model(tokens, mask=mask).backward()
        return run

    peaks = {}
    for ck, model in models.items():
        step(model)()  # gradients exist from here on, in both columns
        peaks[ck], _, _ = measure(step(model), device, tensor_bytes(model, tokens, mask), dense_numel=10**12)
    timing = interleaved({"plain": step(models[False]), "checkpoint_layers": step(models[True])},
                         rounds=rounds, device=device)
    mem_ratio = peaks[True] / peaks[False]
    lines = [
        "# Activation checkpointing: memory saved, time paid", "",
        f"Machine: {machine(device)}.",
        f"Training step of a causal decoder (dim {args.dim}, depth {args.depth}, batch {args.batch}, {n} tokens, "
        f"one sample one-third left padding), {rounds} interleaved rounds.", "",
        *markdown_table(["", "peak memory (MiB)", "memory ratio", "time ratio (median per round)",
                         "ratio of medians", "25%-75%"], [
            ["plain", f"{peaks[False] / 2**20:.1f}", "1.00x", "1.000x", "1.000x", "-"],
            ["checkpoint_layers=True", f"{peaks[True] / 2**20:.1f}", f"{mem_ratio:.2f}x",
             *ratio_cells(timing, "checkpoint_layers", "plain")],
        ]),
        "",
        "Gradients are bit-identical with and without checkpointing (tests/test_training.py).",
    ]
    write_results("checkpointing", args, lines,
                  {"peak memory": mem_ratio, "step time": timing.ratio("checkpoint_layers", "plain")},
                  title="checkpoint_layers=True / plain")


if __name__ == "__main__":
    main()
