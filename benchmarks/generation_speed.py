"""KV-cached greedy generation: safeformer vs x-transformers' ``generate(..., cache_kv=True)``.

One x-transformers ``TransformerWrapper(Decoder(rotary_pos_emb=True, attn_flash=True))`` is built with
random weights; safeformer's model is the same network imported with ``safeformer.from_x_transformers``
(same weights). Each library's ``AutoregressiveWrapper.generate`` then produces ``--tokens`` tokens
greedily (``temperature=0.0``) with the KV cache from the same prompts; the table says whether the
two produced the same tokens (they should: same function, same argmax, up to float rounding ties).

Rows:
- ``decoder``: no cross-attention, prompts of one length;
- ``decoder + context``: cross-attention to a context padded to random lengths (``context_mask``);
- ``ragged prompts``: prompts of different lengths, left-padded (safeformer: ``mask=``;
  x-transformers: ``prompt_lens=``, which right-aligns them). x-transformers numbers positions
  ``0..n-1`` including the padding while safeformer counts real tokens only, so the tokens may differ
  here by design; the row times the masked-cache path.

The main number is tokens per second of safeformer / tokens per second of x-transformers, the median
over interleaved rounds of the per-round ratio (higher is better; target >= 1.0).

Usage:
    python benchmarks/generation_speed.py            # about 2 minutes on 2 CPU cores
    python benchmarks/generation_speed.py --quick    # smoke run, < 30 s
"""

from __future__ import annotations

import warnings

import torch
from common import base_parser, interleaved, machine, markdown_table, setup, write_results

TARGET = 1.0  # safeformer tokens/s / x-transformers tokens/s, at least


