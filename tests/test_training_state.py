"""Training state (safeformer/training_state.py) and activation checkpointing (``checkpoint_layers``).

An interrupted run resumed from ``save_training_state`` equals the uninterrupted run bit for bit on the
CPU (model, optimizer, scheduler, RNG: dropout and data draws included); hostile or mismatched state
folders give clear errors naming the file. ``AttentionLayers(checkpoint_layers=True)`` gives identical
gradients.

Shape legend: b batch, n positions, c width, v vocabulary.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
import shutil

import helpers as hp
import numpy as np
import pytest
import safetensors.torch as st
import torch

import safeformer as sf
from safeformer.checkpoints.training_state import load_training_state, save_training_state

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


# ----------------------------------------------------------------------------------------------------
# A training-state folder is hostile input: every corruption is a ValueError naming the file, and a
# refused load changes nothing (model, gradients, optimizer, scheduler, torch/Python/NumPy generators)
# ----------------------------------------------------------------------------------------------------

OPT, RNG, STATE, WEIGHTS = "optimizer.safetensors", "rng.safetensors", "training_state.json", "model.safetensors"
Q = "attn_layers.layers.0.1.to_q.weight"  # a (16, 16) parameter of the tiny model


def tiny(seed: int = 0, stepped: bool = True):
    """A tiny decoder with AdamW and a LambdaLR, after one training step (unless ``stepped=False``)."""
    torch.manual_seed(seed)
    net = sf.TransformerWrapper(num_tokens=16, max_seq_len=8,
                                attn_layers=sf.Decoder(dim=16, depth=1, heads=2, dim_head=8))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    if stepped:
        train_step(net, opt, sched)
    return net, opt, sched


def train_step(net, opt, sched, x=None):
    x = torch.randint(0, 16, (2, 8)) if x is None else x
    loss = torch.nn.functional.cross_entropy(net(x)[:, :-1].reshape(-1, 16), x[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    if sched is not None:
        sched.step()


def snapshot(net, opt, sched) -> dict:
    """Deep copies of everything a load may change."""
    return {"model": {k: v.clone() for k, v in net.state_dict().items()},
            "grads": {n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters()},
            "optimizer": copy.deepcopy(opt.state_dict()) if opt is not None else None,
            "scheduler": copy.deepcopy(sched.state_dict()) if sched is not None else None,
            "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), "numpy_rng": np.random.get_state()}


def difference(a, b, where: str = "") -> str | None:
    """Where ``a`` and ``b`` differ (tensors bitwise, with their dtypes and shapes), or ``None``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        if not both or a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a!r} vs {b!r}"
        same = (a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b
        return None if bool(same.all()) else f"{where}: values differ"
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return None if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b) else where
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        if set(a) != set(b):
            return f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        return next((d for k in a if (d := difference(a[k], b[k], f"{where}.{k}"))), None)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: {len(a)} vs {len(b)} items"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := difference(x, y, f"{where}[{i}]"))), None)
    return None if a == b or (a != a and b != b) else f"{where}: {a!r} vs {b!r}"


def assert_same(a, b, what: str) -> None:
    d = difference(a, b)
    assert d is None, f"{what}: {d}"


def refused(path, match: str, file: str, *, stepped: bool = True, **kw) -> ValueError:
    """Loading ``path`` is a ValueError matching ``match`` and naming ``file``, and changes nothing."""
    net, opt, sched = tiny(seed=9, stepped=stepped)
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    before = snapshot(net, opt, sched)
    with pytest.raises(ValueError, match=match) as err:
        load_training_state(path, net, opt, sched, **kw)
    assert file in str(err.value), f"the message does not name {file}: {err.value}"
    assert_same(snapshot(net, opt, sched), before, f"a refused load ({err.value}) changed")
    return err.value


@pytest.fixture
def state(tmp_path):
    """A saved tiny training state, and a function giving a fresh copy of it."""
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    net, opt, sched = tiny()
    path = save_training_state(tmp_path / "tiny", net, opt, sched, step=1, extra={"note": "x"})
    counter = iter(range(10**6))

    def fresh():
        copy_ = tmp_path / f"copy{next(counter)}"
        shutil.copytree(path, copy_)
        return copy_

    return fresh


def edit_json(path, edit) -> None:
    record = json.loads((path / STATE).read_text())
    edit(record)
    (path / STATE).write_text(json.dumps(record))


