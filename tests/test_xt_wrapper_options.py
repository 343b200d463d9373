"""x-transformers' wrapper-level options in safeformer: ``ContinuousTransformerWrapper(probabilistic=,
project_in=, project_out=)``, ``ContinuousAutoregressiveWrapper`` on such a net (and ``rollout_steps``),
``TransformerWrapper(token_emb=, to_logits=, squeeze_out_last_dim=, mixture_of_softmax=,
add_continuous_pred_head=, recycling=, input_not_include_cache=)`` and
``NonAutoregressiveWrapper(use_simple_mdlm_loss_weight=)``.

Each option: its meaning (float64 formula, or x-transformers' own wrapper code run on the safeformer net),
the contract (garbage at padded positions reaches no output and no gradient, an all-padding batch gives a
finite loss with zero gradients) and named errors.

Shape legend: b batch, n positions, d features, c model width, v vocabulary.
"""

from __future__ import annotations

import math

import helpers as hp
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import safeformer as sf
from safeformer.decoding.nonautoregressive import SCHEDULES, mdlm_loss_weight

NAN = float("nan")
C, D = 16, 3


@pytest.fixture(autouse=True)
def _one_thread():
    with hp.single_thread():
        yield


def _cont_net(prob=True, dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    net = sf.ContinuousTransformerWrapper(dim_in=D, dim_out=D, max_seq_len=32, probabilistic=prob,
                                          attn_layers=sf.Decoder(dim=C, depth=2, heads=2), **kw)
    return net.to(dtype)


def _grads(model):
    return {k: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for k, p in model.named_parameters()}


def _zero_grads(model):
    for p in model.parameters():
        p.grad = None


# ---------------------------------------------------------------------------------------------------
# ContinuousTransformerWrapper(probabilistic=True)
# ---------------------------------------------------------------------------------------------------


def test_probabilistic_output_is_xt_formula():
    """``stack((mean, exp(log_var)))`` with x-transformers' interleaved layout (its rearrange, in plain code)."""
    net = _cont_net()
    x = torch.randn(2, 7, D, dtype=torch.float64)
    out = net(x)
    assert out.shape == (2, 2, 7, D)
    raw = net.project_out(net(x, return_embeddings=True))  # (b, n, 2 d)
    # x-transformers: rearrange(out, '... (d mean_log_var) -> mean_log_var ... d', mean_log_var=2)
    mean, log_var = raw.reshape(2, 7, D, 2).permute(3, 0, 1, 2)
    hp.assert_close(out, torch.stack((mean, log_var.exp())), what="probabilistic output")


def test_probabilistic_variance_finite_and_padding_ignored():
    net = _cont_net(dtype=torch.float32)
    with torch.no_grad():
        net.project_out.weight.mul_(1e4)  # log-variances far beyond log(float32 max)
    x = torch.randn(2, 6, D)
    mask = hp.mask_from_lengths([6, 3], 6)
    clean = torch.where(mask[..., None], x, 0.0).requires_grad_(True)
    dirty = torch.where(mask[..., None], x, NAN).requires_grad_(True)
    outs = []
    for inp in (clean, dirty):
        _zero_grads(net)
        out = net(inp, mask=mask)
        hp.assert_finite(out, "output")
        out[:, mask].sum().backward()
        outs.append((out, _grads(net), inp.grad))
    hp.assert_bitwise(outs[0][0][:, mask], outs[1][0][:, mask], "real outputs")
    for k in outs[0][1]:
        hp.assert_finite(outs[1][1][k], k)
        hp.assert_bitwise(outs[0][1][k], outs[1][1][k], k)
    hp.assert_zero(outs[1][2][~mask], "gradient at padded inputs")


def test_probabilistic_errors():
    layers = sf.Decoder(dim=C, depth=1, heads=2)
    with pytest.raises(ValueError, match="dim_out"):
        sf.ContinuousTransformerWrapper(dim_in=D, probabilistic=True, attn_layers=layers)
    with pytest.raises(TypeError, match="probabilistic"):
        sf.ContinuousTransformerWrapper(dim_in=D, dim_out=D, probabilistic=1, attn_layers=layers)
    net = _cont_net()
    with pytest.raises(ValueError, match="probabilistic"):
        sf.ContinuousAutoregressiveWrapper(net, probabilistic=True)
    net = sf.ContinuousTransformerWrapper(dim_in=D, dim_out=D + 1, probabilistic=True, attn_layers=layers)
    with pytest.raises(ValueError, match="dim_out"):
        sf.ContinuousAutoregressiveWrapper(net)


def test_external_projections():
    """x-transformers' ``project_in`` / ``project_out`` modules (widths read from an ``nn.Linear``)."""
    torch.manual_seed(0)
    pin, pout = nn.Linear(5, C, bias=False), nn.Linear(C, 4, bias=False)
    net = sf.ContinuousTransformerWrapper(project_in=pin, project_out=pout,
                                          attn_layers=sf.AttentionLayers(dim=C, depth=1, heads=2))
    x = torch.randn(2, 6, 5)
    assert net(x).shape == (2, 6, 4)
    hp.assert_close(net(x), pout(net(x, return_embeddings=True)), what="project_out")
    assert net.project_in is pin and net.dim_in == 5
    with pytest.raises(ValueError, match="dim_in"):
        sf.ContinuousTransformerWrapper(project_in=nn.Sequential(nn.Linear(5, C)), attn_layers=sf.Decoder(dim=C, depth=1))
    with pytest.raises(TypeError, match="project_in"):
        sf.ContinuousTransformerWrapper(project_in=lambda t: t, dim_in=5, attn_layers=sf.Decoder(dim=C, depth=1))


# ---------------------------------------------------------------------------------------------------
# ContinuousAutoregressiveWrapper on a probabilistic net: x-transformers' wrapper on the same net
# ---------------------------------------------------------------------------------------------------


def _xt_continuous():
    return pytest.importorskip("x_transformers.continuous")


@pytest.mark.parametrize("prob", [False, True])
def test_loss_equals_xt_wrapper_on_same_net(prob):
    xtc = _xt_continuous()
    net = _cont_net(prob=prob)
    ours, theirs = sf.ContinuousAutoregressiveWrapper(net), xtc.ContinuousAutoregressiveWrapper(net)
    x = torch.randn(2, 9, D, dtype=torch.float64)
    hp.assert_close(ours(x), theirs(x).to(torch.float64), what="loss")
    if prob:  # and the formula: F.gaussian_nll_loss(mean, target, var) (eps 1e-6), mean over features
        mean, var = net(x[:, :-1])
        hp.assert_close(ours(x), F.gaussian_nll_loss(mean, x[:, 1:], var, reduction="none").mean(), what="nll")


@pytest.mark.parametrize("prob", [False, True])
@pytest.mark.parametrize("cache_kv", [False, True])
def test_generate_equals_xt_wrapper(prob, cache_kv):
    """Greedy (temperature 0: the mean) generation equals x-transformers' loop over the same net."""
    xtc = _xt_continuous()
    net = _cont_net(prob=prob)
    start = torch.randn(2, 3, D, dtype=torch.float64)
    ours = sf.ContinuousAutoregressiveWrapper(net).generate(start, 5, cache_kv=cache_kv, temperature=0.0)
    theirs = xtc.ContinuousAutoregressiveWrapper(net).generate(start, 5, cache_kv=cache_kv, temperature=0.0)
    hp.assert_close(ours, theirs, what="generated")


def test_probabilistic_loss_contract():
    net = _cont_net(dtype=torch.float32)
    model = sf.ContinuousAutoregressiveWrapper(net)
    x = torch.randn(3, 8, D)
    mask = hp.mask_from_lengths([8, 5, 2], 8, left=True)
    results = []
    for fill in (0.0, NAN):
        _zero_grads(model)
        loss = model(torch.where(mask[..., None], x, fill), mask=mask)
        loss.backward()
        results.append((loss.detach(), _grads(model)))
    hp.assert_bitwise(results[0][0], results[1][0], "loss")
    for k in results[0][1]:
        hp.assert_bitwise(results[0][1][k], results[1][1][k], k)
    _zero_grads(model)
    empty = torch.zeros(3, 8, dtype=torch.bool)
    loss = model(torch.full_like(x, NAN), mask=empty)
    loss.backward()
    assert float(loss.detach()) == 0.0
    for k, g in _grads(model).items():
        hp.assert_zero(g, k)


def test_probabilistic_sampling_is_xt_formula():
    """``mean + sqrt(max(var, 1e-5)) * temperature * noise`` (x-transformers' sample_from_mean_variance)."""
    model = sf.ContinuousAutoregressiveWrapper(_cont_net())
    mean = torch.randn(2, D, dtype=torch.float64)
    log_var = torch.tensor([-30.0, 0.0, 2.0], dtype=torch.float64).expand(2, D)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    got = model._draw(mean, log_var, 0.5, g1)
    noise = torch.randn(mean.shape, generator=g2, dtype=torch.float64)
    hp.assert_close(got, mean + log_var.exp().clamp(min=1e-5).sqrt() * 0.5 * noise, what="sample")


# ---------------------------------------------------------------------------------------------------
# rollout_steps
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prob", [False, True])
def test_rollout_formula(prob):
    """A sample of ``k + 1`` real steps has one cut (1): predictions fed back from the first step."""
    net = _cont_net(prob=prob).eval()
    model = sf.ContinuousAutoregressiveWrapper(net)
    k = 3
    x = torch.randn(1, k + 1, D, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    loss = model(x, rollout_steps=k, generator=g)
    g = torch.Generator().manual_seed(0)
    torch.rand(1, generator=g)  # the cut's draw
    seq, terms = x[:, :1], []
    for t in range(k):
        raw = net(seq, return_embeddings=True)[:, -1]
        raw = net.project_out(raw)
        if prob:
            mean, lv = raw.reshape(1, D, 2).unbind(-1)
            lv = lv.clamp(min=math.log(1e-6))
            terms.append((0.5 * (lv + (x[:, t + 1] - mean) ** 2 * torch.exp(-lv))).mean())
            nxt = mean + torch.exp(0.5 * lv.clamp(min=math.log(1e-5))) * torch.randn(mean.shape, generator=g, dtype=mean.dtype)
        else:
            terms.append(((raw - x[:, t + 1]) ** 2).mean())
            nxt = raw
        seq = torch.cat((seq, nxt[:, None]), 1)
    hp.assert_close(loss, torch.stack(terms).mean(), what="rollout loss")


def test_rollout_contract_and_errors():
    net = _cont_net(prob=False, dtype=torch.float32)
    model = sf.ContinuousAutoregressiveWrapper(net)
    x = torch.randn(3, 9, D)
    mask = hp.mask_from_lengths([9, 6, 2], 9, left=True)  # sample 2: too short for 3 steps
    results = []
    for fill in (0.0, NAN):
        _zero_grads(model)
        loss = model(torch.where(mask[..., None], x, fill), mask=mask, rollout_steps=3,
                     generator=torch.Generator().manual_seed(3), reduction="none")
        assert loss.shape == (3, 3)
        hp.assert_zero(loss[2], "too-short sample")
        loss.sum().backward()
        results.append((loss.detach(), _grads(model)))
    hp.assert_bitwise(results[0][0], results[1][0], "rollout loss")
    for k in results[0][1]:
        hp.assert_bitwise(results[0][1][k], results[1][1][k], k)
    _zero_grads(model)
    loss = model(x, mask=hp.mask_from_lengths([2, 3, 1], 9), rollout_steps=3)
    loss.backward()
    assert float(loss.detach()) == 0.0
    for k, g in _grads(model).items():
        hp.assert_zero(g, k)
    with pytest.raises(ValueError, match="rollout_steps"):
        model(x, rollout_steps=0)


# ---------------------------------------------------------------------------------------------------
# TransformerWrapper: token_emb, to_logits, squeeze_out_last_dim, mixture_of_softmax, ...
# ---------------------------------------------------------------------------------------------------

V = 23


def _tok_net(seed=0, layers=None, **kw):
    torch.manual_seed(seed)
    layers = layers or sf.Decoder(dim=C, depth=2, heads=2)
    return sf.TransformerWrapper(num_tokens=V, max_seq_len=32, attn_layers=layers, **kw).double()


class _TwoEmbed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Embedding(V, C), nn.Embedding(V, C)

    def forward(self, x, y):
        return self.a(x) + self.b(y)


class _Pointer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(C, C)

    def forward(self, h, input_embeddings):
        return self.proj(h) @ input_embeddings.transpose(1, 2)


def test_custom_token_emb_and_to_logits_equal_builtin():
    base = _tok_net()
    emb, head = nn.Embedding(V, C).double(), nn.Linear(C, V, bias=False).double()
    emb.weight.data.copy_(base.token_emb.weight)
    head.weight.data.copy_(base.to_logits.weight)
    custom = _tok_net(token_emb=emb, to_logits=head)
    custom.load_state_dict({k.replace("token_emb.emb.", "token_emb."): v for k, v in base.state_dict().items()})
    x = torch.randint(0, V, (2, 7))
    mask = hp.mask_from_lengths([7, 4], 7, left=True)
    out, ref = custom(x, mask=mask), base(x, mask=mask)
    hp.assert_close(out[mask], ref[mask], what="custom modules")
    hp.assert_zero(out[~mask], "padded logits")


def test_custom_modules_with_kwargs_and_padding():
    model = _tok_net(token_emb=_TwoEmbed().double(), to_logits=_Pointer().double())
    x = torch.randint(0, V, (2, 6))
    y = torch.randint(0, V, (2, 6))
    table = torch.randn(2, V, C, dtype=torch.float64)
    mask = hp.mask_from_lengths([6, 3], 6)
    out = model(x, mask=mask, token_emb_kwargs=dict(y=y), to_logits_kwargs=dict(input_embeddings=table))
    assert out.shape == (2, 6, V)
    hp.assert_zero(out[~mask], "padded logits")
    h = model(x, mask=mask, token_emb_kwargs=dict(y=y), return_embeddings=True)
    hp.assert_close(out[mask], model.to_logits(h, table)[mask], what="pointer head")
    with pytest.raises(ValueError, match="token_emb_kwargs"):
        _tok_net()(x, token_emb_kwargs=dict(y=y))
    with pytest.raises(ValueError, match="tie_embedding"):
        _tok_net(token_emb=_TwoEmbed(), tie_embedding=True)
    with pytest.raises(TypeError, match="to_logits"):
        _tok_net(to_logits=lambda h: h)
    bad = _tok_net(token_emb=nn.Linear(1, 1))
    with pytest.raises((ValueError, RuntimeError)):
        bad(x)


def test_squeeze_out_last_dim():
    model = _tok_net(layers=sf.Encoder(dim=C, depth=1, heads=2), logits_dim=1, average_pool_embed=True,
                     squeeze_out_last_dim=True)
    x = torch.randint(0, V, (2, 6))
    mask = hp.mask_from_lengths([6, 0], 6)
    out = model(x, mask=mask)
    assert out.shape == (2,)
    hp.assert_finite(out)
    model = _tok_net(logits_dim=1, squeeze_out_last_dim=True)
    assert model(x).shape == (2, 6)


def test_mixture_of_softmax_formula():
    """x-transformers' formula: log(sum_k pi_k softmax(W to_mixture(h)_k)), pi = softmax(combine(h))."""
    model = _tok_net(mixture_of_softmax=True, mixture_of_softmax_k=3)
    assert model.output_is_log_prob
    x = torch.randint(0, V, (2, 6))
    mask = hp.mask_from_lengths([6, 2], 6, left=True)
    out = model(x, mask=mask)
    h = model(x, mask=mask, return_embeddings=True)
    pi = model.combine_mixture(h).softmax(-1)
    parts = model.to_mixture(h).reshape(2, 6, 3, C)
    ref = torch.einsum("bnkv,bnk->bnv", model.to_logits(parts).softmax(-1), pi).log()
    hp.assert_close(out[mask], ref[mask], what="mixture of softmaxes")
    hp.assert_close(out[mask].exp().sum(-1), torch.ones(int(mask.sum()), dtype=torch.float64), what="probabilities")
    hp.assert_zero(out[~mask], "padded rows")
    with torch.no_grad():
        model.to_logits.weight.mul_(1e4)  # one softmax term underflows: still finite
    hp.assert_finite(model(x, mask=mask), "log-probabilities")


def test_continuous_pred_head():
    model = _tok_net(add_continuous_pred_head=True)
    x = torch.randint(0, V, (2, 6))
    mask = hp.mask_from_lengths([6, 4], 6, left=True)
    logits, (pred, init) = model(x, mask=mask, return_next_embed_pred=True)
    hp.assert_close(logits, model(x, mask=mask), what="logits")
    h = model(x, mask=mask, return_embeddings=True)
    hp.assert_close(pred, model.to_next_embed_pred(h), what="next-embedding prediction")
    pos = sf.nn.modules.positions_from_mask(mask, 6, x.device)
    ref = model.token_emb(x) + model.pos_emb.embed_positions(pos)
    hp.assert_close(init[mask], ref[mask], what="initial embeddings")
    with pytest.raises(ValueError, match="add_continuous_pred_head"):
        _tok_net()(x, return_next_embed_pred=True)


def test_recycling():
    model = _tok_net(recycling=True, train_max_recycle_steps=3)
    plain = _tok_net()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("recycled_proj")})
    x = torch.randint(0, V, (2, 6))
    mask = hp.mask_from_lengths([6, 3], 6, left=True)
    model.eval()
    hp.assert_close(model(x, mask=mask, recycle_steps=1)[mask], plain(x, mask=mask)[mask], what="one step")
    # two steps: the stack on the embeddings plus recycled_proj of the first run's output
    h1 = plain(x, mask=mask, return_embeddings=True)
    extra = model.recycled_proj(h1)  # enters with the embeddings: a prefix of embeddings would not do; check by hooks
    seen = []
    handle = model.attn_layers.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    out = model(x, mask=mask, recycle_steps=2)
    handle.remove()
    hp.assert_close(seen[1][mask], (seen[0] + extra)[mask], what="recycled input")
    hp.assert_finite(out)
    with pytest.raises(ValueError, match="recycle_steps"):
        model(x)
    model.train()
    out = model(torch.randint(0, V, (2, 6)), recycle_steps=3)
    out.sum().backward()
    assert model.recycled_proj.weight.grad is not None


