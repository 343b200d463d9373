"""Train a decoder on the 8x8 digits conditioned on two things at once, with per-condition guidance.

The main job of safeformer, in one file. It learns to draw scikit-learn's 8x8 handwritten digits
(``sklearn.datasets.load_digits``, shipped inside the package: no download) pixel by pixel: each
image is a sequence of 64 tokens (its 17 grey levels, after a BOS token). Two conditions steer it:

- **the class as an English word**, a variable-length string of characters ("three", "a pair",
  "half a dozen", ...; a few synonyms per class, and for some samples the EMPTY string), read by a
  small ``Encoder`` over characters and given to the decoder as a padded ``context (b, j, c)`` with
  ``context_mask (b, j)`` for cross-attention. An empty string is an all-False mask row: zero real
  tokens, which safeformer turns into an exact no-op.
- **the stroke thickness** (thin / medium / thick: the tercile of the image's total ink among the
  training images), a one-hot ``condition (b, 3)`` for the decoder's adaptive LayerNorms.

During training ``AutoregressiveWrapper(cond_drop_prob={"context": ..., "condition": ...},
cond_drop_all_prob=...)`` drops each condition per sample independently (and both at once with its
own probability), so one network learns p(image | word, thickness), p(image | word),
p(image | thickness) and p(image). At the end it samples every (class, thickness) pair under several
guidance settings: unconditional, conditional, guided on the text only, on the thickness only, and
on both (compositional: ``uncond + s_text (text - uncond) + s_thick (thick - uncond)``), scores each
sample's class with a classifier fitted on the real training images and its thickness by measuring
its ink, and prints a table of class and thickness accuracy per setting.

Usage:
    python train.py                                  # the default run (8 to 10 minutes on 2 shared CPU cores)
    python train.py --steps 300 --out runs/quick     # any config field is a --key value override
    python train.py --out runs/quick --resume        # continue from runs/quick/checkpoint
    python train.py --bf16                           # bfloat16 autocast
    python train.py --scales 1,text:3,thickness:3,text:3+thickness:3   # other guidance settings
    torchrun --nproc_per_node=2 train.py --out runs/ddp   # data-parallel (gloo on CPU, NCCL on CUDA)
    torchrun --nproc_per_node=2 train.py --strategy fsdp --out runs/fsdp   # sharded (FSDP2 fully_shard)
    python train.py --help                           # every option with its default

Outputs (in --out): metrics.json, samples.png (a row-block per guidance setting), loss.png, and
checkpoint/ (safeformer.checkpoints.training_state's state: model.safetensors with every weight, optimizer.safetensors,
rng.safetensors and training_state.json, for --resume under any strategy; decoder/ and text_encoder/:
the two models as TransformerWrapper.from_pretrained folders). No pickle is written.

Shape legend: b batch, n = 65 positions (BOS + 64 pixels), v = 17 grey levels, j characters of the
longest word in the batch, c = text_dim, k = 10 classes, 3 thickness bins.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from safeformer import Decoder, Encoder, TransformerWrapper
from safeformer.checkpoints.training_state import STATE_NAME, load_training_state, save_training_state
from safeformer.decoding.generation import AutoregressiveWrapper

LEVELS, CLASSES, PIXELS = 17, 10, 64  # grey levels 0..16 are the tokens 0..16
BOS = LEVELS  # token 17 starts every image; the model never predicts it (logits_dim = 17)
# the words for each class: the first is the canonical one (validation uses it), the others synonyms
WORDS: dict[int, tuple[str, ...]] = {
    0: ("zero", "nought", "naught", "nil"),
    1: ("one", "a one", "single", "ace"),
    2: ("two", "a pair", "couple", "deuce"),
    3: ("three", "trio", "triple", "trey"),
    4: ("four", "a four", "quartet", "tetrad"),
    5: ("five", "a five", "quintet", "pentad"),
    6: ("six", "half a dozen", "sextet", "hexad"),
    7: ("seven", "a seven", "septet", "heptad"),
    8: ("eight", "an eight", "octet", "octad"),
    9: ("nine", "a nine", "nonet", "ennead"),
}
CHARS = " abcdefghijklmnopqrstuvwxyz"  # character c is token CHARS.index(c) + 1; token 0 is padding
TEXT_LEN = max(len(w) for words in WORDS.values() for w in words)  # 12 ("half a dozen")
THICKNESS = ("thin", "medium", "thick")  # terciles of the total ink of the training images
KEYS = {"text": "context", "thickness": "condition", "joint": "joint"}  # --scales names -> cond_scale keys


@dataclass
class Config:
    """Every setting of a run; each field is a ``--field value`` command-line option."""

    out: str = field(default="runs/digits", metadata={"help": "output folder"})
    seed: int = field(default=0, metadata={"help": "seed of the init, the data order, the words, dropout and sampling"})
    # model
    dim: int = field(default=128, metadata={"help": "decoder width"})
    depth: int = field(default=4, metadata={"help": "decoder layers (each: self-attn, cross-attn to the text, ff; AdaLN norms)"})
    heads: int = field(default=4, metadata={"help": "attention heads"})
    dim_head: int = field(default=32, metadata={"help": "head dim"})
    dropout: float = field(default=0.1, metadata={"help": "attention and feed-forward dropout"})
    text_dim: int = field(default=64, metadata={"help": "width of the character encoder (= the decoder's dim_context)"})
    text_depth: int = field(default=1, metadata={"help": "layers of the character encoder"})
    # training
    steps: int = field(default=800, metadata={"help": "optimizer steps in the whole run"})
    batch_size: int = field(default=64, metadata={"help": "images per step, over all processes"})
    lr: float = field(default=2e-3, metadata={"help": "peak learning rate (AdamW)"})
    min_lr: float = field(default=1e-4, metadata={"help": "learning rate at the end of the cosine decay"})
    warmup: int = field(default=80, metadata={"help": "linear warm-up steps"})
    weight_decay: float = field(default=0.05, metadata={"help": "AdamW weight decay (matrices only)"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the gradient norm to this (0: no clipping)"})
    synonym_prob: float = field(default=0.5, metadata={"help": "probability that a sample's word is a synonym, not the canonical word"})
    empty_text_prob: float = field(default=0.1, metadata={"help": "probability that a sample's word is the empty string (zero tokens)"})
    text_drop_prob: float = field(default=0.2, metadata={"help": "probability of dropping a sample's text (CFG)"})
    thickness_drop_prob: float = field(default=0.2, metadata={"help": "probability of dropping a sample's thickness (CFG)"})
    cond_drop_all_prob: float = field(default=0.1, metadata={"help": "probability of dropping both conditions at once (CFG)"})
    bf16: bool = field(default=False, metadata={"help": "bfloat16 autocast for forward and loss"})
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda"})
    threads: int = field(default=1, metadata={"help": "CPU threads per process (0: PyTorch's default, all cores)"})
    strategy: str = field(default="ddp", metadata={"help": "under torchrun: ddp (replicate) or fsdp (shard each block "
                                                            "with FSDP2's fully_shard)"})
    checkpoint_layers: bool = field(default=False, metadata={"help": "activation checkpointing: recompute each block "
                                                                      "in the backward pass (less memory, more time)"})
    # logging and checkpoints
    log_every: int = field(default=100, metadata={"help": "print step, loss and tokens/s every N steps"})
    eval_every: int = field(default=200, metadata={"help": "validation losses every N steps"})
    save_every: int = field(default=400, metadata={"help": "write the checkpoint every N steps"})
    resume: bool = field(default=False, metadata={"help": "continue from OUT/checkpoint"})
    stop_at: int = field(default=0, metadata={"help": "stop after this step as if interrupted (0: run all steps)"})
    # sampling and scoring
    scales: tuple[str, ...] = field(
        default=("0", "1", "2", "text:2", "text:3", "thickness:2", "thickness:3", "text:2+thickness:2",
                 "text:3+thickness:3"),
        metadata={"help": "guidance settings, comma-separated: a number s is joint guidance (0: unconditional, "
                          "1: conditional); text:s, thickness:s and joint:s guide on one condition, joined "
                          "with + they compose (text:2+thickness:2)"})
    samples_per_class: int = field(default=48, metadata={"help": "images sampled per class and setting (thin, medium, thick in turn)"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    debug_nan_step: int = field(default=0, metadata={"help": "testing: poison one gradient with NaN at this step"})

    def __post_init__(self):
        for name in ("dim", "depth", "heads", "dim_head", "text_dim", "text_depth", "steps", "batch_size",
                     "log_every", "eval_every", "save_every", "samples_per_class"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be positive, got {getattr(self, name)}")
        for name in ("dropout", "text_drop_prob", "thickness_drop_prob", "cond_drop_all_prob"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("synonym_prob", "empty_text_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"--{name} must be in [0, 1], got {getattr(self, name)}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= --min_lr <= --lr and --lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0 (0: PyTorch's default), got {self.threads}")
        if self.grad_clip < 0 or self.temperature <= 0:
            raise ValueError(f"need --grad_clip >= 0 and --temperature > 0, got {self.grad_clip}, {self.temperature}")
        if isinstance(self.scales, str):
            self.scales = split_list(self.scales)
        self.scales = tuple(str(s) if not isinstance(s, (int, float)) else f"{s:g}" for s in self.scales)
        if not self.scales:
            raise ValueError("--scales must name at least one guidance setting")
        self.scales = tuple(guidance_setting(s)[0] for s in self.scales)  # validated, in canonical spelling
        if len(set(self.scales)) != len(self.scales):
            raise ValueError(f"--scales names a guidance setting twice: {','.join(self.scales)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.strategy not in ("ddp", "fsdp"):
            raise ValueError(f"--strategy must be ddp or fsdp, got {self.strategy!r}")


def split_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def guidance_setting(spec: str) -> tuple[str, float | dict[str, float]]:
    """``"2"`` -> ``("2", 2.0)``; ``"text:2+thickness:3"`` -> ``(spec, {"context": 2.0, "condition": 3.0})``.

    Returns the setting's canonical name and the ``cond_scale`` to pass to ``generate``.
    """
    def scale(value: str) -> float:
        try:
            s = float(value)
        except ValueError:
            s = float("nan")
        if not math.isfinite(s) or s < 0:
            raise ValueError(f"--scales: {spec!r} needs scales that are numbers >= 0, got {value!r}")
        return s

    if ":" not in spec:
        s = scale(spec)
        return f"{s:g}", s
    mapping: dict[str, float] = {}
    for part in spec.split("+"):
        name, sep, value = part.strip().partition(":")
        name = {"thick": "thickness"}.get(name.strip(), name.strip())
        if not sep or name not in KEYS:
            raise ValueError(f"--scales: {spec!r}: each part must be text:s, thickness:s or joint:s, got {part!r}")
        if KEYS[name] in mapping:
            raise ValueError(f"--scales: {spec!r} names {name} twice")
        mapping[KEYS[name]] = scale(value)
    names = {v: k for k, v in KEYS.items()}
    canonical = "+".join(f"{names[k]}:{mapping[k]:g}" for k in ("joint", "context", "condition") if k in mapping)
    return canonical, mapping


def setting_label(name: str) -> str:
    """A human name for a guidance setting: ``0 (uncond)``, ``1 (cond)``, ``text 2 + thickness 2``."""
    if ":" not in name:
        return name + {"0": " (uncond)", "1": " (cond)"}.get(name, " (joint)")
    return " + ".join(part.replace(":", " ") for part in name.split("+"))


def parse_config(argv: list[str] | None = None) -> Config:
    """Build a ``Config`` from ``--key value`` options (booleans: ``--key`` / ``--no-key``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        kw = dict(default=f.default, help=f.metadata["help"])
        if f.type in (bool, "bool"):
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, **kw)
        elif f.name == "scales":
            kw["default"] = ", ".join(f.default)  # a string: argparse runs `type` on it, and --help wraps it
            parser.add_argument(f"--{f.name}", type=split_list, **kw)
        else:
            parser.add_argument(f"--{f.name}", type=type(f.default), **kw)
    return Config(**vars(parser.parse_args(argv)))


