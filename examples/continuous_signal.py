"""A continuous autoregressive model draws 1-D waveforms of a requested class, with classifier-free guidance.

Four classes of signal, 48 steps each (three periods of 16 steps): sine, square, triangle and sawtooth,
each with a random phase, a random amplitude in [0.7, 1.3] and Gaussian noise (std 0.05). A causal
``ContinuousTransformerWrapper`` (``dim_in=1``) predicts a mean and a log-variance for each next step
(``ContinuousAutoregressiveWrapper(probabilistic=True)``, a Gaussian negative log-likelihood); the
class is an adaptive-norm condition (``use_adaptive_layernorm=True``, a one-hot ``condition (b, 4)``),
dropped for 20% of the training samples (the stack's learned null condition takes its place), so one
network models both ``p(signal | class)`` and ``p(signal)``.

Generation starts from one step (the value 0, the BOS every training sequence starts with) and samples
48 steps from ``N(mean, var)``, the mean guided by ``uncond + s * (cond - uncond)``: both branches run
as one batched forward sharing one KV cache. A logistic-regression classifier fitted on the magnitude
spectra of real signals (phase-invariant) says which class each generated signal looks like; the
script prints its accuracy against the requested class at guidance scales 0 (unconditional), 1 (plain
conditional) and 3, and writes a PNG of generated signals.

Usage:
    python examples/continuous_signal.py                 # default run (about 2-3 minutes on 1 CPU thread)
    python examples/continuous_signal.py --steps 3000    # longer training
    python examples/continuous_signal.py --quick         # a few seconds: a smoke test, numbers meaningless

Shape legend: b batch, n = 49 steps (BOS + 48 values), k = 4 classes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from safeformer import ContinuousAutoregressiveWrapper, ContinuousTransformerWrapper, Decoder

CLASSES = ("sine", "square", "triangle", "sawtooth")
PERIOD, LENGTH = 16, 48


def make_signals(labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``(b, LENGTH)`` waveforms of the given classes: random phase, amplitude in [0.7, 1.3], noise 0.05."""
    b = labels.shape[0]
    phase = torch.rand(b, 1, generator=generator)  # in periods
    amp = 0.7 + 0.6 * torch.rand(b, 1, generator=generator)
    t = torch.arange(LENGTH)[None] / PERIOD + phase  # (b, LENGTH), in periods
    frac = t - torch.floor(t)
    waves = torch.stack([
        torch.sin(2 * math.pi * t),
        torch.where(frac < 0.5, 1.0, -1.0),
        4 * (frac - 0.5).abs() - 1,
        2 * frac - 1,
    ])  # (k, b, LENGTH)
    x = waves[labels, torch.arange(b)] * amp
    return x + 0.05 * torch.randn(b, LENGTH, generator=generator)


def as_sequence(signals: torch.Tensor) -> torch.Tensor:
    """``(b, n, 1)``: a BOS step of value 0, then the signal."""
    return torch.cat((torch.zeros(signals.shape[0], 1), signals), dim=1)[..., None]


def spectrum_features(signals: torch.Tensor) -> torch.Tensor:
    """Phase-invariant features: the normalised magnitude spectrum of the centred signal."""
    spec = torch.fft.rfft(signals - signals.mean(1, keepdim=True), dim=1).abs()
    return spec / spec.norm(dim=1, keepdim=True).clamp(min=1e-8)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=1500, help="training steps")
    p.add_argument("--batch_size", type=int, default=64, help="signals per step")
    p.add_argument("--dim", type=int, default=64, help="model width")
    p.add_argument("--depth", type=int, default=3, help="layers")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of the one-cycle schedule (AdamW)")
    p.add_argument("--cond_drop_prob", type=float, default=0.2, help="probability of dropping a sample's class (CFG)")
    p.add_argument("--samples", type=int, default=64, help="generated signals per class and scale")
    p.add_argument("--scales", type=float, nargs="+", default=[0.0, 1.0, 3.0], help="guidance scales to sample at (0: unconditional, 1: conditional)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: PyTorch's default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the init, the data and sampling")
    p.add_argument("--out", type=str, default="runs/continuous_signal",
                   help="output folder: metrics.json, continuous_signal.png (samples), loss.png (loss curves)")
    p.add_argument("--quick", action="store_true", help="tiny settings for a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.batch_size, args.dim, args.depth, args.samples = 20, 16, 32, 1, 8
    return args


def train(args) -> tuple[ContinuousAutoregressiveWrapper, list[float], list[float]]:
    torch.manual_seed(args.seed)
    net = ContinuousTransformerWrapper(
        dim_in=1, dim_out=2, max_seq_len=LENGTH + 1,
        attn_layers=Decoder(dim=args.dim, depth=args.depth, heads=4, dim_head=args.dim // 4, rotary_pos_emb=True,
                            use_adaptive_layernorm=True, dim_condition=len(CLASSES), adaptive_null="learned"))
    model = ContinuousAutoregressiveWrapper(net, probabilistic=True, cond_drop_prob=args.cond_drop_prob)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=max(args.steps, 1), pct_start=0.1)
    g = torch.Generator().manual_seed(args.seed + 1)
    losses, lrs = [], []
    model.train()
    for step in range(args.steps):
        labels = torch.randint(0, len(CLASSES), (args.batch_size,), generator=g)
        x = as_sequence(make_signals(labels, g))
        loss = model(x, condition=torch.nn.functional.one_hot(labels, len(CLASSES)).float())
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


