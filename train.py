"""Train a class-conditional decoder with classifier-free guidance on the 8x8 digits.

The main job of safeformer, in one file. It learns to draw scikit-learn's 8x8 handwritten digits
(``sklearn.datasets.load_digits``, shipped inside the package: no download) pixel by pixel: each
image is a sequence of 64 tokens (its 17 grey levels, after a BOS token), and the digit's class is
the context of a decoder with cross-attention. During training each sample's condition is dropped
with probability ``cond_drop_prob`` (an all-False ``context_mask``, which safeformer turns into an
exact no-op), so one network learns both the conditional and the unconditional model. At the end it
samples every class at several guidance scales (0 = unconditional, 1 = conditional, >1 = guided),
scores the samples with a classifier fitted on the real training images, and prints a table of class
accuracy per scale.

Usage:
    python train.py                                  # the default run (about 6 minutes on 2 CPU cores)
    python train.py --steps 300 --out runs/quick     # any config field is a --key value override
    python train.py --out runs/quick --resume        # continue from runs/quick/checkpoint
    python train.py --bf16                           # bfloat16 autocast
    torchrun --nproc_per_node=2 train.py --out runs/ddp   # data-parallel (gloo on CPU, NCCL on CUDA)
    python train.py --help                           # every option with its default

Outputs (in --out): metrics.json, samples.png (a grid per guidance scale), loss.png, and
checkpoint/ (config.json + model.safetensors, loadable with TransformerWrapper.from_pretrained, plus
optimizer.safetensors and trainer.json for --resume). No pickle is written.

Shape legend: b batch, n = 65 positions (BOS + 64 pixels), v = 17 grey levels, k = 10 classes.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, load_model, save_file
from tqdm import tqdm

from safeformer import Decoder, TransformerWrapper
from safeformer.generation import AutoregressiveWrapper

LEVELS, CLASSES, PIXELS = 17, 10, 64  # grey levels 0..16 are the tokens 0..16
BOS = LEVELS  # token 17 starts every image; the model never predicts it (logits_dim = 17)


@dataclass
class Config:
    """Every setting of a run; each field is a ``--field value`` command-line option."""

    out: str = field(default="runs/digits", metadata={"help": "output folder"})
    seed: int = field(default=0, metadata={"help": "seed of the init, the data order, dropout and sampling"})
    # model
    dim: int = field(default=128, metadata={"help": "model width"})
    depth: int = field(default=4, metadata={"help": "decoder layers (each: self-attn, cross-attn, ff)"})
    heads: int = field(default=4, metadata={"help": "attention heads"})
    dim_head: int = field(default=32, metadata={"help": "head dim"})
    dropout: float = field(default=0.1, metadata={"help": "attention and feed-forward dropout"})
    # training
    steps: int = field(default=800, metadata={"help": "optimizer steps in the whole run"})
    batch_size: int = field(default=64, metadata={"help": "images per step, over all processes"})
    lr: float = field(default=2e-3, metadata={"help": "peak learning rate (AdamW)"})
    min_lr: float = field(default=1e-4, metadata={"help": "learning rate at the end of the cosine decay"})
    warmup: int = field(default=80, metadata={"help": "linear warm-up steps"})
    weight_decay: float = field(default=0.05, metadata={"help": "AdamW weight decay (matrices only)"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the gradient norm to this (0: no clipping)"})
    cond_drop_prob: float = field(default=0.2, metadata={"help": "probability of dropping a sample's class (CFG)"})
    bf16: bool = field(default=False, metadata={"help": "bfloat16 autocast for forward and loss"})
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda"})
    threads: int = field(default=1, metadata={"help": "CPU threads per process (0: PyTorch's default, all cores)"})
    # logging and checkpoints
    log_every: int = field(default=100, metadata={"help": "print step, loss and tokens/s every N steps"})
    eval_every: int = field(default=200, metadata={"help": "validation loss every N steps"})
    save_every: int = field(default=400, metadata={"help": "write the checkpoint every N steps"})
    resume: bool = field(default=False, metadata={"help": "continue from OUT/checkpoint"})
    stop_at: int = field(default=0, metadata={"help": "stop after this step as if interrupted (0: run all steps)"})
    # sampling and scoring
    scales: tuple[float, ...] = field(default=(0.0, 1.0, 2.0, 3.0), metadata={"help": "guidance scales, e.g. 0,1,2,3"})
    samples_per_class: int = field(default=50, metadata={"help": "images sampled per class and scale"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    debug_nan_step: int = field(default=0, metadata={"help": "testing: poison one gradient with NaN at this step"})

    def __post_init__(self):
        for name in ("dim", "depth", "heads", "dim_head", "steps", "batch_size", "log_every", "eval_every",
                     "save_every", "samples_per_class"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be positive, got {getattr(self, name)}")
        for name in ("dropout", "cond_drop_prob"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name} must be in [0, 1), got {getattr(self, name)}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= --min_lr <= --lr and --lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0 (0: PyTorch's default), got {self.threads}")
        if self.grad_clip < 0 or self.temperature <= 0:
            raise ValueError(f"need --grad_clip >= 0 and --temperature > 0, got {self.grad_clip}, {self.temperature}")
        if not self.scales or any(s < 0 for s in self.scales):
            raise ValueError(f"--scales must be a non-empty list of scales >= 0, got {self.scales}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")


def parse_config(argv: list[str] | None = None) -> Config:
    """Build a ``Config`` from ``--key value`` options (booleans: ``--key`` / ``--no-key``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        kw = dict(default=f.default, help=f.metadata["help"])
        if f.type in (bool, "bool"):
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, **kw)
        elif f.name == "scales":
            parser.add_argument(f"--{f.name}", type=lambda s: tuple(float(x) for x in s.split(",") if x), **kw)
        else:
            parser.add_argument(f"--{f.name}", type=type(f.default), **kw)
    return Config(**vars(parser.parse_args(argv)))


