"""Padding costs nothing: a training step on a ragged batch (about half of the tokens and of the context
padding) against the same shapes fully real, against safeformer's padded path, and against
x-transformers on the same ragged batch, interleaved in one run.

The model: ``TransformerWrapper(Decoder(cross_attend=True, rotary_pos_emb=True))`` in each library's
``AutoregressiveWrapper`` (next-token loss, backward, AdamW step). The ragged batch: token lengths drawn
uniformly in [10%, 90%] of ``seq`` (right padding, a ``mask``), context lengths in [10%, 90%] of
``ctx`` (a ``context_mask``; every sample keeps a real context token, which x-transformers needs).

Rows: ``unpadded`` (safeformer, ``unpadded="auto"``: real tokens only), ``padded path``
(``unpadded=False``), ``fully real`` (safeformer, same shapes, no padding: the cost of the shapes), and
``x-transformers`` (``attn_flash=True``, same mask). "Fully real" passes no masks at all (the causal
kernel without a mask tensor), the fastest those shapes can run. Targets ("padding costs nothing"): unpadded /
fully real <= real fraction + 0.1, and x-transformers / unpadded >= 1.5.

Usage:
    python benchmarks/unpadded.py           # small (dim 256, depth 4, batch 16, 256 tokens, 64 context) and medium
    python benchmarks/unpadded.py --quick   # a smoke run
    python benchmarks/unpadded.py --sweep   # unpadded / padded path against the padding fraction
"""

from __future__ import annotations

import warnings

import torch
from common import base_parser, interleaved, machine, markdown_table, ratio_cells, setup, write_results

SIZES = {
    "small": dict(dim=256, depth=4, heads=4, batch=16, seq=256, ctx=64),
    "medium": dict(dim=512, depth=4, heads=8, batch=8, seq=512, ctx=128),
    "tiny": dict(dim=128, depth=2, heads=2, batch=8, seq=64, ctx=16),  # --quick
}


def build(cfg: dict, vocab: int, device, unpadded):
    import safeformer as sf

    dim, heads = cfg["dim"], cfg["heads"]
    rot = max(dim // heads // 2, 32)
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=vocab, max_seq_len=cfg["seq"] + 1, attn_layers=sf.Decoder(
        dim=dim, depth=cfg["depth"], heads=heads, dim_head=dim // heads, cross_attend=True, rotary_pos_emb=True,
        rotary_emb_dim=rot, unpadded=unpadded))
    return sf.AutoregressiveWrapper(net).to(device)


def build_xt(cfg: dict, vocab: int, device):
    import x_transformers as xt

    dim, heads = cfg["dim"], cfg["heads"]
    rot = max(dim // heads // 2, 32)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = xt.TransformerWrapper(num_tokens=vocab, max_seq_len=cfg["seq"] + 1, attn_layers=xt.Decoder(
            dim=dim, depth=cfg["depth"], heads=heads, attn_dim_head=dim // heads, cross_attend=True,
            rotary_pos_emb=True, rotary_emb_dim=rot, attn_flash=True))
    return xt.AutoregressiveWrapper(net).to(device)


