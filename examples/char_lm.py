"""A character-level (byte-level) language model on any text file.

Usage:
    python examples/char_lm.py                       # default text: Python's own help topics
    python examples/char_lm.py book.txt --steps 3000
    python examples/char_lm.py --out runs/charlm     # also writes metrics.json and the model

The default text is ``pydoc_data.topics`` (about 465 kB of the Python language reference that
``help()`` shows), which ships with every CPython installation, so the script runs offline anywhere;
if a stripped-down Python lacks it, the script trains on its own source file instead.

Prints the training loss every ``--log_every`` steps and the validation loss every ``--eval_every``
steps, in nats and bits per byte, then a sample continuing a prompt from the validation text.

Shape legend: b batch, n window length (``--seq_len`` + 1 bytes), v = 256 byte values.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from safeformer import Decoder, TransformerWrapper
from safeformer.decoding.generation import AutoregressiveWrapper, min_p


def default_text() -> tuple[str, str]:
    """``(text, where it came from)``: Python's help topics, or this script's source as a fallback."""
    try:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics)), "pydoc_data.topics (the Python help topics)"
    except ImportError:
        return Path(__file__).read_text(encoding="utf-8"), __file__


def windows(data: torch.Tensor, b: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """``(b, n)`` random windows of ``data``'s bytes."""
    start = torch.randint(0, len(data) - n + 1, (b,), generator=generator)
    return torch.stack([data[s:s + n] for s in start.tolist()]).long()


@torch.no_grad()
def validation_loss(model: AutoregressiveWrapper, data: torch.Tensor, n: int, batches: int, b: int) -> float:
    """Mean loss over ``batches`` fixed windows of the validation bytes (the same windows every time)."""
    model.eval()
    g = torch.Generator().manual_seed(1234)
    loss = sum(model(windows(data, b, n, g)).item() for _ in range(batches)) / batches
    model.train()
    return loss


def paragraph_start(data: torch.Tensor) -> int:
    """Index of the first paragraph of ``data`` that starts with a capital letter (0 if none): a prompt."""
    raw = bytes(data[:100_000].tolist())
    for i in range(2, len(raw)):
        if raw[i - 2:i] == b"\n\n" and 65 <= raw[i] <= 90:
            return i
    return 0


@torch.no_grad()
def generate_long(model: AutoregressiveWrapper, prompt: torch.Tensor, length: int, window: int, temperature: float,
                  chunk: int = 32) -> torch.Tensor:
    """``length`` new bytes after ``prompt``, ``chunk`` at a time, each seeing at most the last ``window`` bytes.

    The model never attends over more positions than it was trained on (``window``).
    """
    seq = prompt.long()
    while len(seq) < len(prompt) + length:
        step = min(chunk, len(prompt) + length - len(seq))
        context = seq[-(window - step + 1):]
        new = model.generate(context[None], step, temperature=temperature, filter_logits_fn=min_p,
                             filter_kwargs={"min_p": 0.05})
        seq = torch.cat((seq, new[0]))
    return seq[len(prompt):]


def plot_losses(path: Path, losses: list[float], lrs: list[float], val: dict | None = None, title: str = "") -> None:
    """train.py's loss plot (raw and centred-mean training loss, validation, learning rate per step), reused."""
    root = str(Path(__file__).resolve().parents[1])  # the repository root, where train.py lives
    if root not in sys.path:
        sys.path.insert(0, root)
    from train import plot_loss_curves

    plot_loss_curves(path, losses, val=val, lr=lrs, title=title)