# ---------------------------------------------------------------------------------------------------
# Data: the digits as token sequences, their thickness, their words; a fixed stratified split
# ---------------------------------------------------------------------------------------------------


def load_digits_tokens() -> dict[str, torch.Tensor]:
    """The 1797 digits as ``(b, 65)`` token sequences (BOS + 64 grey levels), ``(b,)`` labels and
    ``(b,)`` thickness bins (0 thin, 1 medium, 2 thick: terciles of the training images' total ink)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = torch.from_numpy(digits.images.reshape(-1, PIXELS).astype(np.int64))  # (b, 64) in 0..16
    labels = torch.from_numpy(digits.target.astype(np.int64))
    tokens = torch.cat((torch.full((len(pixels), 1), BOS), pixels), dim=1)  # (b, 65)
    train, val = train_test_split(np.arange(len(labels)), test_size=0.1, stratify=labels.numpy(), random_state=0)
    train, val = torch.from_numpy(np.sort(train)), torch.from_numpy(np.sort(val))
    ink_edges = torch.quantile(pixels[train].sum(1).double(), torch.tensor([1 / 3, 2 / 3], dtype=torch.float64))
    return dict(x_train=tokens[train], y_train=labels[train], t_train=thickness_bins(tokens[train], ink_edges),
                x_val=tokens[val], y_val=labels[val], t_val=thickness_bins(tokens[val], ink_edges),
                ink_edges=ink_edges)


def ink(images: torch.Tensor) -> torch.Tensor:
    """Total ink ``(b,)`` of images given as ``(b, 64)`` grey levels or ``(b, 65)`` tokens (BOS dropped)."""
    pixels = images[:, 1:] if images.shape[1] == PIXELS + 1 else images
    return pixels.clamp(0, LEVELS - 1).sum(1).double()


def thickness_bins(images: torch.Tensor, ink_edges: torch.Tensor) -> torch.Tensor:
    """``(b,)`` thickness bin of each image: 0 below the first tercile of ink, 2 above the second."""
    return torch.bucketize(ink(images), ink_edges.to(torch.float64).cpu(), right=True).to(images.device)


def encode_texts(texts: list[str], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Character ids ``(b, j)`` and padding mask ``(b, j)`` (True = real), ``j`` = the longest text (at
    least 1). An empty text is an all-False row."""
    j = max(1, max((len(t) for t in texts), default=0))
    ids = torch.zeros(len(texts), j, dtype=torch.long)
    for i, text in enumerate(texts):
        ids[i, :len(text)] = torch.tensor([CHARS.index(c) + 1 for c in text], dtype=torch.long)
    mask = torch.arange(j)[None, :] < torch.tensor([len(t) for t in texts])[:, None]
    return ids.to(device), mask.to(device)


