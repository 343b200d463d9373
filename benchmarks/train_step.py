"""One training step of a conditional decoder: safeformer vs x-transformers built with the same settings.

A step is forward (next-token loss), backward, ``AdamW.step()`` and ``zero_grad``. Both models are a
``TransformerWrapper`` around a ``Decoder`` with cross-attention, rotary positions (same rotary
dimension), the same width, depth, heads and head dim, flash on (x-transformers ``attn_flash=True``;
safeformer always runs SDPA), wrapped in each library's ``AutoregressiveWrapper`` for the loss.

The batch: random tokens; a context padded to random lengths (``context_mask``); 10% of the samples
have their condition dropped (classifier-free-guidance training). safeformer gets the dropped rows as
all-False ``context_mask`` rows, which it makes an exact no-op. x-transformers cannot take an all-False
row safely, so it gets the same mask with its dropped rows set to attend to one key (the first): the
same shapes and the same work, a different (unsafe-free) mask. The drop is drawn once (fixed), so both
see identical inputs every step.

Usage:
    python benchmarks/train_step.py           # small and medium size, about 2-3 minutes on 2 CPU cores
    python benchmarks/train_step.py --quick   # smoke run, < 30 s
"""

from __future__ import annotations

import warnings

import torch
from common import base_parser, interleaved, machine, markdown_table, ratio_cells, setup, write_results

TARGET = 1.00  # safeformer step time / x-transformers step time

SIZES = {
    # name: dim, depth, heads, batch, seq, context length
    "small": dict(dim=256, depth=4, heads=4, batch=16, seq=128, ctx=64),
    "medium": dict(dim=512, depth=6, heads=8, batch=8, seq=256, ctx=128),
    "tiny": dict(dim=128, depth=2, heads=2, batch=8, seq=64, ctx=32),  # --quick
}