def build(dim: int, depth: int, heads: int, vocab: int, max_len: int, cross: bool, device: torch.device):
    """x-transformers' wrapper and safeformer's wrapper around the same weights."""
    import x_transformers as xt

    import safeformer as sf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = xt.TransformerWrapper(
            num_tokens=vocab, max_seq_len=max_len,
            attn_layers=xt.Decoder(dim=dim, depth=depth, heads=heads, attn_dim_head=dim // heads, rotary_pos_emb=True,
                                   rotary_emb_dim=max(dim // heads // 2, 32), attn_flash=True, cross_attend=cross),
        )
    with torch.no_grad():  # move weights off their init (norm gains of exactly 1, zero biases)
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    sf_net = sf.from_x_transformers(net)
    return xt.AutoregressiveWrapper(net).to(device).eval(), sf.AutoregressiveWrapper(sf_net).to(device).eval()


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=None, help="new tokens per sample (default 256)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--context-len", type=int, default=32)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    args = p.parse_args()
    device = setup(args)
    n_new = args.tokens or (32 if args.quick else 256)
    rounds = args.rounds or (4 if args.quick else 15)
    b, n, j = args.batch, args.prompt_len, args.context_len
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab, (b, n), generator=g).to(device)
    context = torch.randn(b, j, args.dim, generator=g).to(device)
    ctx_mask = (torch.arange(j)[None] < torch.randint(1, j + 1, (b,), generator=g)[:, None]).to(device)
    lens = torch.randint(1, n + 1, (b,), generator=g)
    lens[0] = n
    left_mask = (torch.arange(n)[None] >= (n - lens[:, None])).to(device)  # (b, n) left padding
    right = torch.where(torch.arange(n)[None] < lens[:, None], prompts.cpu(), 0).to(device)  # right-padded
    # x-transformers takes right-padded prompts plus their lengths and right-aligns them itself;
    # safeformer takes the left-padded prompts (the same tokens at the end) and their mask.
    left = torch.zeros_like(prompts)
    for s in range(b):
        left[s, n - int(lens[s]):] = right[s, : int(lens[s])]

    cases = {
        "decoder": (False, dict(prompts=prompts), dict(prompts=prompts)),
        "decoder + context": (True, dict(prompts=prompts, context=context, context_mask=ctx_mask),
                              dict(prompts=prompts, context=context, context_mask=ctx_mask)),
        "ragged prompts (left-padded)": (False, dict(prompts=right, prompt_lens=lens.to(device)),
                                         dict(prompts=left, mask=left_mask)),
    }
    rows, ratios, targets = [], {}, {}
    for name, (cross, xt_kw, sf_kw) in cases.items():
        torch.manual_seed(0)
        xt_model, sf_model = build(args.dim, args.depth, args.heads, args.vocab, n + n_new, cross, device)
        outs = {}

        def run_xt(xt_model=xt_model, xt_kw=xt_kw, outs=outs):
            outs["xt"] = xt_model.generate(xt_kw["prompts"], n_new, temperature=0.0, cache_kv=True,
                                           **{k: v for k, v in xt_kw.items() if k != "prompts"})

        def run_sf(sf_model=sf_model, sf_kw=sf_kw, outs=outs):
            outs["sf"] = sf_model.generate(sf_kw["prompts"], n_new, temperature=0.0, cache_kv=True,
                                           **{k: v for k, v in sf_kw.items() if k != "prompts"})

        t = interleaved({"x-transformers": run_xt, "safeformer": run_sf}, rounds=rounds, device=device, warmup=1)
        same = torch.equal(outs["xt"], outs["sf"])
        agree = (outs["xt"] == outs["sf"]).float().mean().item()
        speed = 1.0 / t.ratio("safeformer")  # tokens/s ratio = time ratio inverted
        per_round = sorted(1.0 / r for r in t.per_round("safeformer"))
        lo, hi = per_round[len(per_round) // 4], per_round[min(len(per_round) - 1, 3 * len(per_round) // 4)]
        row = [name, f"{speed:.3f}x", f"{1.0 / t.ratio_of_medians('safeformer'):.3f}x", f"{lo:.3f}x - {hi:.3f}x",
               "yes" if same else f"no ({agree:.0%} of tokens agree)"]
        if device.type == "cuda":
            row += [f"{b * n_new / t.median('x-transformers'):.0f}", f"{b * n_new / t.median('safeformer'):.0f}"]
        rows.append(row)
        label = f"{name} tokens/s (higher is better)"
        ratios[label] = round(speed, 4)
        targets[label] = TARGET

    header = ["case", "sf tokens/s / xt tokens/s (median per-round)", "ratio of medians", "per-round 25%-75%",
              "same tokens"]
    if device.type == "cuda":
        header += ["xt tokens/s", "sf tokens/s"]
    lines = [
        "# KV-cached greedy generation: safeformer vs x-transformers",
        "",
        f"Machine: {machine(device)}.",
        f"Model: x-transformers Decoder dim={args.dim} depth={args.depth} heads={args.heads} (head dim "
        f"{args.dim // args.heads}), rotary, attn_flash=True, vocab {args.vocab}; safeformer runs the same weights "
        f"(from_x_transformers). Batch {b}, prompts of {n} tokens, {n_new} new tokens, greedy, cache_kv=True; "
        f"context of {j} positions with random padding where used. Each library's AutoregressiveWrapper.generate. "
        f"{rounds} interleaved rounds after 1 warm-up generation each; ratio = x-transformers time / safeformer "
        "time in the same round (= tokens/s ratio, higher is better).",
        "",
        *markdown_table(header, rows),
        "",
        f"Target: safeformer tokens/s >= {TARGET:.1f}x x-transformers'.",
    ]
    for label in ratios:
        lines.append(f"Measured, {label.removesuffix(' (higher is better)')}: {ratios[label]:.3f}x "
                     f"({'met' if ratios[label] >= TARGET else 'NOT met'}).")
    lines.append("Ragged prompts: x-transformers counts padding in the positions, safeformer does not, so their "
                 "tokens may differ there by design.")
    if device.type != "cuda":
        lines.append("Absolute tokens/s are not reported on a CPU (shared machine); ratios only.")
    write_results("generation_speed", args, lines, ratios, targets, "cached generation: tokens/s safeformer / x-transformers")


if __name__ == "__main__":
    main()