def test_input_not_include_cache_and_seq_start_pos():
    """x-transformers' test_seq_start_pos_parity and its pieces: only new positions in with the cache."""
    model = _tok_net(input_not_include_cache=True).eval()
    x = torch.randint(0, V, (2, 10))
    start = torch.tensor([5, 0])
    full = model(x, seq_start_pos=start)
    outs, cache = [], None
    for i in range(10):
        out, cache = model(x[:, i:i + 1], cache=cache, seq_start_pos=start, return_intermediates=True)
        outs.append(out)
    seq = torch.cat(outs, 1)
    keep = torch.arange(10)[None] >= start[:, None]
    hp.assert_close(seq[keep], full[keep], what="step by step")
    a, cache = model(x[:, :4], return_intermediates=True)
    b, cache = model(x[:, 4:7], cache=cache, return_intermediates=True)
    hp.assert_close(torch.cat((a, b), 1), model(x[:, :7]), what="pieces")
    with pytest.raises(TypeError, match="input_not_include_cache"):
        model(x, input_not_include_cache=1)


# ---------------------------------------------------------------------------------------------------
# NonAutoregressiveWrapper(use_simple_mdlm_loss_weight=)
# ---------------------------------------------------------------------------------------------------


def test_mdlm_weight_formula():
    r = torch.tensor([0.05, 0.3, 0.7, 0.99], dtype=torch.float64)
    hp.assert_close(mdlm_loss_weight(SCHEDULES["linear"], r), 1 / (1 - r), what="linear")
    hp.assert_close(mdlm_loss_weight(SCHEDULES["cosine"], r), math.pi / 2 * torch.tan(math.pi * r / 2), what="cosine")
    w = mdlm_loss_weight(lambda t: (1 - t) ** 2, torch.tensor([1.0], dtype=torch.float64))
    hp.assert_finite(w)
    assert float(w) == 1e6