def batch_texts(labels: torch.Tensor, step: int, cfg: Config) -> list[str]:
    """The word of each sample of step ``step``'s whole batch (every rank draws the same ones, so the
    words are a function of the step alone: resuming and DDP are exact): empty with probability
    ``empty_text_prob``, else a synonym with probability ``synonym_prob``, else the canonical word."""
    rng = np.random.default_rng([cfg.seed, step, 17])
    u, v, w = rng.random(len(labels)), rng.random(len(labels)), rng.integers(0, 1 << 30, len(labels))
    texts = []
    for label, ui, vi, wi in zip(labels.tolist(), u, v, w):
        words = WORDS[label]
        if ui < cfg.empty_text_prob:
            texts.append("")
        elif vi < cfg.synonym_prob and len(words) > 1:
            texts.append(words[1 + wi % (len(words) - 1)])
        else:
            texts.append(words[0])
    return texts


def batch_indices(step: int, n: int, batch_size: int, seed: int, rank: int, world: int) -> torch.Tensor:
    """This process's share of step ``step``'s batch: a function of the step alone, so resuming is exact."""
    per_epoch = n // batch_size
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return perm[k * batch_size:(k + 1) * batch_size][rank::world]


# ---------------------------------------------------------------------------------------------------
# Model, schedule, checkpoints
# ---------------------------------------------------------------------------------------------------