def resign(path) -> None:
    """Recompute the folder's sha256 record (the format: each file's SHA-256, and the record's own, over its
    JSON without that entry, keys sorted, compact separators), as a hostile but consistent writer would."""
    record = json.loads((path / STATE).read_text())
    files = {n: hashlib.sha256((path / n).read_bytes()).hexdigest()
             for n in (WEIGHTS, OPT, RNG) if (path / n).is_file()}
    record["sha256"] = files
    files[STATE] = hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    (path / STATE).write_text(json.dumps(record))


def edit_tensors(path, name: str, edit) -> None:
    tensors = st.load_file(str(path / name))
    edit(tensors)
    st.save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(path / name))


@pytest.mark.parametrize("name", [OPT, RNG, WEIGHTS])
def test_truncated_safetensors_files_are_clear_errors(state, name):
    """A truncated optimizer.safetensors or rng.safetensors used to raise safetensors' own SafetensorError."""
    for keep in (0, 7, 12, 100, -1):
        path = state()
        data = (path / name).read_bytes()
        (path / name).write_bytes(data[:keep])
        refused(path, "truncated or corrupted", name)


def test_malformed_scheduler_states_are_clear_errors(state):
    """These used to raise AttributeError/KeyError/TypeError, some after half the folder was loaded."""
    cases = [
        (lambda s: s.update(lr_lambdas=[{"x": 1}]), r"scheduler.lr_lambdas\[0\] must be None"),
        (lambda s: s.update(lr_lambdas=None), r"scheduler.lr_lambdas must be a list"),
        (lambda s: s.update(last_epoch="3"), r"scheduler.last_epoch must be a number"),
        (lambda s: s.update(last_epoch=1.5), r"scheduler.last_epoch must be an integer"),
        (lambda s: s.update(last_epoch=-4), r"scheduler.last_epoch must be >= 0"),
        (lambda s: s.update(base_lrs=[]), r"scheduler.base_lrs must hold 1 items"),
        (lambda s: s.update(_last_lr=["nan"]), r"scheduler._last_lr\[0\] must be finite"),
        (lambda s: s.pop("_step_count"), r"missing \['_step_count'\]"),
        (lambda s: s.update(optimizer={}), r"unexpected \['optimizer'\]"),
        (lambda s: s.update(_get_lr_called_within_step=True), r"_get_lr_called_within_step must be False"),
        (lambda s: s.update(_get_lr_called_within_step=None), r"_get_lr_called_within_step must be False"),
    ]
    for edit, match in cases:
        path = state()
        edit_json(path, lambda r, edit=edit: edit(r["scheduler"]))
        refused(path, match, STATE)
    path = state()
    edit_json(path, lambda r: r.update(scheduler=[1]))
    refused(path, "scheduler must be a mapping", STATE)
    path = state()
    edit_json(path, lambda r: r.pop("scheduler"))
    refused(path, "field 'scheduler' is missing", STATE)

    # a flag the file lacks (a key a newer torch added) takes the scheduler's own value, which it must equal
    path = state()
    edit_json(path, lambda r: (r["scheduler"].pop("_is_initial"), r["optimizer"]["param_groups"][0].pop("foreach")))
    resign(path)
    net, opt, sched = tiny(seed=9)
    want_opt, want_sched = opt.state_dict()["param_groups"][0]["foreach"], sched.state_dict()["_is_initial"]
    load_training_state(path, net, opt, sched)
    assert opt.param_groups[0]["foreach"] is want_opt and sched._is_initial is want_sched


