"""Smoke tests of train.py and the examples: a handful of steps each, with values checked.

train.py: its outputs exist and hold sane values; the checkpoint reloads to the exact final weights;
``--resume`` continues from the saved step with bit-identical losses and weights; a NaN gradient is
skipped and its module named; bfloat16 autocast agrees with float32; ``torchrun`` with two CPU
processes (gloo) ends with bit-identical weights on both ranks, equal to a one-process run.
Examples: copy/reverse with empty sources, and the character-level language model.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from safeformer import TransformerWrapper, XTransformer
from safeformer.generation import AutoregressiveWrapper

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--dim", "32", "--depth", "1", "--heads", "2", "--dim_head", "16", "--batch_size", "16",
        "--warmup", "2", "--log_every", "2", "--eval_every", "3", "--save_every", "3", "--threads", "1",
        "--device", "cpu"]  # CPU even where CUDA exists: torchrun's 2 ranks may share one GPU, and NCCL refuses that


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train():
    return _load("train_script", ROOT / "train.py")


@pytest.fixture(autouse=True)
def _keep_threads():
    """The scripts set the thread count of the whole process; give the other tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _finite(values) -> bool:
    return all(math.isfinite(v) for v in values)


def _png(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _val_loss_of_checkpoint(train, path: Path) -> float:
    """Conditional validation loss of the weights saved in ``path``, computed from scratch."""
    model = AutoregressiveWrapper(TransformerWrapper.from_pretrained(path)).eval()
    data = train.load_digits_tokens()
    context, context_mask = train.class_context(data["y_val"])
    with torch.no_grad():
        return model(data["x_val"], context=context, context_mask=context_mask).item()


# --------------------------------------------------------------------------------------------------
# train.py
# --------------------------------------------------------------------------------------------------


def test_train_outputs_and_checkpoint(train, tmp_path, capsys):
    out = tmp_path / "run"
    metrics = train.main([*TINY, "--steps", "6", "--samples_per_class", "3", "--scales", "0,1,2.5",
                          "--out", str(out)])
    printed = capsys.readouterr().out
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["accuracy"] == metrics["accuracy"]
    assert set(saved["accuracy"]) == {"0", "1", "2.5"}
    for scale, acc in saved["accuracy"].items():
        assert 0.0 <= acc <= 1.0
        per_class = saved["per_class_accuracy"][scale]
        assert len(per_class) == 10 and all(0 <= a <= 1 and (3 * a) == pytest.approx(round(3 * a)) for a in per_class)
        assert acc == pytest.approx(sum(per_class) / 10)  # 3 samples in each class
        assert re.search(rf"\|\s+{re.escape(scale)}( \(\w+\))? \|\s+{acc:.3f} \|", printed)  # the printed table
    assert "| guidance scale | accuracy |" in printed
    # the classifier is fitted on real images: it must recognise real validation digits
    assert saved["classifier_val_accuracy"] > 0.9
    train_losses = saved["history"]["train"]
    assert len(train_losses) == 6 and _finite(train_losses)
    assert all(0.5 < v < 2 * math.log(17) for v in train_losses)  # ln 17 = 2.83 at the start
    steps, cond, uncond = zip(*saved["history"]["val"])
    assert steps == (3, 6) and _finite(cond + uncond)  # validation at every eval_every and at the end
    assert saved["skipped_steps"] == [] and saved["tokens_per_second"] > 0
    assert _png(out / "samples.png") and _png(out / "loss.png")
    # the checkpoint holds exactly the final weights: same digest, same validation loss
    net = TransformerWrapper.from_pretrained(out / "checkpoint")
    assert train.weights_digest(AutoregressiveWrapper(net)) == saved["weight_sha256_per_rank"][0]
    assert _val_loss_of_checkpoint(train, out / "checkpoint") == pytest.approx(saved["val_loss"], rel=1e-5, abs=1e-6)
    trainer = json.loads((out / "checkpoint" / "trainer.json").read_text())
    assert trainer["step"] == 6 and trainer["history"]["train"] == train_losses


def test_train_resume_is_exact(train, tmp_path, capsys):
    args = [*TINY, "--steps", "8", "--save_every", "4", "--samples_per_class", "2", "--scales", "1,3"]
    interrupted, straight = tmp_path / "interrupted", tmp_path / "straight"
    assert train.main([*args, "--stop_at", "4", "--out", str(interrupted)]) is None  # stops like a killed run
    assert json.loads((interrupted / "checkpoint" / "trainer.json").read_text())["step"] == 4
    assert not (interrupted / "metrics.json").exists()
    capsys.readouterr()
    resumed = train.main([*args, "--resume", "--out", str(interrupted)])
    assert "steps 4->8 of 8" in capsys.readouterr().out  # it continued; it did not start over
    full = train.main([*args, "--out", str(straight)])
    assert len(resumed["history"]["train"]) == 8
    assert resumed["history"]["train"] == full["history"]["train"]  # bit-identical losses, steps 1..8
    assert resumed["history"]["val"] == full["history"]["val"]
    assert resumed["weight_sha256_per_rank"] == full["weight_sha256_per_rank"]
    assert resumed["accuracy"] == full["accuracy"]
    # dropout and condition dropout are on, so exactness is not an accident of a deterministic model
    assert full["config"]["dropout"] > 0 and full["config"]["cond_drop_prob"] > 0


def test_train_resume_needs_a_checkpoint(train, tmp_path):
    with pytest.raises(FileNotFoundError, match="--resume"):
        train.main([*TINY, "--steps", "2", "--resume", "--out", str(tmp_path / "nothing")])


def test_nonfinite_gradient_is_skipped_and_named(train, tmp_path):
    out = tmp_path / "nan"
    metrics = train.main([*TINY, "--steps", "5", "--debug_nan_step", "3", "--samples_per_class", "1",
                          "--scales", "1", "--out", str(out)])
    # depth 1 = blocks [self-attention, cross-attention, feed-forward]: the last to_v is the cross-attention's
    assert metrics["skipped_steps"] == [
        {"step": 3, "module": "net.attn_layers.layers.1.1.to_v (Linear).weight", "grad_norm": "nan"}
    ]
    assert len(metrics["history"]["train"]) == 5 and _finite(metrics["history"]["train"])
    net = TransformerWrapper.from_pretrained(out / "checkpoint")
    assert all(bool(torch.isfinite(p).all()) for p in net.parameters())
    # the skipped step never reached the optimizer: AdamW counted 4 steps, not 5
    from safetensors.torch import load_file

    opt_state = load_file(str(out / "checkpoint" / "optimizer.safetensors"))
    counts = {float(v) for k, v in opt_state.items() if k.endswith(".step")}
    assert counts == {4.0}


def test_bf16_autocast_matches_float32_at_the_start(train, tmp_path):
    args = [*TINY, "--steps", "3", "--samples_per_class", "1", "--scales", "1"]
    fp32 = train.main([*args, "--out", str(tmp_path / "fp32")])
    bf16 = train.main([*args, "--bf16", "--out", str(tmp_path / "bf16")])
    a, b = fp32["history"]["train"], bf16["history"]["train"]
    assert _finite(b) and bf16["config"]["bf16"] is True
    assert b[0] == pytest.approx(a[0], abs=0.05)  # same weights, same batch: only the precision differs
    assert b[0] != a[0]  # ... and it does differ: autocast was on


def test_config_validation_and_help(train):
    with pytest.raises(ValueError, match="--dropout"):
        train.parse_config(["--dropout", "1.5"])
    with pytest.raises(ValueError, match="--scales"):
        train.parse_config(["--scales", "1,-2"])
    cfg = train.parse_config(["--steps", "7", "--scales", "0,1,4", "--bf16"])
    assert (cfg.steps, cfg.scales, cfg.bf16, cfg.resume) == (7, (0.0, 1.0, 4.0), True, False)
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0
    for option in ("--steps", "--out", "--resume", "--bf16", "--seed", "--cond_drop_prob", "--scales"):
        assert option in done.stdout


def test_learning_rate_schedule(train):
    cfg = train.Config(steps=100, warmup=10, lr=1e-3, min_lr=1e-4)
    assert train.learning_rate(cfg, 0) == pytest.approx(1e-4)
    assert train.learning_rate(cfg, 9) == pytest.approx(1e-3)
    assert train.learning_rate(cfg, 55) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.5)))
    assert train.learning_rate(cfg, 100) == pytest.approx(1e-4)