def build_pair(cfg: dict, vocab: int, device: torch.device):
    """The two models with the same settings, each in its library's AutoregressiveWrapper."""
    import x_transformers as xt

    import safeformer as sf

    dim, depth, heads = cfg["dim"], cfg["depth"], cfg["heads"]
    dim_head = dim // heads
    rot = max(dim_head // 2, 32)  # x-transformers' default rotary dimension, given to both
    sf_net = sf.TransformerWrapper(
        num_tokens=vocab, max_seq_len=cfg["seq"],
        attn_layers=sf.Decoder(dim=dim, depth=depth, heads=heads, dim_head=dim_head, cross_attend=True,
                               rotary_pos_emb=True, rotary_emb_dim=rot),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        xt_net = xt.TransformerWrapper(
            num_tokens=vocab, max_seq_len=cfg["seq"],
            attn_layers=xt.Decoder(dim=dim, depth=depth, heads=heads, attn_dim_head=dim_head, cross_attend=True,
                                   rotary_pos_emb=True, rotary_emb_dim=rot, attn_flash=True),
        )
    return sf.AutoregressiveWrapper(sf_net).to(device), xt.AutoregressiveWrapper(xt_net).to(device)


def make_batch(cfg: dict, vocab: int, device: torch.device, drop_frac: float = 0.1):
    """Tokens, context, the safeformer context mask (dropped rows all False) and x-transformers' one."""
    g = torch.Generator().manual_seed(1)
    b, n, j, dim = cfg["batch"], cfg["seq"], cfg["ctx"], cfg["dim"]
    tokens = torch.randint(0, vocab, (b, n + 1), generator=g)
    context = torch.randn(b, j, dim, generator=g)
    lengths = torch.randint(1, j + 1, (b,), generator=g)
    ctx_mask = torch.arange(j)[None] < lengths[:, None]  # (b, j) right padding
    dropped = torch.zeros(b, dtype=torch.bool)
    dropped[torch.randperm(b, generator=g)[: max(1, round(drop_frac * b))]] = True
    sf_mask = ctx_mask & ~dropped[:, None]  # dropped condition = empty context (all False)
    xt_mask = sf_mask.clone()
    xt_mask[dropped, 0] = True  # x-transformers: a dropped row attends to one key instead
    return [t.to(device) for t in (tokens, context, sf_mask, xt_mask)], int(dropped.sum())


def make_step(model, opt, tokens, context, context_mask):
    """One training step of ``model`` (an AutoregressiveWrapper) as a callable."""

    def step():
        loss = model(tokens, context=context, context_mask=context_mask)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=None, choices=sorted(SIZES))
    p.add_argument("--vocab", type=int, default=256)
    args = p.parse_args()
    device = setup(args)
    sizes = args.sizes or (["tiny"] if args.quick else ["small", "medium"])
    rows, ratios, targets = [], {}, {}
    for size in sizes:
        cfg = SIZES[size]
        rounds = args.rounds or (15 if args.quick else (21 if size != "medium" else 13))
        torch.manual_seed(0)
        sf_model, xt_model = build_pair(cfg, args.vocab, device)
        (tokens, context, sf_mask, xt_mask), n_dropped = make_batch(cfg, args.vocab, device)
        sf_opt = torch.optim.AdamW(sf_model.parameters(), lr=1e-4)
        xt_opt = torch.optim.AdamW(xt_model.parameters(), lr=1e-4)

        sf_step = make_step(sf_model, sf_opt, tokens, context, sf_mask)
        xt_step = make_step(xt_model, xt_opt, tokens, context, xt_mask)

        t = interleaved({"x-transformers": xt_step, "safeformer": sf_step}, rounds=rounds, device=device,
                        warmup=2)
        n_sf = sum(q.numel() for q in sf_model.parameters())
        n_xt = sum(q.numel() for q in xt_model.parameters())
        row = [f"{size}: dim {cfg['dim']}, depth {cfg['depth']}, heads {cfg['heads']}, batch {cfg['batch']}, "
               f"seq {cfg['seq']}, ctx {cfg['ctx']} ({n_dropped} dropped)", f"{n_sf / 1e6:.2f}M / {n_xt / 1e6:.2f}M",
               rounds, *ratio_cells(t, "safeformer")]
        if device.type == "cuda":
            row += [f"{t.median('x-transformers') * 1e3:.2f}", f"{t.median('safeformer') * 1e3:.2f}"]
        rows.append(row)
        label = f"{size} train step"
        ratios[label] = round(t.ratio("safeformer"), 4)
        targets[label] = TARGET

    header = ["size", "params sf / xt", "rounds", "safeformer / x-transformers (median per-round)",
              "ratio of medians", "per-round 25%-75%"]
    if device.type == "cuda":
        header += ["xt ms", "sf ms"]
    lines = [
        "# Training step: safeformer vs x-transformers (same settings)",
        "",
        f"Machine: {machine(device)}.",
        "Step = next-token loss forward + backward + AdamW step + zero_grad, float32. Both: TransformerWrapper("
        "Decoder(cross_attend=True, rotary_pos_emb=True)), same dim/depth/heads/head dim/rotary dim; x-transformers "
        "with attn_flash=True. Contexts right-padded to random lengths; 10% of samples (at least one) dropped. "
        "**x-transformers cannot take an all-False context row safely: its dropped rows attend to one key "
        "(the first) instead**, so both do the same work. Parameter counts differ slightly (x-transformers' "
        "LayerNorm has no bias).",
        "Interleaved rounds (order rotates), after 2 warm-up steps each; ratio = safeformer step time / "
        "x-transformers step time in the same round.",
        "",
        *markdown_table(header, rows),
        "",
        f"Target: safeformer / x-transformers <= {TARGET:.2f}x at both sizes.",
    ]
    for label in ratios:
        lines.append(f"Measured, {label}: {ratios[label]:.3f}x ({'met' if ratios[label] <= TARGET else 'NOT met'}).")
    if device.type != "cuda":
        lines.append("Absolute times are not reported on a CPU (shared machine); ratios only.")
    write_results("train_step", args, lines, ratios, targets, "training step: safeformer / x-transformers")


if __name__ == "__main__":
    main()