def test_malformed_python_and_numpy_random_states_are_clear_errors(state):
    """These used to raise TypeError/ValueError/IndexError from random.setstate and np.random.set_state."""
    def words(r, key, i, value):
        r[key][1][i] = value

    cases = [
        (lambda r: r.update(python_random=[3, [1, 2]]), "python_random"),
        (lambda r: r["python_random"].__setitem__(0, 2), "python_random"),
        (lambda r: r["python_random"][1].pop(), r"python_random'\[1\] must be a list of 625"),
        (lambda r: words(r, "python_random", 5, -1), r"integers in \[0, 2\*\*32\)"),
        (lambda r: words(r, "python_random", 5, 2**32), r"integers in \[0, 2\*\*32\)"),
        (lambda r: words(r, "python_random", 624, 625), "the position"),
        (lambda r: words(r, "python_random", 624, "1"), "the position"),
        (lambda r: r["python_random"].__setitem__(2, "x"), "null or a number"),
        (lambda r: r["python_random"].__setitem__(1, [0] * 624 + [624]), "all zeros"),
        (lambda r: r.pop("python_random"), "field 'python_random' is missing"),
        (lambda r: r["numpy_random"].__setitem__(0, "PCG64"), "numpy_random"),
        (lambda r: r["numpy_random"].pop(), "numpy_random"),
        (lambda r: r["numpy_random"][1].pop(), r"numpy_random'\[1\] must be a list of 624"),
        (lambda r: words(r, "numpy_random", 3, 2**40), r"integers in \[0, 2\*\*32\)"),
        (lambda r: r["numpy_random"].__setitem__(1, [0] * 624), "all zeros"),
        (lambda r: r["numpy_random"].__setitem__(2, 700), "the position"),
        (lambda r: r["numpy_random"].__setitem__(3, 2), "has_gauss"),
        (lambda r: r["numpy_random"].__setitem__(4, None), "cached gaussian"),
        (lambda r: r.pop("numpy_random"), "field 'numpy_random' is missing"),
    ]
    for edit, match in cases:
        path = state()
        edit_json(path, edit)
        refused(path, match, STATE)
    path = state()  # restore_rng=False reads none of it
    edit_json(path, lambda r: r.pop("python_random"))
    resign(path)
    net, opt, sched = tiny(seed=9)
    load_training_state(path, net, opt, sched, restore_rng=False)


def test_malformed_torch_rng_blobs_are_clear_errors(state):
    """These used to raise RuntimeError from torch.set_rng_state (after the model was loaded)."""
    cases = [
        (lambda t: t.update(cpu=t["cpu"][:-8]), r"'cpu' holds 5048 bytes"),
        (lambda t: t.update(cpu=torch.cat([t["cpu"], t["cpu"][:4]])), "'cpu' holds 5060 bytes"),
        (lambda t: t.update(cpu=t["cpu"].view(torch.int32)), "must be a 1-d uint8"),
        (lambda t: t.update(cpu=t["cpu"].float()), "must be a 1-d uint8"),
        (lambda t: t.update(cpu=t["cpu"].reshape(2, -1)), "must be a 1-d uint8"),
        (lambda t: t.update(cpu=torch.zeros_like(t["cpu"])), "not a valid CPU generator state"),
        (lambda t: t.pop("cpu"), "holds no CPU generator state"),
        (lambda t: t.update(gpu=t["cpu"]), "unexpected entry 'gpu'"),
    ]
    for edit, match in cases:
        path = state()
        edit_tensors(path, RNG, edit)
        refused(path, match, RNG)


def test_optimizer_state_of_the_wrong_shape_is_refused_at_load(state):
    """It used to be accepted and fail at the next optimizer.step(); now the load names file, entry and shapes."""
    path = state()
    edit_tensors(path, OPT, lambda t: t.update({f"{Q}::exp_avg": torch.zeros(15, 16)}))
    refused(path, rf"optimizer.safetensors: state of '{Q}' exp_avg has shape \(15, 16\), the parameter has \(16, 16\)",
            OPT)
    cases = [
        (lambda t: t.update({f"{Q}::exp_avg": torch.zeros(1, 16)}), r"has shape \(1, 16\)"),  # broadcastable
        (lambda t: t.update({f"{Q}::exp_avg": torch.zeros(256)}), r"has shape \(256,\)"),
        (lambda t: t.update({f"{Q}::exp_avg": t[f"{Q}::exp_avg"].double()}), "has dtype torch.float64"),
        (lambda t: t.update({f"{Q}::exp_avg": t[f"{Q}::exp_avg"] * float("nan")}), "holds NaN or inf"),
        (lambda t: t.update({f"{Q}::exp_avg_sq": -t[f"{Q}::exp_avg_sq"] - 1}), "holds negative values"),
        (lambda t: t.pop(f"{Q}::exp_avg_sq"), r"missing \['exp_avg_sq'\]"),
        (lambda t: t.update({f"{Q}::max_exp_avg_sq": t[f"{Q}::exp_avg_sq"]}), r"unexpected \['max_exp_avg_sq'\]"),
        (lambda t: t.update({"nowhere.weight::exp_avg": torch.zeros(3)}),
         "'nowhere.weight::exp_avg' names no parameter"),
        (lambda t: t.update({f"{Q}:exp_avg": torch.zeros(3)}), "names no parameter"),
    ]
    for edit, match in cases:
        path = state()
        edit_tensors(path, OPT, edit)
        refused(path, match, OPT)
    for edit, match in [
        (lambda s: s.update({f"{Q}::step": -1.0}), rf"'{Q}::step' must be >= 0"),
        (lambda s: s.update({f"{Q}::step": 1e39}), "out of the range of torch.float32"),
        (lambda s: s.update({f"{Q}::step": "1"}), "must be a number"),
        (lambda s: s.pop(f"{Q}::step"), r"missing \['step'\]"),
        (lambda s: s.update({f"{Q}::exp_avg": 0.0}), "is both a tensor"),
    ]:
        path = state()
        edit_json(path, lambda r, edit=edit: edit(r["optimizer"]["scalars"]))
        refused(path, match, STATE)