class DigitsModel(nn.Module):
    """The character encoder and the decoder, trained together.

    ``text``: ``TransformerWrapper(Encoder)`` over characters, returning ``(b, j, text_dim)`` (saved as
    ``checkpoint/text_encoder``). ``model``: ``AutoregressiveWrapper`` around the decoder, which
    cross-attends to the text and takes the thickness one-hot in its adaptive LayerNorms (saved as
    ``checkpoint``), and drops each condition per sample in training.
    """

    def __init__(self, model: AutoregressiveWrapper, text: TransformerWrapper):
        super().__init__()
        self.model, self.text = model, text

    def conditions(self, ids: torch.Tensor, ids_mask: torch.Tensor, thickness: torch.Tensor) -> dict:
        """``generate`` / loss keyword arguments: the encoded text and its mask, the thickness one-hot."""
        context = self.text(ids, mask=ids_mask)  # (b, j, c); all-False rows (empty texts) are exact no-ops later
        return dict(context=context, context_mask=ids_mask, condition=F.one_hot(thickness, len(THICKNESS)).float())

    def forward(self, x, ids, ids_mask, thickness):
        """Next-token loss of the images ``x (b, 65)`` given their words and thickness bins."""
        return self.model(x, **self.conditions(ids, ids_mask, thickness))


def build_model(cfg: Config) -> DigitsModel:
    """A decoder that cross-attends to an encoded word and is modulated by the thickness, wrapped for
    next-token loss with each condition dropped independently (CFG)."""
    text = TransformerWrapper(
        num_tokens=len(CHARS) + 1, max_seq_len=TEXT_LEN, return_only_embed=True,
        attn_layers=Encoder(dim=cfg.text_dim, depth=cfg.text_depth, heads=2, dim_head=cfg.text_dim // 2,
                            attn_dropout=cfg.dropout, ff_dropout=cfg.dropout),
    )
    net = TransformerWrapper(
        num_tokens=LEVELS + 1, logits_dim=LEVELS, max_seq_len=PIXELS + 1,
        attn_layers=Decoder(dim=cfg.dim, depth=cfg.depth, heads=cfg.heads, dim_head=cfg.dim_head,
                            cross_attend=True, dim_context=cfg.text_dim,
                            use_adaptive_layernorm=True, dim_condition=len(THICKNESS), adaptive_null="learned",
                            attn_dropout=cfg.dropout, ff_dropout=cfg.dropout, checkpoint_layers=cfg.checkpoint_layers),
    )
    model = AutoregressiveWrapper(net, cond_drop_prob={"context": cfg.text_drop_prob, "condition": cfg.thickness_drop_prob},
                                  cond_drop_all_prob=cfg.cond_drop_all_prob)
    return DigitsModel(model, text)


def load_trained(path: str | os.PathLike) -> DigitsModel:
    """The trained encoder and decoder from a checkpoint folder, for evaluation (no condition dropping)."""
    path = Path(path)
    return DigitsModel(AutoregressiveWrapper(TransformerWrapper.from_pretrained(path / "decoder")),
                       TransformerWrapper.from_pretrained(path / "text_encoder")).eval()


def learning_rate(cfg: Config, step: int) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at ``steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * t))


def save_checkpoint(path: Path, job: DigitsModel, opt: torch.optim.Optimizer, trainer: dict) -> None:
    """The library's training state (safetensors + JSON, written atomically by rank 0; every rank calls
    it: under FSDP the full state is gathered), with the decoder and the character encoder also as
    ``from_pretrained`` folders (``decoder/``, ``text_encoder/``)."""
    save_training_state(path, job, opt, step=trainer["step"], extra=trainer,
                        pretrained={"decoder": job.model.net, "text_encoder": job.text})


def load_checkpoint(path: Path, job: DigitsModel, opt: torch.optim.Optimizer, device) -> dict:
    """Load what ``save_checkpoint`` wrote into ``job`` and ``opt`` (any strategy from any strategy)."""
    if not (path / STATE_NAME).is_file():
        raise FileNotFoundError(f"--resume: {path / STATE_NAME} is missing; is {path} a train.py checkpoint?")
    try:
        return load_training_state(path, job, opt, map_location=device, restore_rng=False)["extra"]
    except ValueError as err:
        raise ValueError(f"--resume: {err}; use the same --dim/--depth/--text_dim/... as the run that wrote it") from err


def shard(job: DigitsModel) -> None:
    """FSDP2: every attention and feed-forward block of both stacks its own unit, the rest at the root."""
    from torch.distributed.fsdp import fully_shard

    for stack in (job.model.net.attn_layers, job.text.attn_layers):
        for parts in stack.layers:
            fully_shard(parts[1])
    fully_shard(job.text)  # its own unit: validation and sampling call the encoder directly
    fully_shard(job.model)
    fully_shard(job)