def test_batches_are_a_partition_shared_by_ranks(train):
    one = train.batch_indices(5, 100, 8, 0, 0, 1)
    halves = [train.batch_indices(5, 100, 8, 0, r, 2) for r in range(2)]
    assert sorted(torch.cat(halves).tolist()) == sorted(one.tolist())  # two ranks split the same batch
    epoch = torch.cat([train.batch_indices(s, 100, 8, 0, 0, 1) for s in range(12)])
    assert len(set(epoch.tolist())) == 96  # no image twice within an epoch


@pytest.mark.slow
def test_torchrun_two_processes_end_with_identical_weights(train, tmp_path):
    # no randomness in training (no dropout), so two processes must equal one process on the same batches
    args = [*TINY, "--steps", "3", "--dropout", "0", "--cond_drop_prob", "0", "--samples_per_class", "1",
            "--scales", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), *args, "--out", str(tmp_path / "ddp")]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    ddp = json.loads((tmp_path / "ddp" / "metrics.json").read_text())
    assert ddp["world_size"] == 2
    first, second = ddp["weight_sha256_per_rank"]
    assert first == second  # bit-identical weights on both ranks
    assert done.stdout.count("class accuracy of the samples") == 1  # rank 0 alone reports
    single = train.main([*args, "--out", str(tmp_path / "single")])
    assert ddp["history"]["train"] == pytest.approx(single["history"]["train"], rel=1e-5)
    a = TransformerWrapper.from_pretrained(tmp_path / "ddp" / "checkpoint").state_dict()
    b = TransformerWrapper.from_pretrained(tmp_path / "single" / "checkpoint").state_dict()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# examples
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def copy_reverse():
    return _load("copy_reverse_example", ROOT / "examples" / "copy_reverse.py")


