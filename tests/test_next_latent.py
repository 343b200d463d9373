"""Tests for ``safeformer.research.next_latent.NextLatentWrapper``: each loss term against a float64 reference in
plain code (each sample's real tokens alone, rollouts step by step, SIGReg with cosines and sines), the
safety contract (padding by ``ignore_index`` or ``mask``, left padding, fully padded samples, garbage ids
at padded positions, NaN/inf at masked context slots, an all-ignored batch), named errors, and parity
with x-transformers' ``NextLatentWrapper`` on converted weights."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, assert_finite, assert_zero
from test_dpo import check_probe

import safeformer as sf
from safeformer.research.next_latent import (
    MSECosineSimLoss,
    NextLatentWrapper,
    ResidualDynamics,
    next_latent_from_x_transformers,
)

V, D = 11, 16


def make_net(seed: int = 0, cross: bool = False, dtype=torch.float32) -> sf.TransformerWrapper:
    torch.manual_seed(seed)
    return sf.TransformerWrapper(num_tokens=V, max_seq_len=24, attn_layers=sf.Decoder(
        dim=D, depth=1, heads=2, dim_head=8, rotary_pos_emb=True, cross_attend=cross, dim_context=D)).to(dtype)


def make_model(dtype=torch.float32, cross: bool = False, **kw) -> NextLatentWrapper:
    net = make_net(0, cross, dtype)
    torch.manual_seed(1)
    model = NextLatentWrapper(net, dim=D, **kw).to(dtype)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # the residual MLP's last layer starts at 0: move it so the rollouts move
        for p in model.dynamics_model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _batch(seed=0, b=4, n=8, lengths=(8, 0, 5, 2)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (b, n), generator=g)
    lengths = list(lengths)[:b]
    real = sf.padding_mask(torch.tensor(lengths), n)
    return torch.where(real, x, -100), lengths


# ----------------------------------------------------------------------------------------------------
# float64 references
# ----------------------------------------------------------------------------------------------------


def ref_terms(model: NextLatentWrapper, x: torch.Tensor, lengths, given=None, **cond):
    """``(ce, next_latent, kl)`` by hand: each sample's real tokens alone, rollouts step by step;
    ``given``: the rollout weights as passed (default all 1)."""
    R = model.num_rollouts
    ws = [1.0] * R if given is None else [float(v) for v in given]
    w = [v / sum(ws) for v in ws]
    head = model.net._head
    ce_terms, lat = [[] for _ in range(R)], [[] for _ in range(R)]
    kls = [[] for _ in range(R)]
    for i, L in enumerate(lengths):
        if L < 2:
            continue
        tok = x[i, :L]
        c = {k: v[i: i + 1] for k, v in cond.items()}
        h = model.net(tok[None], return_embeddings=True, **c)[0]  # (L, d)
        emb = model.net.token_emb(tok)
        for t in range(L - 1):
            ce_terms[0].append(-head(h[t]).log_softmax(-1)[tok[t + 1]])
            latent, before = h[t], 0.0
            for k in range(R):
                if t + k + 1 > L - 1:
                    break
                latent = model.dynamics_model(emb[t + k + 1][None, None, None], latent[None, None])[0, 0, 0]
                loss = model.loss_fn(latent[None], h[t + k + 1][None])[0]  # (d,)
                dyn = math.exp(-model.dynamic_loss_decay * before) if model.dynamic_rollout_loss_weight else 1.0
                before += float(loss.detach().mean())
                lat[k].append(loss.mean() * w[k] * dyn)
                tgt = head(h[t + k + 1]).log_softmax(-1)
                pred = head(latent).log_softmax(-1)
                kls[k].append((tgt.exp() * (tgt - pred)).sum() * w[k] * dyn)
    ce = torch.stack(ce_terms[0]).mean()
    next_latent = sum(torch.stack(v).mean() for v in lat if v)
    kl = sum(torch.stack(v).mean() for v in kls if v)
    return ce, next_latent, kl


def ref_sigreg(x: torch.Tensor, projs: torch.Tensor, domain=(-5, 5), num_knots=17) -> torch.Tensor:
    """SIGReg with cosines and sines: ``x (N, d)``, ``projs (m, d)`` unit rows."""
    t = torch.linspace(*domain, num_knots, dtype=torch.float64)
    exp_f = torch.exp(-0.5 * t**2)
    per_slice = []
    for p in projs:
        z = x @ p  # (N,)
        re = torch.cos(z[:, None] * t).mean(0)
        im = torch.sin(z[:, None] * t).mean(0)
        err = ((re - exp_f) ** 2 + im**2) * exp_f
        per_slice.append(torch.trapezoid(err, t))
    return torch.stack(per_slice).mean()


@pytest.mark.parametrize("opts", [dict(num_rollouts=3), dict(num_rollouts=2, loss_type="mse_and_cosine_sim",
                                                                 dynamic_rollout_loss_weight=False, rollout_weights=(1.0, 3.0)),
                                  dict(num_rollouts=2, dynamics_type="gru", loss_type="mse", dynamic_loss_decay=0.5)])
def test_loss_terms_match_float64_reference(opts):
    model = make_model(torch.float64, **opts).eval()
    x, lengths = _batch()
    total, parts = model(x, return_loss_breakdown=True)
    ce, nl, kl = ref_terms(model, x, lengths, opts.get("rollout_weights"))
    assert_close(parts.ce, ce, "ce", torch.float64)
    assert_close(parts.next_latent, nl, "next-latent loss", torch.float64)
    assert_close(parts.kl, kl, "kl", torch.float64)
    assert_close(total, ce + nl + kl, "total", torch.float64)


def test_sigreg_matches_reference_on_counted_positions():
    model = make_model(torch.float64, sigreg_loss_weight=0.5, sigreg_loss_kwargs=dict(num_slices=8, domain=(-3, 3), num_knots=9))
    x, lengths = _batch(1)
    _, parts = model(x, return_loss_breakdown=True, generator=torch.Generator().manual_seed(5))
    projs = F.normalize(torch.randn(8, D, generator=torch.Generator().manual_seed(5)).double(), dim=-1)
    # the hidden states that predict a counted target: each sample's real positions but its last
    h = torch.cat([model.net(x[i: i + 1, :L], return_embeddings=True)[0, :-1] for i, L in enumerate(lengths) if L >= 2])
    assert_close(parts.sigreg, ref_sigreg(h, projs, (-3, 3), 9), "sigreg", torch.float64)
    empty = NextLatentWrapper.sigreg_loss(torch.zeros(0, D, dtype=torch.float64), num_slices=4)
    assert empty.item() == 0.0


def test_left_padding_and_mask_are_the_same_loss():
    model = make_model(torch.float64, num_rollouts=2, sigreg_loss_weight=0.1,
                       sigreg_loss_kwargs=dict(num_slices=4, domain=(-5, 5), num_knots=5)).eval()
    x, lengths = _batch(2)
    n = x.shape[1]
    right = model(x, generator=torch.Generator().manual_seed(0))
    mask = x != -100
    by_mask = model(torch.where(mask, x, 10**6), mask=mask, generator=torch.Generator().manual_seed(0))
    assert_close(by_mask, right, "mask instead of ignore_index", torch.float64)
    left = torch.full_like(x, -100)
    for i, L in enumerate(lengths):
        if L:
            left[i, n - L:] = x[i, :L]
    assert_close(model(left, generator=torch.Generator().manual_seed(0)), right, "left padding", torch.float64)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 1e4])
def test_garbage_in_masked_slots_reaches_nothing(value):
    model = make_model(cross=True, num_rollouts=2, sigreg_loss_weight=0.1,
                       sigreg_loss_kwargs=dict(num_slices=8, domain=(-5, 5), num_knots=5))
    x, lengths = _batch(3)
    mask = x != -100
    g = torch.Generator().manual_seed(4)
    ctx = torch.randn(4, 3, D, generator=g)
    ctx_mask = torch.tensor([[True, False, True], [False] * 3, [True] * 3, [False, True, False]])

    def run(ids, c, m):
        c = c.clone().requires_grad_()
        model.zero_grad()
        loss = model(ids, mask=m, context=c, context_mask=ctx_mask, generator=torch.Generator().manual_seed(0))
        loss.backward()
        return loss, c.grad, [p.grad.clone() for p in model.parameters()]

    clean = run(x, ctx, None)
    dirty = run(torch.where(mask, x, 10**6), ctx.masked_fill(~ctx_mask[..., None], value), mask)
    assert_finite(dirty[0], "loss")
    assert torch.equal(clean[0], dirty[0])
    assert_zero(dirty[1][~ctx_mask], "gradient at masked context slots")
    for a, b_ in zip(clean[2], dirty[2]):
        assert_finite(b_, "parameter gradient")
        assert torch.equal(a, b_)


@pytest.mark.parametrize("dynamics_type", ["residual", "gru"])
def test_all_ignored_batch_is_zero_loss_with_zero_gradients(dynamics_type):
    model = make_model(num_rollouts=2, dynamics_type=dynamics_type, sigreg_loss_weight=1.0,
                       sigreg_loss_kwargs=dict(num_slices=4, domain=(-5, 5), num_knots=5))
    x, _ = _batch(5)
    for ids in (torch.full_like(x, -100), torch.where(torch.arange(x.shape[1]) < 1, x.clamp(min=0), -100)):
        model.zero_grad()
        loss, parts = model(ids, return_loss_breakdown=True)
        loss.backward()
        assert loss.item() == 0.0 and all(p.item() == 0.0 for p in parts)
        for name, p in model.named_parameters():
            assert_zero(p.grad, f"gradient of {name}")


def test_named_errors():
    model = make_model()
    x, _ = _batch()
    with pytest.raises(TypeError, match="net"):
        NextLatentWrapper(torch.nn.Linear(2, 2), dim=2)
    with pytest.raises(ValueError, match="causal"):
        NextLatentWrapper(sf.TransformerWrapper(num_tokens=V, max_seq_len=8, attn_layers=sf.Encoder(dim=D, depth=1)), dim=D)
    with pytest.raises(ValueError, match="dim"):
        NextLatentWrapper(make_net(), dim=D + 1)
    with pytest.raises(ValueError, match="num_rollouts"):
        NextLatentWrapper(make_net(), dim=D, num_rollouts=0)
    with pytest.raises(ValueError, match="loss_type"):
        NextLatentWrapper(make_net(), dim=D, loss_type="l3")
    with pytest.raises(ValueError, match="dynamics_type"):
        NextLatentWrapper(make_net(), dim=D, dynamics_type="lstm")
    with pytest.raises(ValueError, match="dynamics_network"):
        NextLatentWrapper(make_net(), dim=D, dynamics_type="custom")
    with pytest.raises(ValueError, match="rollout_weights"):
        NextLatentWrapper(make_net(), dim=D, num_rollouts=2, rollout_weights=(1.0,))
    with pytest.raises(ValueError, match="rollout_weights"):
        NextLatentWrapper(make_net(), dim=D, num_rollouts=2, rollout_weights=(0.0, 0.0))
    with pytest.raises(ValueError, match="kl_loss_weight"):
        NextLatentWrapper(make_net(), dim=D, kl_loss_weight=float("nan"))
    with pytest.raises(TypeError, match="x"):
        model(x.float())
    with pytest.raises(ValueError, match="num_rollouts"):
        make_model(num_rollouts=3)(x[:, :4])
    with pytest.raises(TypeError, match="mask"):
        model(x, mask=(x >= 0).int())
    with pytest.raises(ValueError, match="x holds token id"):
        model(x.clamp(min=0) + V)
    with pytest.raises(TypeError, match="NextLatentWrapper"):
        next_latent_from_x_transformers(make_net())


# ----------------------------------------------------------------------------------------------------
# x-transformers
# ----------------------------------------------------------------------------------------------------


def _xt_wrapper(dynamics_type, loss_type, **kw):
    xt = pytest.importorskip("x_transformers")
    from x_transformers import next_latent_wrapper as xnl

    torch.manual_seed(0)
    net = xt.TransformerWrapper(num_tokens=V, max_seq_len=24, attn_layers=xt.Decoder(dim=D, depth=2, heads=2, attn_dim_head=8))
    network = None
    if dynamics_type == "residual-net":
        network, dynamics_type = torch.nn.Sequential(torch.nn.Linear(2 * D, D), torch.nn.GELU(), torch.nn.Linear(D, D)), "residual"
    elif dynamics_type == "custom":
        network = xnl.ResidualDynamics(torch.nn.Sequential(torch.nn.Linear(2 * D, D), torch.nn.Tanh(), torch.nn.Linear(D, D)))
    torch.manual_seed(1)
    w = xnl.NextLatentWrapper(net, dim=D, num_rollouts=3, loss_type=loss_type, dynamics_type=dynamics_type,
                              dynamics_network=network, **kw)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in w.dynamics_model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return w


@pytest.mark.parametrize("dynamics_type,loss_type,kw", [
    ("residual", "smooth_l1", {}),
    ("residual-net", "mse_and_cosine_sim", dict(rollout_weights=(1.0, 2.0, 0.5))),
    ("gru", "mse", dict(dynamic_rollout_loss_weight=False, kl_loss_weight=0.3)),
    ("custom", "smooth_l1", dict(dynamic_loss_decay=0.3, next_latent_loss_weight=2.0)),
])
def test_parity_with_x_transformers(dynamics_type, loss_type, kw):
    xw = _xt_wrapper(dynamics_type, loss_type, **kw)
    sw = next_latent_from_x_transformers(xw)
    x, _ = _batch(6, b=3, n=9, lengths=(9, 6, 5))  # right padding by ignore_index (x-transformers' convention)
    want, want_parts = xw(x, return_loss_breakdown=True)
    got, got_parts = sw(x, return_loss_breakdown=True)
    for name, a, b_ in zip(want_parts._fields, got_parts, want_parts):
        assert abs(a.item() - b_.item()) < 1e-5, name
    assert abs(got.item() - want.item()) < 1e-5
    want.backward()
    got.backward()
    assert_close(sw.net.token_emb.weight.grad, xw.net.token_emb.emb.weight.grad, "token embedding gradient", torch.float32)
    sd = [p.grad for p in sw.dynamics_model.parameters()]
    xd = [p.grad for p in xw.dynamics_model.parameters()]
    for a, b_ in zip(sd, xd):
        assert_close(a, b_, "dynamics gradient", torch.float32)


def test_custom_loss_module_and_residual_dynamics_names():
    loss = MSECosineSimLoss(0.5)
    net = torch.nn.Sequential(torch.nn.Linear(2 * D, D))
    model = NextLatentWrapper(make_net(), dim=D, loss_type=loss, dynamics_type="custom", dynamics_network=ResidualDynamics(net))
    assert model.loss_fn is loss and model.dynamics_model.net is net
    x, _ = _batch(7)
    assert torch.isfinite(model(x))


# ----------------------------------------------------------------------------------------------------
# the door probe (for tests/doors.py) and the clauses run on it here
# ----------------------------------------------------------------------------------------------------


def probe_next_latent(seed: int, value: float):
    """``NextLatentWrapper`` with a cross-attending net, two rollouts and SIGReg: right- or left-padded
    samples (sample 0 fully padded), garbage ids at padded positions (a ``mask`` marks them) and ``value``
    at masked context slots (sample 1's context entirely masked). The output is the loss breakdown
    ``(ce, next_latent, kl, sigreg)``; an all-ignored batch is a loss of 0 with zero gradients."""
    from doors import Probe

    g = torch.Generator().manual_seed(seed)
    b, n, j = 4, 7, 3
    model = make_model(cross=True, num_rollouts=2, sigreg_loss_weight=0.1,
                       sigreg_loss_kwargs=dict(num_slices=8, domain=(-5, 5), num_knots=5)).train()
    lengths = torch.randint(2, n + 1, (b,), generator=g)
    lengths[0], lengths[-1] = 0, n
    mask = sf.padding_mask(lengths, n, left=bool(seed % 2))
    x = torch.randint(0, V, (b, n), generator=g)
    garbage = 0 if value == 0 else 10**6
    x = torch.where(mask, x, torch.full_like(x, garbage))
    ctx_mask = torch.rand(b, j, generator=g) < 0.6
    ctx_mask[1] = False
    ctx_mask[-1] = True
    ctx = torch.randn(b, j, D, generator=g).masked_fill(~ctx_mask[..., None], value).requires_grad_()
    kw = dict(context=ctx, context_mask=ctx_mask)
    _, parts = model(x, True, mask=mask, generator=torch.Generator().manual_seed(seed), **kw)
    out = torch.stack(tuple(parts))  # (4,)

    none = model(x, mask=torch.zeros(b, n, dtype=torch.bool), generator=torch.Generator().manual_seed(seed), **kw)
    grads = torch.autograd.grad(none, [ctx, *model.parameters()], allow_unused=True)
    assert none.item() == 0.0 and all(gr is not None and not bool(gr.any()) for gr in grads), \
        "an all-ignored batch is not a loss of 0 with zero gradients"
    return Probe(out, {"context": ctx}, {"context": ~ctx_mask[..., None].expand_as(ctx)}, bad_calls=[
        ("float ids", lambda: model(x.float()), TypeError, "x"),
        ("int mask", lambda: model(x, mask=mask.int()), TypeError, "mask"),
        ("mask of wrong shape", lambda: model(x, mask=mask[:, 1:]), ValueError, "mask"),
        ("too short for the rollouts", lambda: model(x[:, :3], mask=mask[:, :3]), ValueError, "num_rollouts"),
        ("context of wrong width", lambda: model(x, mask=mask, context=torch.randn(b, j, D + 1)), ValueError, "context"),
        ("dim of another width", lambda: NextLatentWrapper(make_net(), dim=D * 2), ValueError, "dim"),
    ])


def test_door_probe_clauses():
    check_probe(probe_next_latent, has_dead=False)


def test_sigreg_matches_x_transformers_and_runs_in_half_precision():
    pytest.importorskip("x_transformers")
    from x_transformers.next_latent_wrapper import NextLatentWrapper as XN

    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(3)
    want = XN.sigreg_loss(x, num_slices=16)
    torch.manual_seed(3)
    got = NextLatentWrapper.sigreg_loss(x, num_slices=16)
    assert abs(got.item() - want.item()) < 1e-5
    half = make_model(torch.float16, num_rollouts=2, sigreg_loss_weight=0.1,
                      sigreg_loss_kwargs=dict(num_slices=8, domain=(-5, 5), num_knots=5))
    xb, _ = _batch(8)
    loss = half(xb)
    loss.backward()
    assert_finite(loss, "float16 loss")
    for name, p in half.named_parameters():
        assert_finite(p.grad, f"float16 gradient of {name}")