def test_optimizer_param_groups_are_checked_against_the_optimizer(state):
    def group(edit):
        return lambda r: edit(r["optimizer"]["param_groups"][0])

    cases = [
        (group(lambda g: g.update(betas=[0.9, 1.5])), "Invalid beta parameter at index 1"),  # AdamW's own check
        (group(lambda g: g.update(betas=[0.9])), r"betas must hold 2 items"),
        (group(lambda g: g.update(lr=-1.0)), r"param_groups\[0\].lr must be >= 0"),
        (group(lambda g: g.update(lr="nan")), r"param_groups\[0\].lr must be finite"),
        (group(lambda g: g.update(eps=None)), r"param_groups\[0\].eps must be a number"),
        (group(lambda g: g.update(amsgrad=True)), r"amsgrad must be False"),
        (group(lambda g: g.update(foreach=False)), r"foreach must be None"),
        (group(lambda g: g.pop("eps")), r"missing \['eps'\]"),
        (group(lambda g: g.update(momentum=0.9)), r"unexpected \['momentum'\]"),
        (group(lambda g: g["params"].pop()), r"params must name the group's 14 parameters"),
        (group(lambda g: g["params"].append(g["params"][0])), r"params must name"),
        (lambda r: r["optimizer"]["param_groups"].append({}), "holds 2 groups, the optimizer has 1"),
        (lambda r: r["optimizer"].update(param_groups=[7]), r"param_groups\[0\] must be a mapping"),
        (lambda r: r.pop("optimizer"), "field 'optimizer' is missing"),
    ]
    for edit, match in cases:
        path = state()
        edit_json(path, edit)
        refused(path, match, STATE)


def test_model_weights_are_checked(state):
    emb = "token_emb.emb.weight"
    cases = [
        (lambda t: t.update({emb: t[emb].double()}), f"'{emb}' has dtype torch.float64, the model has torch.float32"),
        (lambda t: t.update({emb: t[emb][:, :8]}), rf"'{emb}' has shape \(16, 8\), the model has \(16, 16\)"),
        (lambda t: t.update({emb: t[emb].index_fill(0, torch.tensor([3]), float("inf"))}), "holds NaN or inf"),
        (lambda t: t.pop(emb), f"missing \\['{emb}'\\]"),
        (lambda t: t.update(extra=torch.zeros(2)), r"unexpected \['extra'\]"),
    ]
    for edit, match in cases:
        path = state()
        edit_tensors(path, WEIGHTS, edit)
        refused(path, match, WEIGHTS)


