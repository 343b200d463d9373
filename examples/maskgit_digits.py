"""A masked-token model (MaskGIT) draws 8x8 digits of a requested class, with classifier-free guidance.

scikit-learn ships 1797 handwritten digits of 8x8 pixels with 17 grey levels (``load_digits``, no
download). Each image is 64 tokens (its grey levels 0..16); token 17 is ``mask_id``, the hidden token.
A bidirectional ``TransformerWrapper`` (an ``Encoder`` with ``logits_dim=17``: it cannot even predict
the hidden token) is trained by ``NonAutoregressiveWrapper``: per image a cosine-scheduled fraction of
the pixels is hidden and the model predicts them. The class is a cross-attention context (a one-hot
vector, a context of length 1), dropped for 20% of the training images (an all-False ``context_mask``
row: an exact no-op), so one network models both ``p(image | class)`` and ``p(image)``.

Generation starts from 64 hidden tokens and, over ``--decode_steps`` parallel steps, samples every
hidden pixel from guided logits ``uncond + s * (cond - uncond)`` (both branches in one batched
forward per step), keeps the most confident ones per the schedule and hides the others again. A
logistic-regression classifier fitted on the real training images says which digit each sample looks
like; the script prints its accuracy against the requested class at guidance scales 0
(unconditional), 1 (plain conditional) and 3, and writes a grid of samples as a PNG.

Usage:
    python examples/maskgit_digits.py                  # default run (about 3 minutes on 1 CPU thread)
    python examples/maskgit_digits.py --steps 2000     # longer training
    python examples/maskgit_digits.py --quick          # a few seconds: a smoke test, numbers meaningless

Shape legend: b batch, n = 64 pixels, v = 17 grey levels, k = 10 classes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from safeformer import Encoder, NonAutoregressiveWrapper, TransformerWrapper

LEVELS, CLASSES, PIXELS = 17, 10, 64
MASK_ID = LEVELS  # 17


def load_digits_split(seed: int = 0) -> dict[str, torch.Tensor]:
    """The digits as ``(b, 64)`` grey levels, split 90/10 (stratified, fixed)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.as_tensor(digits.data, dtype=torch.long)  # values 0..16
    y = torch.as_tensor(digits.target, dtype=torch.long)
    idx_train, idx_val = train_test_split(torch.arange(len(y)).numpy(), test_size=0.1, stratify=y.numpy(), random_state=seed)
    return {"x_train": x[idx_train], "y_train": y[idx_train], "x_val": x[idx_val], "y_val": y[idx_val]}