def main(argv: list[str] | None = None) -> dict:
    """Train, evaluate, sample, print; returns the metrics (also written to ``--out`` when given)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("text", nargs="?", default=None, help="a UTF-8 text file (None: Python's own help topics, offline)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--batch_size", type=int, default=32, help="byte windows per step")
    p.add_argument("--seq_len", type=int, default=128, help="bytes of context per window")
    p.add_argument("--dim", type=int, default=128, help="model width")
    p.add_argument("--depth", type=int, default=3, help="layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of the one-cycle schedule (AdamW)")
    p.add_argument("--log_every", type=int, default=100, help="print the mean training loss every N steps")
    p.add_argument("--eval_every", type=int, default=250, help="validation loss every N steps")
    p.add_argument("--eval_batches", type=int, default=8, help="validation batches per evaluation")
    p.add_argument("--sample_len", type=int, default=300, help="bytes to generate at the end")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    p.add_argument("--seed", type=int, default=0, help="seed of the init, the data and sampling")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (0: PyTorch's default)")
    p.add_argument("--out", default="", help="if set, write metrics.json, loss.png (loss curves) and the model (save_pretrained) here")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "log_every", "eval_every", "eval_batches"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive, got {getattr(args, name)}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    if args.text is None:
        text, source = default_text()
    else:
        text, source = Path(args.text).read_text(encoding="utf-8", errors="replace"), args.text
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    n = args.seq_len + 1
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    if len(val) < n:
        p.error(f"the text has {len(data)} bytes; it needs at least {math.ceil(n / 0.1)} for a validation window of {n}")
    print(f"text: {source}, {len(data):,} bytes ({len(train):,} train / {len(val):,} validation)")

    torch.manual_seed(args.seed)
    net = TransformerWrapper(num_tokens=256, max_seq_len=n,
                             attn_layers=Decoder(dim=args.dim, depth=args.depth, heads=args.heads,
                                                 dim_head=args.dim // args.heads, rotary_pos_emb=True))
    model = AutoregressiveWrapper(net)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    g = torch.Generator().manual_seed(args.seed + 1)
    losses, val_losses, lrs = [], [], []
    for step in tqdm(range(1, args.steps + 1), desc="char-lm", file=sys.stderr, dynamic_ncols=True):
        loss = model(windows(train, args.batch_size, n, g))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lrs.append(opt.param_groups[0]["lr"])  # the OneCycleLR rate this step used
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.steps:
            mean = sum(losses[-args.log_every:]) / len(losses[-args.log_every:])
            tqdm.write(f"step {step:5d} | loss {mean:.4f} nats = {mean / math.log(2):.3f} bits per byte")
        if step % args.eval_every == 0 or step == args.steps:
            v = validation_loss(model, val, n, args.eval_batches, args.batch_size)
            val_losses.append((step, v))
            tqdm.write(f"step {step:5d} | validation loss {v:.4f} nats = {v / math.log(2):.3f} bits per byte")

    prompt_bytes = val[paragraph_start(val):][:48].long()
    torch.manual_seed(args.seed + 2)
    new = generate_long(model, prompt_bytes, args.sample_len, n - 1, args.temperature)
    prompt = bytes(prompt_bytes.tolist()).decode("utf-8", errors="replace")
    sample = bytes(new.tolist()).decode("utf-8", errors="replace")
    print(f"\nvalidation loss {val_losses[-1][1]:.4f} nats = {val_losses[-1][1] / math.log(2):.3f} bits per byte "
          f"(uniform over bytes: 8 bits)\n--- prompt ---\n{prompt}\n--- sample ---\n{sample}")
    metrics = dict(source=source, steps=args.steps, losses=losses, val_losses=val_losses,
                   val_bits_per_byte=val_losses[-1][1] / math.log(2), prompt=prompt, sample=sample)
    if args.out:
        out = Path(args.out)
        model.save_pretrained(out / "model")
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
        plot_losses(out / "loss.png", losses, lrs, val={"validation": tuple(zip(*val_losses))},
                    title="char-lm: training and validation loss (nats per byte)")
        print(f"wrote {out / 'metrics.json'}, {out / 'loss.png'} and {out / 'model'}/")
    return metrics


if __name__ == "__main__":
    main()
