"""Training state (safeformer/training_state.py) and activation checkpointing (``checkpoint_layers``).

An interrupted run resumed from ``save_training_state`` equals the uninterrupted run bit for bit on the
CPU (model, optimizer, scheduler, RNG: dropout and data draws included); hostile or mismatched state
folders give clear errors naming the file. ``AttentionLayers(checkpoint_layers=True)`` gives identical
gradients.

Shape legend: b batch, n positions, c width, v vocabulary.
"""

from __future__ import annotations

import json
import math

import helpers as hp
import pytest
import torch

import safeformer as sf
from safeformer.training_state import load_training_state, save_training_state

V = 13


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=16, attn_layers=sf.Decoder(
        dim=16, depth=2, heads=2, dim_head=8, attn_dropout=0.2, ff_dropout=0.2, cross_attend=True))
    model = sf.AutoregressiveWrapper(net, cond_drop_prob=0.3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.5 * (1 + math.cos(math.pi * s / 8)))
    return model, opt, sched


def _step(model, opt, sched):
    """One step whose data, condition drop and dropout all come from the global RNG."""
    x = torch.randint(0, V, (4, 9))
    ctx = torch.randn(4, 3, 16)
    mask = torch.rand(4, 9) > 0.2
    mask[:, 0] = True
    loss = model(x, mask=mask, context=ctx)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.detach())


def test_interrupted_run_resumed_equals_uninterrupted_bit_for_bit(tmp_path):
    torch.manual_seed(123)
    model, opt, sched = _setup()
    model.train()
    torch.manual_seed(7)
    straight = [_step(model, opt, sched) for _ in range(6)]
    want = {k: v.clone() for k, v in model.state_dict().items()}

    model, opt, sched = _setup()
    model.train()
    torch.manual_seed(7)
    first = [_step(model, opt, sched) for _ in range(3)]
    save_training_state(tmp_path / "state", model, opt, sched, step=3, extra={"losses": first})
    torch.manual_seed(999)  # the interruption: the process dies, a new one starts with other RNG state
    model2, opt2, sched2 = _setup(seed=5)  # built afresh, other weights
    model2.train()
    info = load_training_state(tmp_path / "state", model2, opt2, sched2)
    assert info["step"] == 3 and info["extra"]["losses"] == first
    rest = [_step(model2, opt2, sched2) for _ in range(3)]
    assert first + rest == straight, "the losses of the resumed run differ"
    for k, v in model2.state_dict().items():
        hp.assert_bitwise(v, want[k], f"weight {k} after resume")
    assert sched2.last_epoch == 6


def test_training_state_of_a_plain_module_and_atomic_replace(tmp_path):
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    lin(torch.randn(4, 3)).sum().backward()
    opt.step()
    path = save_training_state(tmp_path / "s", lin, opt, step=1)
    assert not (path / "config.json").exists()  # not a safeformer model: weights only
    save_training_state(tmp_path / "s", lin, opt, step=2)  # replaces the folder
    assert not (tmp_path / "s.tmp").exists() and not (tmp_path / "s.old").exists()
    lin2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.SGD(lin2.parameters(), lr=0.1, momentum=0.9)
    assert load_training_state(tmp_path / "s", lin2, opt2)["step"] == 2
    hp.assert_bitwise(lin2.weight, lin.weight, "weight")
    hp.assert_bitwise(opt2.state[lin2.weight]["momentum_buffer"], opt.state[lin.weight]["momentum_buffer"], "momentum")


def test_hostile_training_state_folders_are_clear_errors(tmp_path):
    model, opt, sched = _setup()
    path = save_training_state(tmp_path / "s", model, opt, sched, step=0)
    state_file = path / "training_state.json"
    good = json.loads(state_file.read_text())

    def broken(**changes):
        state_file.write_text(json.dumps({**good, **changes}))
        return path

    for changes, text in (({"format": "other"}, "training_state.json"), ({"step": -1}, "step"),
                          ({"step": "3"}, "step"), ({"optimizer": {"param_groups": 1}}, "optimizer")):
        with pytest.raises(ValueError, match=text):
            load_training_state(broken(**changes), *_setup()[:3])
    state_file.write_text(json.dumps({**good, "optimizer": {**good["optimizer"], "scalars": {"999.step": 1.0}}}))
    with pytest.raises(ValueError, match="999.step"):
        load_training_state(path, *_setup()[:3])
    state_file.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_training_state(path, *_setup()[:3])
    state_file.write_text(json.dumps(good))
    other = sf.TransformerWrapper(num_tokens=V, max_seq_len=16, attn_layers=sf.Decoder(dim=16, depth=1))
    with pytest.raises(ValueError, match="model.safetensors"):
        load_training_state(path, other)
    (path / "rng.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="rng.safetensors"):
        load_training_state(path, *_setup()[:3])
    with pytest.raises(ValueError, match="step"):
        save_training_state(tmp_path / "t", model, step=-2)


@pytest.mark.parametrize("adaptive", [False, True])
def test_checkpoint_layers_gives_identical_gradients(adaptive):
    """Recomputed blocks (dropout included: the RNG state is replayed) give bit-identical gradients."""
    kw = dict(cross_attend=True, use_adaptive_layernorm=True, dim_condition=3) if adaptive else {}
    runs = []
    for ck in (False, True):
        torch.manual_seed(0)
        dec = sf.Decoder(dim=16, depth=2, heads=2, dim_head=8, attn_dropout=0.1, ff_dropout=0.1,
                         checkpoint_layers=ck, **kw).train()
        x = torch.randn(3, 5, 16, requires_grad=True)
        mask = torch.tensor([[True] * 5, [False, False, True, True, True], [False] * 5])
        extra = dict(context=torch.randn(3, 2, 16), condition=torch.randn(3, 3)) if adaptive else {}
        torch.manual_seed(1)
        out = dec(x, mask=mask, **extra)
        out.pow(2).sum().backward()
        runs.append((out.detach(), x.grad, {n: p.grad for n, p in dec.named_parameters()}))
    (o0, g0, p0), (o1, g1, p1) = runs
    hp.assert_bitwise(o1, o0, "output")
    hp.assert_bitwise(g1, g0, "grad of x")
    for n, g in p0.items():
        if g is None:
            assert p1[n] is None, n
        else:
            hp.assert_bitwise(p1[n], g, f"grad of {n}")


def test_checkpoint_layers_saves_activation_memory():
    """Fewer tensors are kept for the backward pass (counted by saved-tensor hooks)."""
    saved = {}
    for ck in (False, True):
        torch.manual_seed(0)
        dec = sf.Decoder(dim=32, depth=4, heads=2, dim_head=16, checkpoint_layers=ck).train()
        x = torch.randn(4, 32, 32, requires_grad=True)
        total = [0]

        def pack(t, total=total):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = dec(x)
        saved[ck] = total[0]
        out.sum().backward()
    assert saved[True] < 0.5 * saved[False], f"checkpointing kept {saved[True]} bytes vs {saved[False]}"