def clip_gradients(model: torch.nn.Module, max_norm: float, sharded: bool = False) -> float:
    """Return the total gradient norm; scale the gradients down to ``max_norm`` only if it is finite.

    A non-finite norm leaves every gradient as it is, so ``first_nonfinite_grad`` can name its source
    (clipping by a NaN norm would spread the NaN to every gradient).
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = [getattr(g, "_local_tensor", g) for g in grads]  # FSDP2: each rank holds a shard (a DTensor)
    sq = torch.stack([g.float().pow(2).sum() for g in local]).sum()
    if sharded:
        dist.all_reduce(sq)  # the shards' squares summed over ranks: the full gradient's norm
    norm = float(sq.sqrt())
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


class ConditionCounter:
    """Counts, at the decoder's input during training, what each sample saw: no text (an empty word or
    a dropped one: an all-False ``context_mask`` row), a dropped thickness (``condition_mask`` False),
    and both gone. Installed as a forward pre-hook, so it sees the wrapper's own condition dropping."""

    def __init__(self, net: nn.Module):
        self.counts = torch.zeros(4, dtype=torch.float64)  # samples, text absent, thickness dropped, both
        self.handle = net.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        if not module.training:
            return None
        x, cm, tm = args[0], kwargs.get("context_mask"), kwargs.get("condition_mask")
        none = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        no_text = none if cm is None else ~cm.any(1)  # (b,) no real text token
        no_thick = none if tm is None else ~tm  # (b,) the null condition in place of the thickness
        self.counts += torch.stack([torch.tensor(x.shape[0]), no_text.sum().cpu(), no_thick.sum().cpu(),
                                    (no_text & no_thick).sum().cpu()]).double()
        return None


@torch.no_grad()
def validation_loss(job: DigitsModel, data: dict, cfg: Config, device) -> list[float]:
    """Mean next-token loss on the validation images (canonical words): with both conditions, with the
    text only, with the thickness only, with neither (dropped conditions are all-False masks)."""
    job.eval()
    ids, ids_mask = encode_texts([WORDS[int(c)][0] for c in data["y_val"]], device)
    x, thick = data["x_val"].to(device), data["t_val"].to(device)
    out = []
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
        conds = job.conditions(ids, ids_mask, thick)
        no_thick = torch.zeros(len(x), dtype=torch.bool, device=device)
        for keep_text, keep_thick in ((True, True), (True, False), (False, True), (False, False)):
            kw = dict(conds, context_mask=ids_mask if keep_text else torch.zeros_like(ids_mask))
            if not keep_thick:
                kw["condition_mask"] = no_thick
            out.append(job.model(x, **kw).item())
    job.train()
    return out


# ---------------------------------------------------------------------------------------------------
# Sampling, scoring and plots (rank 0)
# ---------------------------------------------------------------------------------------------------