def test_mdlm_weighted_loss():
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=16, attn_layers=sf.Encoder(dim=C, depth=1, heads=2)).double()
    model = sf.NonAutoregressiveWrapper(net, mask_id=V - 1, schedule="linear", use_simple_mdlm_loss_weight=True)
    x = torch.randint(0, V - 1, (3, 8))
    mask = hp.mask_from_lengths([8, 5, 0], 8)
    loss = model(x, mask=mask, generator=torch.Generator().manual_seed(2)).loss
    inp, hidden, r = model._hide(x, mask, torch.Generator().manual_seed(2))
    logits = net(inp, mask=mask)
    ce = F.cross_entropy(logits.transpose(1, 2), x, reduction="none") / (1 - r)[:, None]
    hp.assert_close(loss, ce[hidden].mean(), what="weighted loss")
    _zero_grads(model)
    loss = model(x, mask=torch.zeros(3, 8, dtype=torch.bool)).loss
    loss.backward()
    assert float(loss.detach()) == 0.0
    for k, g in _grads(model).items():
        hp.assert_zero(g, k)
    with pytest.raises(TypeError, match="use_simple_mdlm_loss_weight"):
        sf.NonAutoregressiveWrapper(net, mask_id=V - 1, use_simple_mdlm_loss_weight=1)