# ---------------------------------------------------------------------------------------------------
# Data: the digits as token sequences, a fixed stratified train/validation split
# ---------------------------------------------------------------------------------------------------


def load_digits_tokens() -> dict[str, torch.Tensor]:
    """The 1797 digits as ``(b, 65)`` token sequences (BOS + 64 grey levels) and ``(b,)`` labels."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = torch.from_numpy(digits.images.reshape(-1, PIXELS).astype(np.int64))  # (b, 64) in 0..16
    labels = torch.from_numpy(digits.target.astype(np.int64))
    tokens = torch.cat((torch.full((len(pixels), 1), BOS), pixels), dim=1)  # (b, 65)
    train, val = train_test_split(np.arange(len(labels)), test_size=0.1, stratify=labels.numpy(), random_state=0)
    train, val = torch.from_numpy(np.sort(train)), torch.from_numpy(np.sort(val))
    return dict(x_train=tokens[train], y_train=labels[train], x_val=tokens[val], y_val=labels[val])


def class_context(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The condition: a one-hot context ``(b, 1, 10)`` and its mask ``(b, 1)`` (all True)."""
    context = F.one_hot(labels, CLASSES).float()[:, None, :]
    return context, torch.ones(labels.shape[0], 1, dtype=torch.bool, device=labels.device)


def batch_indices(step: int, n: int, batch_size: int, seed: int, rank: int, world: int) -> torch.Tensor:
    """This process's share of step ``step``'s batch: a function of the step alone, so resuming is exact."""
    per_epoch = n // batch_size
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return perm[k * batch_size:(k + 1) * batch_size][rank::world]


# ---------------------------------------------------------------------------------------------------
# Model, schedule, checkpoints
# ---------------------------------------------------------------------------------------------------