def classifier(seed: int):
    from sklearn.linear_model import LogisticRegression

    g = torch.Generator().manual_seed(seed + 2)
    labels = torch.arange(len(CLASSES)).repeat(500)
    clf = LogisticRegression(max_iter=2000).fit(spectrum_features(make_signals(labels, g)).numpy(), labels.numpy())
    test_labels = torch.arange(len(CLASSES)).repeat(100)
    real = float((clf.predict(spectrum_features(make_signals(test_labels, g)).numpy()) == test_labels.numpy()).mean())
    return clf, real


def plot(path: Path, generated: dict[float, torch.Tensor], labels: torch.Tensor, accuracy: dict[float, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scales = list(generated)
    fig, axes = plt.subplots(len(CLASSES), len(scales), figsize=(4 * len(scales), 1.8 * len(CLASSES)), sharex=True, sharey=True)
    axes = [[axes]] if len(CLASSES) == 1 and len(scales) == 1 else axes
    for col, s in enumerate(scales):
        for row, name in enumerate(CLASSES):
            ax = axes[row][col] if len(scales) > 1 else axes[row]
            for sig in generated[s][labels == row][:3]:
                ax.plot(sig.numpy(), lw=1)
            ax.set_ylim(-2, 2)
            if row == 0:
                ax.set_title(f"cond_scale {s:g} (accuracy {accuracy[s]:.2f})")
            if col == 0:
                ax.set_ylabel(name)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_losses(path: Path, losses: list[float], lrs: list[float], val: dict | None = None, title: str = "") -> None:
    """train.py's loss plot (raw and centred-mean training loss, validation, learning rate per step), reused."""
    root = str(Path(__file__).resolve().parents[1])  # the repository root, where train.py lives
    if root not in sys.path:
        sys.path.insert(0, root)
    from train import plot_loss_curves

    plot_loss_curves(path, losses, val=val, lr=lrs, title=title)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model, losses, lrs = train(args)
    train_s = time.time() - t0
    clf, real_acc = classifier(args.seed)
    labels = torch.arange(len(CLASSES)).repeat_interleave(args.samples)
    cond = torch.nn.functional.one_hot(labels, len(CLASSES)).float()
    start = torch.zeros(labels.shape[0], 1, 1)
    accuracy, per_class, generated, seconds = {}, {}, {}, {}
    for s in args.scales:
        t1 = time.time()
        x = model.generate(start, LENGTH, condition=cond, cond_scale=s, temperature=args.temperature,
                           generator=torch.Generator().manual_seed(args.seed + 3))[..., 0]  # (b, LENGTH)
        seconds[s] = time.time() - t1
        finite = torch.isfinite(x).all(1)
        pred = torch.as_tensor(clf.predict(spectrum_features(torch.nan_to_num(x)).numpy()))
        hit = (pred == labels) & finite
        accuracy[s] = float(hit.float().mean())
        per_class[s] = [float(hit[labels == k].float().mean()) for k in range(len(CLASSES))]
        generated[s] = x
    final_loss = sum(losses[-50:]) / max(len(losses[-50:]), 1)
    print(f"trained {args.steps} steps in {train_s:.1f} s; final loss (Gaussian NLL per step) {final_loss:.4f}")
    print(f"classifier on real signals: accuracy {real_acc:.3f}")
    print("class accuracy of generated signals (does the signal look like the requested class?)")
    print("| cond_scale | accuracy | " + " | ".join(CLASSES) + " | sampling s |")
    print("|---:|---:|" + "---:|" * len(CLASSES) + "---:|")
    for s in args.scales:
        print(f"| {s:g} | {accuracy[s]:.3f} | " + " | ".join(f"{a:.2f}" for a in per_class[s]) + f" | {seconds[s]:.1f} |")
    plot_losses(out / "loss.png", losses, lrs, title="continuous_signal: training loss (Gaussian NLL per step)")
    plot(out / "continuous_signal.png", generated, labels, accuracy)
    result = {"accuracy": accuracy, "per_class": per_class, "real_accuracy": real_acc, "final_loss": final_loss,
              "train_seconds": train_s, "sample_seconds": seconds, "total_seconds": time.time() - t0}
    (out / "metrics.json").write_text(json.dumps({k: ({str(kk): vv for kk, vv in v.items()} if isinstance(v, dict) else v)
                                                  for k, v in result.items()}, indent=2))
    print(f"wrote {out / 'continuous_signal.png'}, {out / 'loss.png'} and {out / 'metrics.json'} ({result['total_seconds']:.1f} s in all)")
    return result


if __name__ == "__main__":
    main()