# ---------------------------------------------------------------------------------------------------
# conversion helpers (for from_x_transformers) and the next-embedding loss
# ---------------------------------------------------------------------------------------------------


def test_xt_option_conversion_and_mixture_parity():
    """x-transformers' own mixture-of-softmax head (its modules, its code) on the same hidden states."""
    xt = pytest.importorskip("x_transformers")
    from safeformer.stack.wrappers import copy_xt_wrapper_option_weights, xt_wrapper_option_kwargs

    torch.manual_seed(0)
    theirs = xt.TransformerWrapper(num_tokens=V, max_seq_len=32, mixture_of_softmax=True, mixture_of_softmax_k=3,
                                   recycling=True, train_max_recycle_steps=2, add_continuous_pred_head=True,
                                   attn_layers=xt.Decoder(dim=C, depth=1, heads=2)).double()
    kw = xt_wrapper_option_kwargs(theirs)
    assert kw == dict(mixture_of_softmax=True, mixture_of_softmax_k=3, recycling=True, train_max_recycle_steps=2,
                      add_continuous_pred_head=True)
    ours = _tok_net(**kw)
    copy_xt_wrapper_option_weights(ours, theirs)
    ours.to_logits.weight.data.copy_(theirs.to_logits.weight)
    for key in ("to_mixture.0.weight", "combine_mixture.weight", "recycled_proj.weight", "to_next_embed_pred.2.weight"):
        hp.assert_bitwise(ours.state_dict()[key], theirs.state_dict()[key], key)
    h = torch.randn(2, 5, C, dtype=torch.float64)
    combine = theirs.combine_mixture(h).softmax(dim=-1)
    prob = theirs.to_logits(theirs.to_mixture(h)).softmax(dim=-1)
    ref = torch.einsum("...kd,...k->...d", prob, combine).log()
    hp.assert_close(ours._head(h), ref, what="mixture head")