def build_model(cfg: Config) -> AutoregressiveWrapper:
    """A decoder that cross-attends to the class, wrapped for next-token loss with condition dropout."""
    net = TransformerWrapper(
        num_tokens=LEVELS + 1, logits_dim=LEVELS, max_seq_len=PIXELS + 1,
        attn_layers=Decoder(dim=cfg.dim, depth=cfg.depth, heads=cfg.heads, dim_head=cfg.dim_head,
                            cross_attend=True, dim_context=CLASSES, attn_dropout=cfg.dropout,
                            ff_dropout=cfg.dropout),
    )
    return AutoregressiveWrapper(net, cond_drop_prob=cfg.cond_drop_prob, null_context="empty")


def learning_rate(cfg: Config, step: int) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at ``steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * t))


def save_checkpoint(path: Path, net: TransformerWrapper, opt: torch.optim.Optimizer, trainer: dict) -> None:
    """Write weights, optimizer state and trainer state (safetensors + JSON), replacing ``path`` atomically."""
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    net.save_pretrained(tmp)
    state = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, entry in state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{key}"] = value
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    trainer = dict(trainer, optimizer_groups=state["param_groups"], optimizer_scalars=scalars)
    (tmp / "trainer.json").write_text(json.dumps(trainer, indent=1))
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: Path, net: TransformerWrapper, opt: torch.optim.Optimizer, device) -> dict:
    """Load what ``save_checkpoint`` wrote into ``net`` and ``opt``; return the trainer state."""
    for name in ("model.safetensors", "optimizer.safetensors", "trainer.json"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"--resume: {path / name} is missing; is {path} a train.py checkpoint?")
    missing, unexpected = load_model(net, str(path / "model.safetensors"), strict=False, device=str(device))
    if missing or unexpected:
        raise ValueError(f"--resume: {path} was saved by a different model config "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]}); use the same --dim/--depth/...")
    trainer = json.loads((path / "trainer.json").read_text())
    state: dict[int, dict] = {}
    for key, value in load_file(str(path / "optimizer.safetensors")).items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    for key, value in trainer.pop("optimizer_scalars").items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    opt.load_state_dict({"state": state, "param_groups": trainer.pop("optimizer_groups")})
    return trainer


def clip_gradients(model: torch.nn.Module, max_norm: float) -> float:
    """Return the total gradient norm; scale the gradients down to ``max_norm`` only if it is finite.

    A non-finite norm leaves every gradient as it is, so ``first_nonfinite_grad`` can name its source
    (clipping by a NaN norm would spread the NaN to every gradient).
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm


def first_nonfinite_grad(model: torch.nn.Module) -> str:
    """``module (Type).param`` of the first parameter (in registration order) with a non-finite gradient."""
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            module, _, param = name.rpartition(".")
            return f"{module} ({type(modules[module]).__name__}).{param}"
    return "<none: the loss itself was non-finite>"


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes, in order: equal digests mean bit-identical weights."""
    h = hashlib.sha256()
    for _, p in sorted(model.state_dict().items()):
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def validation_loss(model: AutoregressiveWrapper, x: torch.Tensor, y: torch.Tensor, cfg: Config) -> tuple[float, float]:
    """Mean next-token loss on the validation images, with the class and without it."""
    model.eval()
    context, context_mask = class_context(y)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
        cond = model(x, context=context, context_mask=context_mask).item()
        uncond = model(x, context=context, context_mask=torch.zeros_like(context_mask)).item()
    model.train()
    return cond, uncond