def ragged(cfg: dict, vocab: int, device):
    g = torch.Generator().manual_seed(1)
    b, n, j = cfg["batch"], cfg["seq"] + 1, cfg["ctx"]
    tokens = torch.randint(0, vocab, (b, n), generator=g)
    lengths = torch.randint(max(2, n // 10), (9 * n) // 10 + 1, (b,), generator=g)
    mask = torch.arange(n)[None] < lengths[:, None]
    context = torch.randn(b, j, cfg["dim"], generator=g)
    clen = torch.randint(max(1, j // 10), (9 * j) // 10 + 1, (b,), generator=g)
    ctx_mask = torch.arange(j)[None] < clen[:, None]
    return [t.to(device) for t in (tokens, mask, context, ctx_mask)]


def step_fn(model, tokens, mask, context, ctx_mask):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss = model(tokens, mask=mask, context=context, context_mask=ctx_mask)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def sweep(args, device) -> None:
    """Where "auto" should switch: unpadded / padded path step time against the padding fraction."""
    cfg = SIZES["tiny" if args.quick else "small"]
    rows, ratios = [], {}
    for frac in (0.05, 0.1, 0.2, 0.3, 0.5):
        tokens, mask, context, ctx_mask = ragged(cfg, args.vocab, device)
        n = mask.shape[1]
        g = torch.Generator().manual_seed(2)
        lengths = torch.clamp(torch.normal(n * (1 - frac), n * frac / 2, (mask.shape[0],), generator=g).round(), 2, n)
        mask = (torch.arange(n)[None] < lengths[:, None]).to(device)
        ctx_mask = torch.ones_like(ctx_mask)
        t = interleaved({
            "padded path": step_fn(build(cfg, args.vocab, device, False), tokens, mask, context, ctx_mask),
            "unpadded": step_fn(build(cfg, args.vocab, device, True), tokens, mask, context, ctx_mask),
        }, rounds=args.rounds or (3 if args.quick else 7), device=device, warmup=1)
        real = float(mask.float().mean())
        rows.append([f"{1 - real:.0%}", *ratio_cells(t, "unpadded", "padded path")])
        ratios[f"{1 - real:.0%} padding"] = round(t.ratio("unpadded", "padded path"), 4)
    lines = ["# Unpadded / padded path against the padding fraction (where auto switches)", "",
             f"Machine: {machine(device)}.", f"Size: {cfg}; contexts fully real.", "",
             *markdown_table(["padding", "unpadded / padded (median per-round)", "ratio of medians", "25%-75%"], rows)]
    write_results("unpadded_threshold", args, lines, ratios, title="unpadded / padded path by padding fraction")


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=None, choices=sorted(SIZES))
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--sweep", action="store_true", help="measure the threshold: ratio against the padding fraction")
    args = p.parse_args()
    device = setup(args)
    if args.sweep:
        sweep(args, device)
        return
    sizes = args.sizes or (["tiny"] if args.quick else ["small", "medium"])
    rows, ratios, targets = [], {}, {}
    for size in sizes:
        cfg = SIZES[size]
        rounds = args.rounds or (5 if args.quick else (15 if size == "small" else 9))
        tokens, mask, context, ctx_mask = ragged(cfg, args.vocab, device)
        real = float(mask.float().mean())
        contenders = {
            "fully real": step_fn(build(cfg, args.vocab, device, "auto"), tokens, None, context, None),
            "unpadded": step_fn(build(cfg, args.vocab, device, "auto"), tokens, mask, context, ctx_mask),
            "padded path": step_fn(build(cfg, args.vocab, device, False), tokens, mask, context, ctx_mask),
            "x-transformers": step_fn(build_xt(cfg, args.vocab, device), tokens, mask, context, ctx_mask),
        }
        t = interleaved(contenders, rounds=rounds, device=device, warmup=2, baseline="fully real")
        label = (f"{size}: dim {cfg['dim']}, depth {cfg['depth']}, batch {cfg['batch']}, {cfg['seq']} tokens "
                 f"({real:.0%} real), {cfg['ctx']} context ({float(ctx_mask.float().mean()):.0%} real)")
        rows.append([label, "unpadded / fully real", *ratio_cells(t, "unpadded", "fully real"), f"<= {real + 0.1:.2f}x"])
        rows.append(["", "padded path / fully real", *ratio_cells(t, "padded path", "fully real"), ""])
        rows.append(["", "unpadded / padded path", *ratio_cells(t, "unpadded", "padded path"), ""])
        rows.append(["", "x-transformers / unpadded", *ratio_cells(t, "x-transformers", "unpadded"), ">= 1.50x"])
        ratios[f"{size}: unpadded / fully real"] = round(t.ratio("unpadded", "fully real"), 4)
        targets[f"{size}: unpadded / fully real"] = round(real + 0.1, 3)
        ratios[f"{size}: unpadded / x-transformers"] = round(t.ratio("unpadded", "x-transformers"), 4)
        targets[f"{size}: unpadded / x-transformers"] = round(1 / 1.5, 3)
    lines = [
        "# Padding costs nothing: training step on a ragged batch", "",
        f"Machine: {machine(device)}.",
        "Step = next-token loss forward + backward + AdamW step, float32, right-padded tokens and contexts "
        "(lengths 10%-90%). Interleaved rounds, order rotating; ratios of the same round.", "",
        *markdown_table(["batch", "ratio", "median per-round", "ratio of medians", "25%-75%", "target"], rows),
    ]
    write_results("unpadded", args, lines, ratios, targets, "ragged batch: ratios (target marks)")


if __name__ == "__main__":
    main()
