"""An encoder-decoder (``XTransformer``) learns to copy or reverse sequences of varying length.

Sources have 0 to ``--max_len`` symbols, so some are empty: an all-False source mask, which leaves
the decoder's cross-attention with no key at all (a dead row in every layer). safeformer makes that an
exact no-op instead of NaN, so the model trains on empty sources like on any other and learns to
answer them with an immediate end token.

Usage:
    python examples/copy_reverse.py                      # reverse, default settings (about a minute)
    python examples/copy_reverse.py --task copy --steps 500
    python examples/copy_reverse.py --out runs/reverse   # also writes metrics.json and the model

Prints the loss every ``--log_every`` steps, then the exact-match accuracy of greedy decoding on
fresh sequences: overall, on empty sources, and per source length, with a few examples.

Shape legend: b batch, j source length (max_len), n target length (max_len + 2: BOS, symbols, EOS).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from safeformer import XTransformer

PAD, BOS, EOS = 0, 1, 2  # symbols are the tokens 3 .. 3 + vocab - 1
FIRST = 3


def make_batch(b: int, max_len: int, vocab: int, task: str, generator: torch.Generator):
    """A batch of sources and targets.

    Args:
        b: batch size.
        max_len: longest source (lengths are uniform in ``0 .. max_len``).
        vocab: number of distinct symbols.
        task: ``"copy"`` or ``"reverse"``.
        generator: the random source.

    Returns:
        ``src (b, j)``, ``src_mask (b, j)``, ``tgt (b, n)``, ``tgt_mask (b, n)``; padded positions hold
        ``PAD`` and are False in the masks.
    """
    lengths = torch.randint(0, max_len + 1, (b,), generator=generator)  # (b,)
    symbols = torch.randint(FIRST, FIRST + vocab, (b, max_len), generator=generator)
    pos = torch.arange(max_len)
    src_mask = pos[None] < lengths[:, None]  # (b, j)
    src = torch.where(src_mask, symbols, PAD)
    if task == "reverse":  # position i of the answer is source position length - 1 - i
        idx = (lengths[:, None] - 1 - pos[None]).clamp(min=0)
        answer = torch.where(src_mask, src.gather(1, idx), PAD)
    else:
        answer = src
    tgt = torch.full((b, max_len + 2), PAD)
    tgt[:, 0] = BOS
    tgt[:, 1:-1] = answer
    tgt[torch.arange(b), lengths + 1] = EOS
    tgt_mask = torch.arange(max_len + 2)[None] < (lengths[:, None] + 2)  # (b, n)
    return src, src_mask, tgt, tgt_mask


@torch.no_grad()
def evaluate(model: XTransformer, args, generator: torch.Generator) -> dict:
    """Greedy decoding on fresh sequences; exact match = every token up to and including EOS right."""
    src, src_mask, tgt, _ = make_batch(args.eval_samples, args.max_len, args.vocab, args.task, generator)
    start = torch.full((len(src), 1), BOS)
    out = model.generate(src, start, args.max_len + 1, mask=src_mask, eos_token=EOS, temperature=0.0)
    expected = tgt[:, 1:]  # symbols, EOS, then PAD (generate writes pad_value = PAD after EOS)
    hit = (out == expected).all(dim=1)
    lengths = src_mask.sum(1)
    by_length = {int(n): float(hit[lengths == n].float().mean()) for n in lengths.unique()}
    examples = [(src[i, : lengths[i]].tolist(), out[i].tolist(), bool(hit[i])) for i in range(4)]
    return dict(exact_match=float(hit.float().mean()), exact_match_empty=by_length.get(0, float("nan")),
                empty_sources=int((lengths == 0).sum()), by_length=by_length, examples=examples)


def plot_losses(path: Path, losses: list[float], lrs: list[float], val: dict | None = None, title: str = "") -> None:
    """train.py's loss plot (raw and centred-mean training loss, validation, learning rate per step), reused."""
    root = str(Path(__file__).resolve().parents[1])  # the repository root, where train.py lives
    if root not in sys.path:
        sys.path.insert(0, root)
    from train import plot_loss_curves

    plot_loss_curves(path, losses, val=val, lr=lrs, title=title)


def main(argv: list[str] | None = None) -> dict:
    """Train, evaluate, print; returns the metrics (also written to ``--out`` when given)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--task", choices=("copy", "reverse"), default="reverse", help="copy the source or reverse it")
    p.add_argument("--steps", type=int, default=1200, help="optimizer steps")
    p.add_argument("--batch_size", type=int, default=64, help="sequence pairs per step")
    p.add_argument("--max_len", type=int, default=12, help="longest source; lengths are uniform in 0..max_len")
    p.add_argument("--vocab", type=int, default=10, help="distinct symbols")
    p.add_argument("--dim", type=int, default=64, help="model width")
    p.add_argument("--depth", type=int, default=2, help="encoder and decoder layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of the one-cycle schedule (AdamW)")
    p.add_argument("--eval_samples", type=int, default=500, help="fresh sequences in the evaluation")
    p.add_argument("--log_every", type=int, default=100, help="print the mean training loss every N steps")
    p.add_argument("--seed", type=int, default=0, help="seed of the init, the data and sampling")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (0: PyTorch's default)")
    p.add_argument("--out", default="", help="if set, write metrics.json, loss.png (loss curves) and the model (save_pretrained) here")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "max_len", "vocab", "eval_samples", "log_every"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive, got {getattr(args, name)}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)
    model = XTransformer(
        dim=args.dim, enc_num_tokens=FIRST + args.vocab, enc_max_seq_len=args.max_len,
        dec_num_tokens=FIRST + args.vocab, dec_max_seq_len=args.max_len + 2, enc_depth=args.depth,
        dec_depth=args.depth, enc_heads=args.heads, dec_heads=args.heads, dim_head=args.dim // args.heads,
        pad_value=PAD,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    data = torch.Generator().manual_seed(args.seed + 1)
    losses, lrs = [], []
    for step in tqdm(range(1, args.steps + 1), desc=f"{args.task}", file=sys.stderr, dynamic_ncols=True):
        src, src_mask, tgt, tgt_mask = make_batch(args.batch_size, args.max_len, args.vocab, args.task, data)
        loss = model(src, tgt, mask=src_mask, tgt_mask=tgt_mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lrs.append(opt.param_groups[0]["lr"])  # the OneCycleLR rate this step used
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.steps:
            tqdm.write(f"step {step:5d} | loss {sum(losses[-args.log_every:]) / len(losses[-args.log_every:]):.4f}")

    metrics = evaluate(model, args, torch.Generator().manual_seed(args.seed + 2))
    print(f"\n{args.task}: exact match {metrics['exact_match']:.3f} on {args.eval_samples} fresh sequences; "
          f"empty sources {metrics['exact_match_empty']:.3f} ({metrics['empty_sources']} of them)")
    print("by source length: " + ", ".join(f"{n}: {a:.2f}" for n, a in metrics["by_length"].items()))
    for source, output, ok in metrics["examples"]:
        print(f"  source {source} -> {output} {'ok' if ok else 'WRONG'}")
    metrics.update(task=args.task, steps=args.steps, losses=losses)
    if args.out:
        out = Path(args.out)
        model.save_pretrained(out / "model")
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
        plot_losses(out / "loss.png", losses, lrs, title=f"{args.task}: training loss (cross-entropy)")
        print(f"wrote {out / 'metrics.json'}, {out / 'loss.png'} and {out / 'model'}/")
    return metrics


if __name__ == "__main__":
    main()