def class_context(labels: torch.Tensor) -> torch.Tensor:
    """``(b, 1, 10)``: the class as a one-hot context of length 1."""
    return torch.nn.functional.one_hot(labels, CLASSES).float()[:, None]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=700, help="training steps")
    p.add_argument("--batch_size", type=int, default=48, help="images per step")
    p.add_argument("--dim", type=int, default=96, help="model width")
    p.add_argument("--depth", type=int, default=3, help="layers")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of the one-cycle schedule (AdamW)")
    p.add_argument("--cond_drop_prob", type=float, default=0.2, help="probability of dropping a sample's class (CFG)")
    p.add_argument("--decode_steps", type=int, default=12, help="parallel decoding steps per sample")
    p.add_argument("--samples", type=int, default=20, help="generated images per class and scale")
    p.add_argument("--scales", type=float, nargs="+", default=[0.0, 1.0, 3.0], help="guidance scales to sample at (0: unconditional, 1: conditional)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--choice_temperature", type=float, default=2.0, help="temperature of the noise on the confidences that pick which tokens to keep")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: PyTorch's default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the init, the data and sampling")
    p.add_argument("--out", type=str, default="runs/maskgit_digits",
                   help="output folder: metrics.json, maskgit_digits.png (samples), loss.png (loss curves)")
    p.add_argument("--quick", action="store_true", help="tiny settings for a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.batch_size, args.dim, args.depth, args.samples, args.decode_steps = 15, 16, 32, 1, 2, 4
    return args


def train(args, data) -> tuple[NonAutoregressiveWrapper, list[float], list[float]]:
    torch.manual_seed(args.seed)
    net = TransformerWrapper(
        num_tokens=LEVELS + 1, logits_dim=LEVELS, max_seq_len=PIXELS,
        attn_layers=Encoder(dim=args.dim, depth=args.depth, heads=4, dim_head=args.dim // 4, cross_attend=True,
                            dim_context=CLASSES, attn_dropout=0.0, ff_dropout=0.1))
    model = NonAutoregressiveWrapper(net, mask_id=MASK_ID, steps=args.decode_steps, schedule="cosine",
                                     cond_drop_prob=args.cond_drop_prob)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=max(args.steps, 1), pct_start=0.1)
    g = torch.Generator().manual_seed(args.seed + 1)
    x_train, y_train = data["x_train"], data["y_train"]
    losses, lrs = [], []
    model.train()
    for step in range(args.steps):
        idx = torch.randint(0, len(y_train), (args.batch_size,), generator=g)
        loss = model(x_train[idx], context=class_context(y_train[idx]), generator=g).loss  # Losses namedtuple
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lrs.append(opt.param_groups[0]["lr"])  # the OneCycleLR rate this step used
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (step + 1) % max(args.steps // 10, 1) == 0:
            print(f"step {step + 1:5d} | loss {sum(losses[-50:]) / len(losses[-50:]):.4f}", file=sys.stderr)
    return model.eval(), losses, lrs


def plot(path: Path, samples: dict[float, torch.Tensor], labels: torch.Tensor, accuracy: dict[float, float], per: int = 4) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scales = list(samples)
    fig, axes = plt.subplots(1, len(scales), figsize=(2.6 * len(scales), 6.2), squeeze=False)
    for col, s in enumerate(scales):
        rows = []
        for k in range(CLASSES):
            imgs = samples[s][labels == k][:per].reshape(-1, 8, 8).float()
            if imgs.shape[0] < per:
                imgs = torch.cat((imgs, torch.zeros(per - imgs.shape[0], 8, 8)))
            rows.append(torch.cat(list(imgs), dim=1))  # (8, per * 8): samples of class k side by side
        grid = torch.cat(rows, dim=0)  # (10 * 8, per * 8): one row per class
        ax = axes[0][col]
        ax.imshow(grid.numpy(), cmap="gray_r", vmin=0, vmax=16)
        ax.set_title(f"cond_scale {s:g}\naccuracy {accuracy[s]:.2f}")
        ax.set_yticks([4 + 8 * k for k in range(CLASSES)], [str(k) for k in range(CLASSES)])
        ax.set_xticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_losses(path: Path, losses: list[float], lrs: list[float], val: dict | None = None, title: str = "") -> None:
    """train.py's loss plot (raw and centred-mean training loss, validation, learning rate per step), reused."""
    root = str(Path(__file__).resolve().parents[1])  # the repository root, where train.py lives
    if root not in sys.path:
        sys.path.insert(0, root)
    from train import plot_loss_curves

    plot_loss_curves(path, losses, val=val, lr=lrs, title=title)


def main(argv: list[str] | None = None) -> dict:
    from sklearn.linear_model import LogisticRegression

    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    data = load_digits_split(args.seed)
    model, losses, lrs = train(args, data)
    train_s = time.time() - t0
    clf = LogisticRegression(max_iter=5000).fit(data["x_train"].numpy() / 16, data["y_train"].numpy())
    real_acc = float((clf.predict(data["x_val"].numpy() / 16) == data["y_val"].numpy()).mean())
    labels = torch.arange(CLASSES).repeat_interleave(args.samples)
    accuracy, per_class, samples, seconds, spread = {}, {}, {}, {}, {}
    mask_id_left = 0
    for s in args.scales:
        torch.manual_seed(args.seed + 3)
        t1 = time.time()
        imgs = model.generate(context=class_context(labels), cond_scale=s, temperature=args.temperature,
                              choice_temperature=args.choice_temperature)  # (b, 64)
        seconds[s] = time.time() - t1
        mask_id_left += int((imgs == MASK_ID).sum())
        hit = torch.as_tensor(clf.predict(imgs.numpy() / 16)) == labels
        accuracy[s] = float(hit.float().mean())
        per_class[s] = [float(hit[labels == k].float().mean()) for k in range(CLASSES)]
        # diversity: per-pixel standard deviation within each requested class, averaged (grey levels)
        spread[s] = float(torch.stack([imgs[labels == k].float().std(0).mean() for k in range(CLASSES)]).mean()) \
            if args.samples > 1 else 0.0
        samples[s] = imgs
    real_spread = float(torch.stack([data["x_val"][data["y_val"] == k].float().std(0).mean() for k in range(CLASSES)]).mean())
    final_loss = sum(losses[-50:]) / max(len(losses[-50:]), 1)
    print(f"trained {args.steps} steps in {train_s:.1f} s; final loss (cross-entropy of hidden pixels) {final_loss:.4f}")
    print(f"classifier on real validation images: accuracy {real_acc:.3f}, within-class spread {real_spread:.2f}")
    print(f"class accuracy of generated digits ({args.samples} per class, {args.decode_steps} decoding steps)")
    print("| cond_scale | accuracy | worst class | spread | sampling s |")
    print("|---:|---:|---:|---:|---:|")
    for s in args.scales:
        worst = min(range(CLASSES), key=lambda k: per_class[s][k])
        print(f"| {s:g} | {accuracy[s]:.3f} | {worst} ({per_class[s][worst]:.2f}) | {spread[s]:.2f} | {seconds[s]:.1f} |")
    plot_losses(out / "loss.png", losses, lrs, title="maskgit_digits: training loss (cross-entropy of hidden pixels)")
    plot(out / "maskgit_digits.png", samples, labels, accuracy)
    result = {"accuracy": accuracy, "per_class": per_class, "spread": spread, "real_accuracy": real_acc,
              "real_spread": real_spread, "final_loss": final_loss, "mask_id_left": mask_id_left,
              "train_seconds": train_s, "sample_seconds": seconds, "total_seconds": time.time() - t0}
    (out / "metrics.json").write_text(json.dumps({k: ({str(kk): vv for kk, vv in v.items()} if isinstance(v, dict) else v)
                                                  for k, v in result.items()}, indent=2))
    print(f"wrote {out / 'maskgit_digits.png'}, {out / 'loss.png'} and {out / 'metrics.json'} ({result['total_seconds']:.1f} s in all)")
    return result


if __name__ == "__main__":
    main()