def test_next_embed_loss():
    from safeformer.core.losses import next_embed_loss

    pred = torch.randn(2, 6, C, dtype=torch.float64, requires_grad=True)
    init = torch.randn(2, 6, C, dtype=torch.float64)
    counted = torch.ones(2, 5, dtype=torch.bool)
    # x-transformers: F.l1_loss(pred[:, :-1], init[:, 1:].detach(), reduction='none')[mask].mean()
    hp.assert_close(next_embed_loss(pred, init, counted), F.l1_loss(pred[:, :-1], init[:, 1:]), what="l1")
    counted = hp.mask_from_lengths([5, 2], 5)
    dirty_pred = torch.where(torch.cat((counted, counted[:, :1]), 1)[..., None], pred, NAN)
    loss = next_embed_loss(dirty_pred, torch.where(torch.cat((counted[:, :1], counted), 1)[..., None], init, NAN), counted)
    ref = F.l1_loss(pred[:, :-1], init[:, 1:], reduction="none").mean(-1)[counted].mean()
    hp.assert_close(loss, ref, what="masked l1")
    loss = next_embed_loss(pred, init, torch.zeros(2, 5, dtype=torch.bool))
    (g,) = torch.autograd.grad(loss, pred)
    assert float(loss.detach()) == 0.0
    hp.assert_zero(g, "gradient")
    with pytest.raises(ValueError, match="counted"):
        next_embed_loss(pred, init, torch.ones(2, 6, dtype=torch.bool))