# ---------------------------------------------------------------------------------------------------
# Sampling, scoring and plots (rank 0)
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def sample_and_score(model: AutoregressiveWrapper, data: dict, cfg: Config, device) -> dict:
    """Sample ``samples_per_class`` images of every class at every scale; score them with a classifier."""
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_limits  # installed with scikit-learn

    with threadpool_limits(cfg.threads or None):  # BLAS threads fight other processes as torch's do
        clf = LogisticRegression(max_iter=5000).fit(data["x_train"][:, 1:].numpy() / 16, data["y_train"].numpy())
    real_acc = float(clf.score(data["x_val"][:, 1:].numpy() / 16, data["y_val"].numpy()))
    real_spread = float(class_spread(data["x_train"][:, 1:], data["y_train"]))
    model.eval()
    labels = torch.arange(CLASSES, device=device).repeat_interleave(cfg.samples_per_class)  # (b,)
    context, context_mask = class_context(labels)
    prompts = torch.full((len(labels), 1), BOS, device=device)
    results = {}
    for scale in cfg.scales:
        torch.manual_seed(cfg.seed + 7919)  # the same random numbers at every scale
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            images = model.generate(prompts, PIXELS, context=context, context_mask=context_mask,
                                    temperature=cfg.temperature, cond_scale=scale)  # (b, 64)
        images = images.clamp(0, LEVELS - 1).cpu()
        with threadpool_limits(cfg.threads or None):
            pred = torch.from_numpy(clf.predict(images.numpy() / 16))
        hit = (pred == labels.cpu()).double()
        results[scale] = dict(
            accuracy=float(hit.mean()),
            per_class=[float(hit[labels.cpu() == c].mean()) for c in range(CLASSES)],
            spread=float(class_spread(images, labels.cpu())),
            seconds=time.perf_counter() - t0,
            images=images,
        )
    model.train()
    return dict(classifier_val_accuracy=real_acc, real_spread=real_spread, scales=results)