def test_tied_weights_must_agree(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
            self.b.weight = self.a.weight

    path = save_training_state(tmp_path / "s", Tied(), step=0)
    edit_tensors(path, WEIGHTS, lambda t: t.update({"b.weight": t["b.weight"] + 1}))
    with pytest.raises(ValueError, match="'a.weight' and 'b.weight' are one tensor in the model"):
        load_training_state(path, Tied())


def test_load_into_a_never_stepped_optimizer_with_gradients_set(state):
    """It used to fail ('the optimizer state does not fit this optimizer: Expected device to be set')."""
    path = state()
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    saved_net, saved_opt, saved_sched = tiny()  # the saved objects, rebuilt
    net, opt, sched = tiny(seed=5, stepped=False)
    x = torch.randint(0, 16, (2, 8))
    net(x).sum().backward()  # gradients set, optimizer never stepped
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    load_training_state(path, net, opt, sched)
    assert_same({n: p.grad for n, p in net.named_parameters()}, grads, "the gradients")
    assert_same(opt.state_dict(), saved_opt.state_dict(), "the optimizer state")
    assert_same(net.state_dict(), saved_net.state_dict(), "the weights")
    x = torch.randint(0, 16, (2, 8))
    train_step(net, opt, sched, x)
    train_step(saved_net, saved_opt, saved_sched, x)
    assert_same(net.state_dict(), saved_net.state_dict(), "the weights one step later")


def test_stateless_optimizers_and_parameters_without_state(tmp_path):
    """SGD without momentum keeps no state (its load used to fail); a parameter without saved state has none."""
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    lin(torch.randn(4, 3)).sum().backward()
    opt.step()
    save_training_state(tmp_path / "sgd", lin, opt, step=1)
    lin2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.SGD(lin2.parameters(), lr=0.1)
    load_training_state(tmp_path / "sgd", lin2, opt2)
    assert_same(opt2.state_dict(), opt.state_dict(), "SGD's state")

    net, opt, _ = tiny(stepped=False)
    net.token_emb.weight.requires_grad_(False)  # no gradient: no state
    train_step(net, opt, None)
    net.token_emb.weight.requires_grad_(True)
    save_training_state(tmp_path / "partial", net, opt, step=1)
    net2, opt2, _ = tiny(seed=4)  # every parameter has state
    load_training_state(tmp_path / "partial", net2, opt2)
    assert net2.token_emb.weight not in opt2.state
    assert_same(opt2.state_dict(), opt.state_dict(), "the optimizer state")


def test_sha256_catches_what_the_structure_cannot(state):
    """A changed value in a well-formed file is caught by the sha256 record; a folder without it still loads."""
    for name, edit in [(OPT, lambda t: t[f"{Q}::exp_avg"].add_(1e-3)),
                       (WEIGHTS, lambda t: t["token_emb.emb.weight"].mul_(2)),
                       (RNG, lambda t: t.update(cpu=torch.Generator().manual_seed(1).get_state()))]:
        path = state()
        edit_tensors(path, name, edit)
        refused(path, f"{name} does not match the sha256 recorded for it", name)
    path = state()
    edit_json(path, lambda r: r["optimizer"]["param_groups"][0].update(lr=0.5))
    refused(path, "does not match the sha256 it records for itself", STATE)
    path = state()
    edit_json(path, lambda r: r["sha256"].update({WEIGHTS: "0" * 64}))
    refused(path, "does not match the sha256 it records for itself", STATE)
    path = state()
    edit_json(path, lambda r: r["sha256"].update({WEIGHTS: "xyz"}))
    refused(path, "field 'sha256'", STATE)

    path = state()  # written before the sha256 record existed
    edit_json(path, lambda r: r.pop("sha256"))
    net, opt, sched = tiny(seed=9)
    assert load_training_state(path, net, opt, sched) == {"step": 1, "extra": {"note": "x"}}


def test_json_record_fields(state):
    for edit, match in [(lambda r: r.update(extra=[1]), "field 'extra' must be a mapping"),
                        (lambda r: r.pop("extra"), "field 'extra' must be a mapping"),
                        (lambda r: r.update(step=True), "field 'step'"),
                        (lambda r: r.update(step=2**63), "field 'step'"),
                        (lambda r: r.update(version=True), "format/version")]:
        path = state()
        edit_json(path, edit)
        refused(path, match, STATE)
    for text, match in [("[" * 100000, "not valid JSON"), ('{"step": NaN}', "not valid JSON"),
                        ('{"step": 1e999}', "not valid JSON"), ("1" * 5000, "not valid JSON")]:
        path = state()
        (path / STATE).write_text(text)
        refused(path, match, STATE)
    path = state()
    (path / STATE).write_bytes(b'{"format": "\xff"}')
    refused(path, "not valid JSON", STATE)


OPTIMIZERS = {"SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
              "Adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
              "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
              "NAdam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
              "ASGD": lambda ps: torch.optim.ASGD(ps, lr=1e-2), "Rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
              "Adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2), "RMSprop": lambda ps: torch.optim.RMSprop(ps)}
SCHEDULERS = {"StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, 2),
              "MultiStepLR": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [2, 3]),
              "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 0.1, total_steps=20),
              "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(
                  o, [torch.optim.lr_scheduler.ConstantLR(o), torch.optim.lr_scheduler.ExponentialLR(o, 0.9)], [2]),
              "CosineAnnealingWarmRestarts": lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, 3),
              "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0)}