@pytest.mark.parametrize("l1", [False, True])
def test_equal_loss_weight_batch_and_l1_equal_xt_wrapper(l1):
    """x-transformers' wrapper on the same net, left padding (where both count the same targets)."""
    xtc = _xt_continuous()
    net = _cont_net(prob=False)
    ours = sf.ContinuousAutoregressiveWrapper(net, use_l1_loss=l1, equal_loss_weight_batch=True)
    theirs = xtc.ContinuousAutoregressiveWrapper(net, use_l1_loss=l1, equal_loss_weight_batch=True)
    x = torch.randn(3, 9, D, dtype=torch.float64)
    mask = hp.mask_from_lengths([9, 5, 1], 9, left=True)
    hp.assert_close(ours(x, mask=mask), theirs(x, mask=mask).to(torch.float64), what="per-sample weighted loss")
    assert ours.loss == ("l1" if l1 else "mse")
    loss = ours(torch.where(mask[..., None], x, NAN), mask=mask)
    hp.assert_close(loss, theirs(x, mask=mask).to(torch.float64), what="garbage at padding")
    with pytest.raises(TypeError, match="equal_loss_weight_batch"):
        sf.ContinuousAutoregressiveWrapper(net, equal_loss_weight_batch=1)


@pytest.mark.parametrize("prob", [False, True])
def test_continuous_conversion_parity(prob):
    """x-transformers' ContinuousTransformerWrapper (probabilistic or not) and safeformer's built from
    ``xt_continuous_wrapper_kwargs`` (the stack converted through a TransformerWrapper sharing it): equal."""
    xt = pytest.importorskip("x_transformers")
    xtc = _xt_continuous()
    from safeformer.stack.wrappers import copy_xt_continuous_projections, xt_continuous_wrapper_kwargs

    torch.manual_seed(0)
    theirs = xtc.ContinuousTransformerWrapper(dim_in=D, dim_out=D, max_seq_len=16, probabilistic=prob,
                                              attn_layers=xt.Decoder(dim=C, depth=2, heads=2)).double().eval()
    carrier = xt.TransformerWrapper(num_tokens=2, max_seq_len=16, attn_layers=theirs.attn_layers).double().eval()
    layers = sf.from_x_transformers(carrier).attn_layers
    ours = sf.ContinuousTransformerWrapper(attn_layers=layers, **xt_continuous_wrapper_kwargs(theirs)).double().eval()
    copy_xt_continuous_projections(ours, theirs)
    x = torch.randn(2, 7, D, dtype=torch.float64)
    out, ref = ours(x), theirs(x)
    assert out.shape == ref.shape
    # float32's tolerance: the converted stack's norms differ from x-transformers' by their epsilon (interop.py)
    hp.assert_close(out, ref, what="continuous wrapper", dtype=torch.float32)


def test_gaussian_head_finite_in_half_precision():
    from safeformer.stack.wrappers import gaussian_head

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        raw = torch.tensor([[0.0, 1e4, 0.0, -1e4]], dtype=dtype)
        out = gaussian_head(raw)
        hp.assert_finite(out, f"{dtype} variance")
        assert out.shape == (2, 1, 2)


def test_custom_modules_have_no_config(tmp_path):
    model = _tok_net(token_emb=nn.Embedding(V, C))
    with pytest.raises(ValueError, match="custom token_emb"):
        model.save_pretrained(tmp_path)
    net = sf.ContinuousTransformerWrapper(project_in=nn.Linear(4, C), attn_layers=sf.Decoder(dim=C, depth=1))
    with pytest.raises(ValueError, match="custom project_in"):
        net.get_config()
    saved = _cont_net()  # probabilistic: an ordinary option, saved and rebuilt
    saved.save_pretrained(tmp_path / "p")
    again = sf.ContinuousTransformerWrapper.from_pretrained(tmp_path / "p").double()
    x = torch.randn(1, 4, D, dtype=torch.float64)
    hp.assert_bitwise(again(x), saved(x), "reloaded probabilistic net")