@pytest.fixture(scope="module")
def char_lm():
    return _load("char_lm_example", ROOT / "examples" / "char_lm.py")


def test_copy_reverse_batches_match_a_plain_reference(copy_reverse):
    g = torch.Generator().manual_seed(3)
    for task in ("copy", "reverse"):
        src, src_mask, tgt, tgt_mask = copy_reverse.make_batch(64, 6, 5, task, g)
        assert not src_mask.all(1).all() and (~src_mask).all(1).any()  # some short, some empty
        for s, m, t, tm in zip(src.tolist(), src_mask.tolist(), tgt.tolist(), tgt_mask.tolist()):
            seq = [x for x, real in zip(s, m) if real]
            answer = seq if task == "copy" else seq[::-1]
            expected = [copy_reverse.BOS, *answer, copy_reverse.EOS]
            assert t == expected + [copy_reverse.PAD] * (8 - len(expected))
            assert tm == [True] * len(expected) + [False] * (8 - len(expected))


def test_copy_reverse_smoke(copy_reverse, tmp_path, capsys):
    out = tmp_path / "rev"
    metrics = copy_reverse.main(["--steps", "40", "--max_len", "5", "--eval_samples", "60", "--log_every", "10",
                                 "--out", str(out)])
    assert "exact match" in capsys.readouterr().out
    losses = metrics["losses"]
    assert len(losses) == 40 and _finite(losses)
    assert sum(losses[-10:]) / 10 < losses[0]  # it learns
    assert 0.0 <= metrics["exact_match"] <= 1.0 and 0.0 <= metrics["exact_match_empty"] <= 1.0
    assert metrics["empty_sources"] > 0  # the evaluation includes empty sources
    assert json.loads((out / "metrics.json").read_text())["exact_match"] == metrics["exact_match"]
    # the saved model reproduces the reported accuracy
    model = XTransformer.from_pretrained(out / "model")
    args = argparse.Namespace(eval_samples=60, max_len=5, vocab=10, task="reverse")
    again = copy_reverse.evaluate(model, args, torch.Generator().manual_seed(2))
    assert again["exact_match"] == metrics["exact_match"] and again["by_length"] == {
        int(k): v for k, v in metrics["by_length"].items()}


def test_char_lm_default_text_exists_offline(char_lm):
    text, source = char_lm.default_text()
    assert len(text.encode("utf-8")) > 100_000 and "pydoc_data" in source


def test_char_lm_smoke(char_lm, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "lm"
    metrics = char_lm.main([str(text), "--steps", "40", "--seq_len", "32", "--batch_size", "16", "--dim", "32",
                            "--depth", "1", "--eval_every", "20", "--log_every", "10", "--sample_len", "40",
                            "--lr", "1e-2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "bits per byte" in printed and "--- sample ---" in printed
    losses = metrics["losses"]
    assert len(losses) == 40 and _finite(losses)
    assert losses[0] == pytest.approx(math.log(256), abs=0.6)  # uniform over bytes at the start
    assert metrics["val_bits_per_byte"] < 4.0  # a repetitive text: far below 8 bits after 40 steps
    assert len(metrics["sample"]) > 0
    model = AutoregressiveWrapper.from_pretrained(out / "model")
    val = torch.frombuffer(bytearray(text.read_bytes()), dtype=torch.uint8)[int(0.9 * len(text.read_bytes())):]
    again = char_lm.validation_loss(model, val, 33, 8, 16)
    assert again == pytest.approx(metrics["val_losses"][-1][1], rel=1e-5)