def evaluation_requests(cfg: Config) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """What every sample asks for: ``(b,)`` classes, ``(b,)`` thickness bins and the words. Sample ``i``
    of a class asks thickness ``i % 3`` and the class's word ``(i // 3) % 4`` (canonical first)."""
    labels, thick, texts = [], [], []
    for c in range(CLASSES):
        for i in range(cfg.samples_per_class):
            labels.append(c)
            thick.append(i % len(THICKNESS))
            texts.append(WORDS[c][(i // len(THICKNESS)) % len(WORDS[c])])
    return torch.tensor(labels), torch.tensor(thick), texts


@torch.no_grad()
def sample_and_score(job: DigitsModel, data: dict, cfg: Config, device) -> dict:
    """Sample every (class, thickness) under every guidance setting; score class and thickness."""
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_limits  # installed with scikit-learn

    with threadpool_limits(cfg.threads or None):  # BLAS threads fight other processes as torch's do
        clf = LogisticRegression(max_iter=5000).fit(data["x_train"][:, 1:].numpy() / 16, data["y_train"].numpy())
    real_acc = float(clf.score(data["x_val"][:, 1:].numpy() / 16, data["y_val"].numpy()))
    real_spread = float(class_spread(data["x_train"][:, 1:], data["y_train"]))
    job.eval()
    labels, thick, texts = evaluation_requests(cfg)
    ids, ids_mask = encode_texts(texts, device)
    prompts = torch.full((len(labels), 1), BOS, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
        conds = job.conditions(ids, ids_mask, thick.to(device))
    results = {}
    for name in cfg.scales:
        cond_scale = guidance_setting(name)[1]
        torch.manual_seed(cfg.seed + 7919)  # the same random numbers for every setting
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            images = job.model.generate(prompts, PIXELS, **conds, temperature=cfg.temperature,
                                        cond_scale=cond_scale, cache_kv=True)  # (b, 64)
        seconds = time.perf_counter() - t0
        images = images.clamp(0, LEVELS - 1).cpu()
        with threadpool_limits(cfg.threads or None):
            pred = torch.from_numpy(clf.predict(images.numpy() / 16))
        hit = (pred == labels).double()
        got = thickness_bins(images, data["ink_edges"])
        thick_hit = (got == thick).double()
        amount = ink(images)
        results[name] = dict(
            label=setting_label(name),
            cond_scale=cond_scale,
            class_accuracy=float(hit.mean()),
            thickness_accuracy=float(thick_hit.mean()),
            per_class=[float(hit[labels == c].mean()) for c in range(CLASSES)],
            per_word={w: float(hit[[t == w for t in texts]].mean()) for c in range(CLASSES) for w in WORDS[c]
                      if w in texts},
            per_thickness=[float(thick_hit[thick == t].mean()) if bool((thick == t).any()) else None
                           for t in range(len(THICKNESS))],
            mean_ink=[float(amount[thick == t].mean()) if bool((thick == t).any()) else None
                      for t in range(len(THICKNESS))],
            spread=float(class_spread(images, labels)),
            seconds=seconds,
            images=images,
        )
    job.train()
    real_ink = ink(data["x_train"])
    return dict(classifier_val_accuracy=real_acc, real_spread=real_spread, settings=results,
                real_mean_ink=[float(real_ink[data["t_train"] == t].mean()) for t in range(len(THICKNESS))],
                requests=dict(labels=labels, thickness=thick, texts=texts))


def class_spread(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Diversity: the per-pixel standard deviation within each class, averaged (grey levels 0..16)."""
    return torch.stack([images[labels == c].double().std(0, correction=0).mean() for c in labels.unique()]).mean()


def plot_samples(path: Path, scored: dict, cfg: Config, per_cell: int = 2) -> None:
    """One row-block per guidance setting: rows thin / medium / thick, columns the classes 0..9
    (``per_cell`` samples each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(scored["settings"])
    cell_w = per_cell * 9 + 3  # pixels per class group, with a gap
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 1.45 * len(names) + 0.6), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        r = scored["settings"][name]
        grid = np.zeros((len(THICKNESS) * 9 - 1, CLASSES * cell_w - 3))
        for c in range(CLASSES):
            for t in range(len(THICKNESS)):
                for k in range(per_cell):
                    i = t + len(THICKNESS) * k  # the k-th sample of class c asking thickness t
                    if i < cfg.samples_per_class:
                        img = r["images"][c * cfg.samples_per_class + i].view(8, 8).numpy()
                        grid[t * 9:t * 9 + 8, c * cell_w + k * 9:c * cell_w + k * 9 + 8] = img
        ax.imshow(grid, cmap="gray_r", vmin=0, vmax=16, interpolation="nearest")
        ax.set_title(f"{r['label']}: class accuracy {r['class_accuracy']:.2f}, "
                     f"thickness accuracy {r['thickness_accuracy']:.2f}", fontsize=9)
        ax.set_xticks(np.arange(CLASSES) * cell_w + (per_cell * 9 - 1) / 2, [str(c) for c in range(CLASSES)], fontsize=7)
        ax.set_yticks(np.arange(len(THICKNESS)) * 9 + 3.5, THICKNESS, fontsize=7)
        ax.tick_params(length=0)
    fig.suptitle("samples per guidance setting (columns: the class asked for; rows: the thickness asked for)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def centred_mean(values, window: int) -> np.ndarray:
    """Centred moving average: point i is the mean of ``values[i - h : i + h + 1]`` with ``h = window // 2``,
    the half-width shrinking to ``min(h, i, n - 1 - i)`` near the ends so every window stays centred on its
    point (no lag, unlike a trailing mean; the first and last points are their own average)."""
    x = np.asarray(values, dtype=float)
    n = len(x)
    if n == 0:
        return x
    i = np.arange(n)
    h = np.minimum(max(int(window) // 2, 0), np.minimum(i, n - 1 - i))
    c = np.concatenate(([0.0], np.cumsum(x)))
    return (c[i + h + 1] - c[i - h]) / (2 * h + 1)


def plot_loss_curves(path, train_loss, *, val: dict | None = None, lr=None, resumes=(), title: str = "training loss",
                     ylabel: str = "loss", window: int | None = None) -> None:
    """A loss plot: the raw training loss per step (steps 1..n), its centred moving average, validation
    curves (``val``: label -> (steps, values)), the learning rate per step on a right-hand axis, and a
    dashed vertical line at each step a resumed run continued from (``resumes``). Used by the examples too."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train_loss = np.asarray(train_loss, dtype=float)
    steps = np.arange(1, len(train_loss) + 1)
    window = window or max(5, min(101, len(train_loss) // 20 * 2 + 1))  # about 10% of the run, odd
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(steps, train_loss, lw=0.6, alpha=0.35, color="C0", label="train (raw, per step)")
    ax.plot(steps, centred_mean(train_loss, window), lw=1.6, color="C0", label=f"train (centred mean of {window})")
    markers = "o^vs*Dx"
    for k, (label, (s, v)) in enumerate((val or {}).items()):
        ax.plot(s, v, marker=markers[k % len(markers)], ms=4, ls="-", color=f"C{k + 1}", label=label)
    for k, r in enumerate(resumes):
        ax.axvline(r, color="0.3", ls="--", lw=1, label="resumed here" if k == 0 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    handles, labels = ax.get_legend_handles_labels()
    if lr is not None and len(lr):
        ax2 = ax.twinx()
        ax2.plot(np.arange(1, len(lr) + 1), lr, lw=1, ls=":", color="0.45", label="learning rate (right axis)")
        ax2.set_ylabel("learning rate")
        ax2.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_losses(path: Path, history: dict, lr=None) -> None:
    """train.py's loss plot: the training loss (raw and smoothed), the four validation losses, the learning
    rate per step (``lr``, from ``learning_rate``) and the steps where ``--resume`` continued."""
    val = {}
    if history["val"]:
        s, both, text, thick, none = zip(*history["val"])
        val = {"validation, word + thickness": (s, both), "validation, word only": (s, text),
               "validation, thickness only": (s, thick), "validation, neither": (s, none)}
    plot_loss_curves(path, history["train"], val=val, lr=lr, resumes=history.get("resumes", ()),
                     title="digits: training and validation loss", ylabel="next-token loss (nats)")


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


def full_digest(model: torch.nn.Module) -> str:
    """``weights_digest`` of a sharded model's full (gathered) weights; every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    h = hashlib.sha256()
    for _, p in sorted(full.items()):
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


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
    edges = scored["ink_edges"]
    print("\nclass accuracy: a logistic-regression classifier fitted on the real training images; thickness "
          f"accuracy: the sample's ink\n(thin < {edges[0]:g} <= medium < {edges[1]:g} <= thick, the terciles of "
          "the training images) in the bin asked for")
    print(f"  real images: the classifier's accuracy on validation {scored['classifier_val_accuracy']:.3f}; training "
          f"within-class spread {scored['real_spread']:.2f}, mean ink thin/medium/thick "
          + "/".join(f"{v:.0f}" for v in scored["real_mean_ink"]))
    print("  | guidance              | class acc | thickness acc | ink thin/med/thick | spread | sampling s |")
    print("  |:----------------------|----------:|--------------:|-------------------:|-------:|-----------:|")
    for r in scored["settings"].values():
        inks = "/".join("-" if v is None else f"{v:.0f}" for v in r["mean_ink"])
        print(f"  | {r['label']:<21} | {r['class_accuracy']:9.3f} | {r['thickness_accuracy']:13.3f} | {inks:>18} | "
              f"{r['spread']:6.2f} | {r['seconds']:10.1f} |")
    for r in scored["settings"].values():
        if r["cond_scale"] == 1.0 and len(r["per_word"]) > CLASSES:  # the plain conditional model, synonyms asked
            first = {words[0] for words in WORDS.values()}
            canonical = [a for w, a in r["per_word"].items() if w in first]
            others = [a for w, a in r["per_word"].items() if w not in first]
            worst = min(r["per_word"], key=r["per_word"].get)
            print(f"  class accuracy at {r['label']} by word: canonical words {np.mean(canonical):.3f}, synonyms "
                  f"{np.mean(others):.3f}; worst word {worst!r} {r['per_word'][worst]:.2f}")


def main(argv: list[str] | None = None) -> dict | None:
    """Run training (and, on rank 0, the final sampling and scoring); return the metrics on rank 0."""
    started = time.perf_counter()
    cfg = parse_config(argv)
    distributed, rank, world, device = setup_process(cfg)
    master = rank == 0
    out = Path(cfg.out)
    ckpt = out / "checkpoint"
    if master:
        out.mkdir(parents=True, exist_ok=True)

    data = load_digits_tokens()
    x_train, y_train, t_train = data["x_train"].to(device), data["y_train"], data["t_train"].to(device)
    torch.manual_seed(cfg.seed)
    job = build_model(cfg).to(device)
    fsdp = distributed and cfg.strategy == "fsdp"
    if fsdp:
        shard(job)  # before the optimizer: it must see the sharded parameters
    decay = [p for p in job.parameters() if p.dim() >= 2]
    no_decay = [p for p in job.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=cfg.weight_decay), dict(params=no_decay, weight_decay=0.0)],
                            lr=cfg.lr, betas=(0.9, 0.95))
    counter = ConditionCounter(job.model.net)
    start, history, skipped = 0, dict(train=[], val=[]), []
    counts = dict(samples=0, empty_text=0, text_absent=0, thickness_dropped=0, both_absent=0)
    if cfg.resume:
        trainer = load_checkpoint(ckpt, job, opt, device)
        start, history, skipped, counts = trainer["step"], trainer["history"], trainer["skipped"], trainer["counts"]
        history.setdefault("resumes", []).append(start)  # the loss plot marks where each session continued
    train_model = job
    if distributed and not fsdp:  # find_unused_parameters: a step may leave the null condition or the text encoder unused
        train_model = torch.nn.parallel.DistributedDataParallel(
            job, device_ids=[device.index] if device.type == "cuda" else None, find_unused_parameters=True)
    n_params = sum(p.numel() for p in job.parameters())
    end = min(cfg.steps, cfg.stop_at) if cfg.stop_at else cfg.steps
    if master:
        print(f"digits: {len(x_train)} train / {len(data['x_val'])} validation images; model {n_params:,} parameters "
              f"(text encoder {sum(p.numel() for p in job.text.parameters()):,}); {world} process(es) on {device}; "
              f"steps {start}->{end} of {cfg.steps}", flush=True)

    tokens_per_step = cfg.batch_size * PIXELS
    bar = tqdm(range(start, end), initial=start, total=cfg.steps, disable=not master, desc="train",
               file=sys.stderr, dynamic_ncols=True)
    window_t, window_tokens, train_seconds = time.perf_counter(), 0, 0.0
    for step in bar:  # `step` optimizer steps are done; this iteration makes step + 1
        torch.manual_seed(cfg.seed * 1_000_003 + step * world + rank)  # dropout and condition dropout
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step)
        whole = batch_indices(step, len(x_train), cfg.batch_size, cfg.seed, 0, 1)  # the global batch
        texts = batch_texts(y_train[whole], step, cfg)[rank::world]
        idx = whole[rank::world].to(device)
        ids, ids_mask = encode_texts(texts, device)
        counter.counts.zero_()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = train_model(x_train[idx], ids, ids_mask, t_train[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step + 1 == cfg.debug_nan_step:  # testing hook: a NaN gradient in one known module
            [p for n, p in job.model.named_parameters() if n.endswith("to_v.weight")][-1].grad.fill_(float("nan"))
        norm = clip_gradients(job, cfg.grad_clip, sharded=fsdp)
        if math.isfinite(norm):
            opt.step()
        else:
            skipped.append(dict(step=step + 1, module=first_nonfinite_grad(job), grad_norm=str(norm)))
            if master:
                tqdm.write(f"step {step + 1}: non-finite gradient norm ({norm}), step skipped "
                           f"({len(skipped)} so far); first non-finite gradient in {skipped[-1]['module']}")
        stats = torch.cat((loss.detach().double().reshape(1), counter.counts,
                           torch.tensor([sum(t == "" for t in texts)], dtype=torch.float64))).to(device)
        if distributed:
            dist.all_reduce(stats)  # summed over ranks: the mean loss and the whole batch's counts
        history["train"].append(float(stats[0]) / world)
        for key, value in zip(("samples", "text_absent", "thickness_dropped", "both_absent", "empty_text"), stats[1:].tolist()):
            counts[key] += int(value)
        window_tokens += tokens_per_step
        done = step + 1
        if master and (done % cfg.log_every == 0 or done == end):
            dt = time.perf_counter() - window_t
            train_seconds += dt
            bar.set_postfix(loss=f"{history['train'][-1]:.3f}", tok_s=f"{window_tokens / dt:,.0f}")
            tqdm.write(f"step {done:5d} | loss {np.mean(history['train'][-cfg.log_every:]):.4f} | "
                       f"lr {learning_rate(cfg, step):.2e} | {window_tokens / dt:,.0f} tokens/s")
        if done % cfg.eval_every == 0 or done == cfg.steps:
            losses = validation_loss(job, data, cfg, device)
            history["val"].append([done, *losses])
            if master:
                tqdm.write(f"step {done:5d} | validation loss {losses[0]:.4f} word + thickness, {losses[1]:.4f} "
                           f"word only, {losses[2]:.4f} thickness only, {losses[3]:.4f} neither")
        if done % cfg.save_every == 0 or done == end:  # every rank: a sharded state is gathered to rank 0
            save_checkpoint(ckpt, job, opt, dict(step=done, history=history, skipped=skipped, counts=counts,
                                                 config=dataclasses.asdict(cfg)))
        if master and (done % cfg.log_every == 0 or done == end):
            window_t, window_tokens = time.perf_counter(), 0  # evaluation and saving don't count as training
    bar.close()
    counter.handle.remove()

    digests = gather_digests(job, distributed and not fsdp, device) if not fsdp else [full_digest(job)]
    if fsdp:  # sampling runs on rank 0 alone: gather the full weights into an unsharded copy first
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(job, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if master:
            job = build_model(cfg).to(device)
            job.load_state_dict(full)
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

    scored = sample_and_score(job, data, cfg, device)
    scored["ink_edges"] = data["ink_edges"].tolist()
    print_table(scored)
    print(f"  training samples seen: {counts['samples']:,}; empty word {counts['empty_text']:,}, no text at the "
          f"decoder (empty or dropped) {counts['text_absent']:,}, thickness dropped {counts['thickness_dropped']:,}, "
          f"both absent {counts['both_absent']:,}")
    plot_samples(out / "samples.png", scored, cfg)
    plot_losses(out / "loss.png", history, [learning_rate(cfg, s) for s in range(len(history["train"]))])
    table = [{k: v for k, v in dict(setting=name, **r).items() if k != "images"} for name, r in scored["settings"].items()]
    last = history["val"][-1] if history["val"] else [None] * 5
    metrics = dict(
        config=dataclasses.asdict(cfg), parameters=n_params, world_size=world, steps=cfg.steps,
        final_train_loss=float(np.mean(history["train"][-cfg.log_every:])),
        val_loss=last[1], val_loss_text_only=last[2], val_loss_thickness_only=last[3], val_loss_uncond=last[4],
        tokens_per_second=(len(history["train"]) - start) * tokens_per_step / max(train_seconds, 1e-9),
        skipped_steps=skipped, history=history, weight_sha256_per_rank=digests, condition_counts=counts,
        classifier_val_accuracy=scored["classifier_val_accuracy"], real_spread=scored["real_spread"],
        ink_edges=scored["ink_edges"], real_mean_ink=scored["real_mean_ink"],
        guidance=table,
        accuracy={r["setting"]: r["class_accuracy"] for r in table},
        thickness_accuracy={r["setting"]: r["thickness_accuracy"] for r in table},
        per_class_accuracy={r["setting"]: r["per_class"] for r in table},
        spread={r["setting"]: r["spread"] for r in table},
        wall_seconds=time.perf_counter() - started,  # this process's whole run: data, training, sampling
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