def class_spread(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Diversity: the per-pixel standard deviation within each class, averaged (grey levels 0..16)."""
    return torch.stack([images[labels == c].double().std(0, correction=0).mean() for c in labels.unique()]).mean()


def plot_samples(path: Path, scored: dict, cfg: Config, columns: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(columns, cfg.samples_per_class)
    fig, axes = plt.subplots(1, len(cfg.scales), figsize=(3.2 * len(cfg.scales), 3.6), squeeze=False)
    for ax, scale in zip(axes[0], cfg.scales):
        r = scored["scales"][scale]
        grid = np.ones((CLASSES * 9 - 1, cols * 9 - 1)) * 16
        for c in range(CLASSES):
            for j in range(cols):
                img = r["images"][c * cfg.samples_per_class + j].view(8, 8).numpy()
                grid[c * 9:c * 9 + 8, j * 9:j * 9 + 8] = img
        ax.imshow(grid, cmap="gray_r", vmin=0, vmax=16, interpolation="nearest")
        ax.set_title(f"scale {scale:g}: accuracy {r['accuracy']:.2f}", fontsize=10)
        ax.set_xticks([])
        ax.set_yticks(np.arange(CLASSES) * 9 + 3.5, [str(c) for c in range(CLASSES)])
    fig.suptitle("samples per guidance scale (rows: the class asked for)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_losses(path: Path, history: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    train = np.array(history["train"], dtype=float)
    steps = np.arange(1, len(train) + 1)
    ax.plot(steps, train, lw=0.5, alpha=0.4, color="C0")
    w = min(50, len(train))
    ax.plot(steps[w - 1:], np.convolve(train, np.ones(w) / w, mode="valid"), color="C0", label=f"train (mean of {w})")
    if history["val"]:
        s, cond, uncond = zip(*history["val"])
        ax.plot(s, cond, "o-", color="C1", label="validation, with the class")
        ax.plot(s, uncond, "s--", color="C2", label="validation, class dropped")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------


def setup_process(cfg: Config) -> tuple[bool, int, int, torch.device]:
    """Join the process group when launched by torchrun (gloo on CPU, NCCL on CUDA); pick the device.

    Returns:
        ``(distributed, rank, world_size, device)``.
    """
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    rank, world, local = 0, 1, 0
    if distributed:
        dist.init_process_group("nccl" if use_cuda else "gloo")
        rank, world, local = dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))
    if cfg.batch_size % world:
        raise ValueError(f"--batch_size {cfg.batch_size} must be divisible by the number of processes {world}")
    device = torch.device(f"cuda:{local}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if cfg.threads > 0:  # results are bit-reproducible for a fixed thread count
        torch.set_num_threads(cfg.threads)
    return distributed, rank, world, device


def gather_digests(model: torch.nn.Module, distributed: bool, device: torch.device) -> list[str]:
    """Every rank's ``weights_digest``, in rank order (one entry without torchrun)."""
    mine = weights_digest(model)
    if not distributed:
        return [mine]
    t = torch.tensor(list(bytes.fromhex(mine)), dtype=torch.uint8, device=device)
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return [bytes(g.cpu().tolist()).hex() for g in gathered]


def print_table(scored: dict) -> None:
    print("\nclass accuracy of the samples (a logistic-regression classifier fitted on the real training images)")
    print(f"  real validation images: accuracy {scored['classifier_val_accuracy']:.3f}, "
          f"within-class spread {scored['real_spread']:.2f}")
    print("  | guidance scale | accuracy | worst class | spread | sampling s |")
    print("  |---------------:|---------:|------------:|-------:|-----------:|")
    for scale, r in scored["scales"].items():
        worst = int(np.argmin(r["per_class"]))
        name = f"{scale:g}" + {0: " (uncond)", 1: " (cond)"}.get(scale, "")
        worst_text = f"{worst} ({r['per_class'][worst]:.2f})"
        print(f"  | {name:>14} | {r['accuracy']:8.3f} | {worst_text:>11} | {r['spread']:6.2f} | {r['seconds']:10.1f} |")


def main(argv: list[str] | None = None) -> dict | None:
    """Run training (and, on rank 0, the final sampling and scoring); return the metrics on rank 0."""
    cfg = parse_config(argv)
    distributed, rank, world, device = setup_process(cfg)
    master = rank == 0
    out = Path(cfg.out)
    ckpt = out / "checkpoint"
    if master:
        out.mkdir(parents=True, exist_ok=True)

    data = load_digits_tokens()
    x_train, y_train = data["x_train"].to(device), data["y_train"].to(device)
    x_val, y_val = data["x_val"].to(device), data["y_val"].to(device)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg).to(device)
    net = model.net
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=cfg.weight_decay), dict(params=no_decay, weight_decay=0.0)],
                            lr=cfg.lr, betas=(0.9, 0.95))
    start, history, skipped = 0, dict(train=[], val=[]), []
    if cfg.resume:
        trainer = load_checkpoint(ckpt, net, opt, device)
        start, history, skipped = trainer["step"], trainer["history"], trainer["skipped"]
    train_model = model
    if distributed:
        train_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    n_params = sum(p.numel() for p in model.parameters())
    end = min(cfg.steps, cfg.stop_at) if cfg.stop_at else cfg.steps
    if master:
        print(f"digits: {len(x_train)} train / {len(x_val)} validation images; model {n_params:,} parameters; "
              f"{world} process(es) on {device}; steps {start}->{end} of {cfg.steps}", flush=True)

    tokens_per_step = cfg.batch_size * PIXELS
    bar = tqdm(range(start, end), initial=start, total=cfg.steps, disable=not master, desc="train",
               file=sys.stderr, dynamic_ncols=True)
    window_t, window_tokens, train_seconds = time.perf_counter(), 0, 0.0
    for step in bar:  # `step` optimizer steps are done; this iteration makes step + 1
        torch.manual_seed(cfg.seed * 1_000_003 + step * world + rank)  # dropout and condition dropout
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step)
        idx = batch_indices(step, len(x_train), cfg.batch_size, cfg.seed, rank, world).to(device)
        context, context_mask = class_context(y_train[idx])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = train_model(x_train[idx], context=context, context_mask=context_mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step + 1 == cfg.debug_nan_step:  # testing hook: a NaN gradient in one known module
            [p for n, p in model.named_parameters() if n.endswith("to_v.weight")][-1].grad.fill_(float("nan"))
        norm = clip_gradients(model, cfg.grad_clip)
        if math.isfinite(norm):
            opt.step()
        else:
            skipped.append(dict(step=step + 1, module=first_nonfinite_grad(model), grad_norm=str(norm)))
            if master:
                tqdm.write(f"step {step + 1}: non-finite gradient norm ({norm}), step skipped "
                           f"({len(skipped)} so far); first non-finite gradient in {skipped[-1]['module']}")
        mean_loss = loss.detach().float()
        if distributed:
            dist.all_reduce(mean_loss)
            mean_loss /= world
        history["train"].append(float(mean_loss))
        window_tokens += tokens_per_step
        done = step + 1
        if master and (done % cfg.log_every == 0 or done == end):
            dt = time.perf_counter() - window_t
            train_seconds += dt
            bar.set_postfix(loss=f"{history['train'][-1]:.3f}", tok_s=f"{window_tokens / dt:,.0f}")
            tqdm.write(f"step {done:5d} | loss {np.mean(history['train'][-cfg.log_every:]):.4f} | "
                       f"lr {learning_rate(cfg, step):.2e} | {window_tokens / dt:,.0f} tokens/s")
        if done % cfg.eval_every == 0 or done == cfg.steps:
            cond, uncond = validation_loss(model, x_val, y_val, cfg)
            history["val"].append([done, cond, uncond])
            if master:
                tqdm.write(f"step {done:5d} | validation loss {cond:.4f} with the class, {uncond:.4f} without it")
        if master and (done % cfg.save_every == 0 or done == end):
            save_checkpoint(ckpt, net, opt, dict(step=done, history=history, skipped=skipped,
                                                 config=dataclasses.asdict(cfg)))
        if master and (done % cfg.log_every == 0 or done == end):
            window_t, window_tokens = time.perf_counter(), 0  # evaluation and saving don't count as training
    bar.close()

    digests = gather_digests(model, distributed, device)
    if distributed:
        # every rank done with every collective before any rank tears gloo down (a rank leaving early
        # can abort its peer's gloo thread: "terminate called without an active exception")
        dist.barrier()
        del train_model  # drop DDP's reducer (it holds the process group) before destroying the group
        dist.destroy_process_group()
    if not master:
        return None
    if end < cfg.steps:
        print(f"stopped after step {end} of {cfg.steps} (--stop_at); continue with --resume --out {cfg.out}")
        return None

    scored = sample_and_score(model, data, cfg, device)
    print_table(scored)
    plot_samples(out / "samples.png", scored, cfg)
    plot_losses(out / "loss.png", history)
    metrics = dict(
        config=dataclasses.asdict(cfg), parameters=n_params, world_size=world, steps=cfg.steps,
        final_train_loss=float(np.mean(history["train"][-cfg.log_every:])),
        val_loss=history["val"][-1][1] if history["val"] else None,
        val_loss_uncond=history["val"][-1][2] if history["val"] else None,
        tokens_per_second=(len(history["train"]) - start) * tokens_per_step / max(train_seconds, 1e-9),
        skipped_steps=skipped, history=history, weight_sha256_per_rank=digests,
        classifier_val_accuracy=scored["classifier_val_accuracy"], real_spread=scored["real_spread"],
        accuracy={f"{s:g}": r["accuracy"] for s, r in scored["scales"].items()},
        per_class_accuracy={f"{s:g}": r["per_class"] for s, r in scored["scales"].items()},
        spread={f"{s:g}": r["spread"] for s, r in scored["scales"].items()},
    )
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(f"\nwrote {out / 'metrics.json'}, {out / 'samples.png'}, {out / 'loss.png'}, {ckpt}/")
    return metrics


if __name__ == "__main__":
    main()
    if "LOCAL_RANK" in os.environ:  # under torchrun: skip the interpreter's teardown, where gloo's worker
        sys.stdout.flush()  # threads can abort the process ("terminate called without an active exception")
        sys.stderr.flush()  # after every file is written and every collective has finished
        os._exit(0)