@pytest.mark.parametrize("optimizer,scheduler", [(o, None) for o in OPTIMIZERS]
                         + [("SGD", s) for s in SCHEDULERS])
def test_torch_optimizers_and_schedulers_round_trip_exactly(tmp_path, optimizer, scheduler):
    """The checks accept every legitimate state: a resumed run continues bit for bit."""
    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
        opt = OPTIMIZERS[optimizer](model.parameters())
        return model, opt, SCHEDULERS[scheduler](opt) if scheduler else None

    def step(model, opt, sched, x):
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step(float(loss.detach())) if scheduler == "ReduceLROnPlateau" else sched.step()

    model, opt, sched = build(0)
    data = torch.randn(8, 5, 3)
    for x in data[:4]:
        step(model, opt, sched, x)
    save_training_state(tmp_path / "s", model, opt, sched, step=4)
    model2, opt2, sched2 = build(1)
    load_training_state(tmp_path / "s", model2, opt2, sched2)
    assert_same(opt2.state_dict(), opt.state_dict(), "the optimizer state")
    if sched is not None:
        assert_same(sched2.state_dict(), sched.state_dict(), "the scheduler state")
    for x in data[4:]:
        step(model, opt, sched, x)
        step(model2, opt2, sched2, x)
    assert_same(model2.state_dict(), model.state_dict(), "the weights after 4 more steps")


def test_sparse_adam_state_round_trips(tmp_path):
    """The probe that learns an optimizer's state layout steps SparseAdam with sparse gradients."""
    def build():
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 4, sparse=True)
        return emb, torch.optim.SparseAdam(emb.parameters(), lr=0.1)

    emb, opt = build()
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    save_training_state(tmp_path / "s", emb, opt, step=1)
    emb2, opt2 = build()
    load_training_state(tmp_path / "s", emb2, opt2)
    assert_same(opt2.state_dict(), opt.state_dict(), "SparseAdam's state")


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_sharded_model_loads_with_gradients_set_and_exactly_the_saved_state(tmp_path):
    """FSDP2 (one process, gloo): torch.distributed.checkpoint loads the optimizer state. It used to fail when
    gradients were set on a never-stepped optimizer; a parameter without saved state has none afterwards."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed with gloo, and no process group yet")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    net, opt, sched = tiny(stepped=False)
    net.token_emb.weight.requires_grad_(False)  # no gradient in the saved run: no state
    train_step(net, opt, sched)
    net.token_emb.weight.requires_grad_(True)
    path = save_training_state(tmp_path / "s", net, opt, sched, step=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharded, _, _ = tiny(seed=5, stepped=False)
        for layer in sharded.attn_layers.layers:
            fully_shard(layer)
        fully_shard(sharded)
        opt2 = torch.optim.AdamW(sharded.parameters(), lr=1e-2, weight_decay=0.1)
        sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 0.5 ** s)
        sharded(torch.randint(0, 16, (2, 8))).sum().backward()  # gradients set, never stepped
        grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}
        (tmp_path / "bad").mkdir()
        for f in path.iterdir():
            (tmp_path / "bad" / f.name).write_bytes(f.read_bytes()[:100] if f.name == OPT else f.read_bytes())
        with pytest.raises(ValueError, match="optimizer.safetensors could not be read"):
            load_training_state(tmp_path / "bad", sharded, opt2, sched2)
        assert not opt2.state, "a refused load initialised the optimizer state"
        load_training_state(path, sharded, opt2, sched2)
        assert_same({n: p.grad.full_tensor() for n, p in sharded.named_parameters()}, grads, "the gradients")
        full = StateDictOptions(full_state_dict=True)
        assert_same(get_optimizer_state_dict(sharded, opt2, options=full),
                    get_optimizer_state_dict(net, opt, options=full), "the optimizer state")
        assert sharded.token_emb.weight not in opt2.state
        weights = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
        assert_same(weights, dict(net.state_dict()), "the weights")
    finally:
        dist.destroy_process_group()
