"""Tests for Transformer-XL memories (``TransformerWrapper(max_mem_len=, shift_mem_down=)``,
``forward(mems=, mem_masks=, return_mems=, detach_mems=)``) and ``safeformer.decoding.xl``:
parity with x-transformers on converted weights (memories over three segments with absolute, rotary and ALiBi
positions; the XL loss, its gradients and sampling, with and without test-time training), the safety
contract (padded memories equal the sample without its padding, NaN at masked memory slots reaches nothing, a
fully padded memory is no memory), and named errors."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_finite
from test_dpo import check_probe

import safeformer as sf
from safeformer.decoding.xl import TTTModuleWrapper, XLAutoregressiveWrapper
from safeformer.interop import from_x_transformers

xt = pytest.importorskip("x_transformers")
from x_transformers.xl_autoregressive_wrapper import XLAutoregressiveWrapper as XtXL  # noqa: E402

V, D = 23, 16
TO_V = "attn_layers.layers.0.1.to_v"


def _close(actual, expected, atol=1e-5, rtol=1e-5):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def xt_pair(seed=0, mem=6, seq=6, use_abs_pos_emb=True, **layer_kw):
    """An x-transformers model and its safeformer conversion (memories set on both after converting)."""
    torch.manual_seed(seed)
    m = xt.TransformerWrapper(num_tokens=V, max_seq_len=seq, use_abs_pos_emb=use_abs_pos_emb,
                              attn_layers=xt.Decoder(dim=D, depth=2, heads=2, attn_dim_head=8, **layer_kw))
    s = from_x_transformers(m)
    m.max_mem_len = s.max_mem_len = mem
    return m, s


def make_net(seed=0, mem=6, seq=6, **kw) -> sf.TransformerWrapper:
    torch.manual_seed(seed)
    return sf.TransformerWrapper(num_tokens=V, max_seq_len=seq, max_mem_len=mem, attn_layers=sf.Decoder(
        dim=D, depth=2, heads=2, dim_head=8, **kw))


@pytest.mark.parametrize("kw", [dict(), dict(rotary_pos_emb=True), dict(alibi_pos_bias=True, use_abs_pos_emb=False)],
                         ids=["abs", "rotary", "alibi"])
def test_memories_match_x_transformers(kw):
    m, s = xt_pair(**kw)
    m.eval(), s.eval()
    g = torch.Generator().manual_seed(0)
    segs = [torch.randint(0, V, (2, n), generator=g) for n in (5, 4, 1)]
    mx = ms = None
    for i, x in enumerate(segs):
        last = i == len(segs) - 1
        if last:  # the intermediates' form
            lx, ix = m(x, mems=mx, return_mems=True, return_intermediates=True)
            ls, is_ = s(x, mems=ms, return_mems=True, return_intermediates=True)
            mx, ms = ix.mems, is_.mems
        else:
            lx, mx = m(x, mems=mx, return_mems=True)
            ls, ms = s(x, mems=ms, return_mems=True)
        _close(ls, lx, atol=1e-5, rtol=1e-5)
        assert len(ms) == len(mx) == 2
        for a, b in zip(ms, mx):
            assert a.shape == b.shape
            _close(a, b, atol=1e-5, rtol=1e-5)
    assert ms[0].shape[1] == 6  # max_mem_len kept
    assert not s(segs[1], mems=ms).allclose(s(segs[1]))  # the memories matter


def test_shift_mem_down_and_gradients_match_x_transformers():
    m, s = xt_pair(rotary_pos_emb=True)
    m.shift_mem_down = s.shift_mem_down = 1
    g = torch.Generator().manual_seed(1)
    x1, x2 = (torch.randint(0, V, (2, 5), generator=g) for _ in range(2))
    _, mx = m(x1, return_mems=True, detach_mems=False)
    _, ms = s(x1, return_mems=True, detach_mems=False)
    lx, ls = m(x2, mems=mx), s(x2, mems=ms)
    _close(ls, lx, atol=1e-5, rtol=1e-5)
    gx = torch.autograd.grad(lx.square().sum(), m.attn_layers.layers[0][1].to_q.weight)[0]
    gs = torch.autograd.grad(ls.square().sum(), s.attn_layers.layers[0][1].to_q.weight)[0]
    _close(gs, gx, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kw", [dict(), dict(rotary_pos_emb=True), dict(alibi_pos_bias=True)], ids=["abs", "rot", "alibi"])
def test_padded_memory_equals_sample_alone(kw):
    net = make_net(mem=10, seq=10, **kw).eval()
    g = torch.Generator().manual_seed(2)
    x1, x2 = torch.randint(0, V, (3, 10), generator=g), torch.randint(0, V, (3, 7), generator=g)
    mask1 = torch.ones(3, 10, dtype=torch.bool)
    mask1[0, 6:] = False  # right padding
    mask1[1] = False  # a fully padded segment
    mask1[2, :3] = False  # left padding
    _, mems = net(x1, mask=mask1, return_mems=True)
    assert torch.equal(mems.masks[0], mask1)
    out = net(x2, mems=mems)
    assert_finite(out, "output")
    for i in (0, 2):
        real = x1[i][mask1[i]][None]
        _, alone = net(real, return_mems=True)
        _close(out[i], net(x2[i:i + 1], mems=alone)[0], atol=1e-5, rtol=1e-5)
    _close(out[1], net(x2[1:2])[0], atol=1e-5, rtol=1e-5)  # a fully padded memory is no memory
    # the next memories keep the padding, then the new segment's
    _, mems2 = net(x2, mems=mems, return_mems=True)
    assert torch.equal(mems2.masks[0], torch.cat((mask1, torch.ones(3, 7, dtype=torch.bool)), 1)[:, -10:])


def test_masked_memory_slots_reach_nothing():
    net = make_net(mem=8, seq=8, rotary_pos_emb=True)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, V, (2, 5), generator=g)
    keep = torch.rand(2, 8, generator=g) < 0.5
    keep[1] = False
    clean = [torch.randn(2, 8, D, generator=g) for _ in range(2)]
    outs, grads = [], []
    for value in (0.0, float("nan"), float("inf")):
        mems = [t.masked_fill(~keep[..., None], value).requires_grad_() for t in clean]
        out = net(x, mems=mems, mem_masks=[keep, keep])
        got = torch.autograd.grad(out.square().sum(), [*mems, net.attn_layers.layers[0][1].to_k.weight])
        assert_finite(out, "output")
        for gr in got:
            assert_finite(gr, "grad")
        assert not bool(got[0][~keep].any()), "a masked memory slot got a gradient"
        outs.append(out.detach())
        grads.append(got)
    for out, got in zip(outs[1:], grads[1:]):
        assert torch.equal(out, outs[0])
        for a, b in zip(got, grads[0]):
            assert torch.equal(a, b)


def test_memory_errors():
    net = make_net()
    x = torch.randint(0, V, (2, 4))
    mems = [torch.randn(2, 3, D)] * 2
    cases = [
        (lambda: net(x, mems=mems[:1]), "mems"),
        (lambda: net(x, mems=[torch.randn(2, 3, D + 1)] * 2), "mems"),
        (lambda: net(x, mem_masks=torch.ones(2, 3, dtype=torch.bool)), "mem_masks"),
        (lambda: net(x, mems=mems, mem_masks=torch.ones(2, 4, dtype=torch.bool)), "mem_masks"),
        (lambda: net(x, mems=mems, return_cache=True), "KV cache"),
        (lambda: net(x, mems=mems, attn_mask=torch.ones(4, 7, dtype=torch.bool)), "attn_mask"),
        (lambda: sf.TransformerWrapper(num_tokens=V, max_seq_len=4, max_mem_len=-1,
                                       attn_layers=sf.Decoder(dim=D, depth=1, heads=2)), "max_mem_len"),
        (lambda: net(x, return_mems=1), "return_mems"),
    ]
    for call, text in cases:
        with pytest.raises((ValueError, TypeError), match=text):
            call()


def _xl_pair(kw, seed=0):
    m, s = xt_pair(seed, mem=8, seq=8, rotary_pos_emb=True)
    torch.manual_seed(seed + 1)
    xw = XtXL(m, **kw)
    torch.manual_seed(seed + 1)
    sw = XLAutoregressiveWrapper(s, **kw)
    if kw.get("ttt_next_latent_loss"):
        sw.ttt_custom_loss_module.load_state_dict(xw.ttt_custom_loss_module.state_dict())
    for path, _ in kw.get("ttt_low_rank_paths", ()):
        sw.ttt_wrappers[path].module.load_state_dict(xw.ttt_wrappers[path].module.state_dict())
    if kw.get("episodic_mem_len"):
        sw.net.episodic_mems.load_state_dict(xw.net.episodic_mems.state_dict())
    return xw, sw


@pytest.mark.parametrize("kw", [
    dict(tbptt_steps=2),
    dict(tbptt_steps=2, ttt_module_paths=(TO_V,), ttt_lr=0.3),
    dict(tbptt_steps=3, ttt_module_paths=(TO_V,), ttt_use_muon=True, ttt_muon_lr=0.3, ttt_next_latent_loss=True),
    dict(tbptt_steps=3, ttt_module_paths=(TO_V, ("attn_layers.layers.3.1.ff.0.0", "attn_layers.layers.1.1.ff.0.0")),
         ttt_low_rank_paths=((TO_V, 4),), ttt_lr=0.3),
    dict(tbptt_steps=2, ttt_module_paths=(TO_V, "episodic_mems"), episodic_mem_len=3, ttt_lr=0.3),
], ids=["xl", "ttt", "muon-latent", "lowrank-ff", "episodic"])
def test_xl_wrapper_matches_x_transformers(kw):
    xw, sw = _xl_pair(kw)
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, V, (2, 26), generator=g)
    lx, ls = xw(x), sw(x)
    _close(ls, lx, atol=1e-5, rtol=1e-5)
    lx.backward()
    ls.backward()
    for name in ("token_emb", "to_logits"):
        gx = getattr(xw.net if not kw.get("episodic_mem_len") else xw.net.net, name)
        gs = getattr(sw.net if not kw.get("episodic_mem_len") else sw.net.net, name)
        gx = gx.emb.weight.grad if name == "token_emb" else gx.weight.grad
        _close(gs.weight.grad, gx, atol=1e-4, rtol=1e-4)
    for plen in (5, 8, 13):  # segment boundaries inside the prompt and while sampling
        assert torch.equal(sw.generate(x[:, :plen], 6, temperature=0.0), xw.generate(x[:, :plen], 6, temperature=0.0))
    full = xw.generate(x[:, :5], 6, temperature=0.0)
    eos = int(full[0, 1])  # stops once both samples sampled it; pad_value after each sample's first eos
    got = sw.generate(x[:, :5], 6, eos_token=eos, temperature=0.0, filter_kwargs={})
    seen = (full == eos).long().cumsum(1)
    if bool((seen > 0).any(1).all()):
        stop = int((seen > 0).long().argmax(1).max()) + 1
        full = full[:, :stop].masked_fill((seen - (full == eos).long())[:, :stop] > 0, sw.pad_value)
    assert torch.equal(got, full)  # (no sample-wide stop: nothing padded, as in x-transformers)


def test_ttt_at_zero_lr_is_the_plain_model():
    base_net = make_net(seq=8, mem=8)
    ttt_net = copy.deepcopy(base_net)
    base = XLAutoregressiveWrapper(base_net, tbptt_steps=4)
    ttt = XLAutoregressiveWrapper(ttt_net, tbptt_steps=4, ttt_module_paths=(TO_V,), ttt_lr=0.0)
    assert isinstance(ttt_net.attn_layers.layers[0][1].to_v, TTTModuleWrapper)
    x = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(5))
    lb, lt = base(x), ttt(x)
    _close(lt, lb, atol=1e-6, rtol=1e-6)
    lb.backward()
    lt.backward()
    for (_n, pb), (_, pt) in zip(base_net.named_parameters(), ttt_net.named_parameters()):
        _close(pt.grad, pb.grad, atol=1e-5, rtol=1e-5)
    TTTModuleWrapper.reset_all(ttt)
    assert all(w.batch_params is None for w in ttt.ttt_wrappers.values())


def test_xl_wrapper_padding_equals_samples_alone():
    net = make_net(seq=6, mem=6, rotary_pos_emb=True)
    wrapper = XLAutoregressiveWrapper(net, tbptt_steps=2, ttt_module_paths=(TO_V,), ttt_lr=0.1).eval()
    g = torch.Generator().manual_seed(6)
    x = torch.randint(0, V, (2, 17), generator=g)
    mask = torch.ones(2, 17, dtype=torch.bool)
    mask[1, 9:] = False
    garbage = torch.where(mask, x, V + 5)  # ids at padded positions are never read
    got = wrapper(garbage, mask=mask)
    # by hand: each sample alone, its segments in order with memories, x-transformers' weighting
    seq_len = 16
    ref0 = wrapper(x[:1])
    wrapper.init_ttt(1)
    mems, total = None, 0.0
    for start in range(0, seq_len, 6):
        chunk, labels = x[1:, start:start + 6], x[1:, start + 1:start + 7]
        real = max(0, min(8, start + 6) - start)  # inputs with a real label: positions < 8
        if real:
            logits, inter = net(chunk[:, :real], mems=mems, return_mems=True, return_intermediates=True)
            loss = torch.nn.functional.cross_entropy(logits[0], labels[0, :real])
            mems = inter.mems
            if start + 6 < seq_len:
                wrapper.update_ttt(logits, labels[:, :real])
        else:
            loss = torch.zeros(())
        total = total + loss * chunk.shape[1] / seq_len
    _close(got, (ref0 + total) / 2, atol=1e-5, rtol=1e-5)


def test_custom_ttt_loss_trains_and_ignores_padding():
    custom = sf.TTTMetaLearningTargetKLLoss(dim=D, num_classes=V, heads=2, dim_head=8)
    wrapper = XLAutoregressiveWrapper(make_net(seq=6, mem=6), tbptt_steps=4, ttt_module_paths=(TO_V,),
                                      ttt_custom_loss_module=custom)
    x = torch.randint(0, V, (2, 15), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(2, 15, dtype=torch.bool)
    mask[0, 8:] = False
    loss = wrapper(torch.where(mask, x, V + 3), mask=mask)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in custom.parameters())
    # the loss per position: masked positions are exactly 0
    _, inter = wrapper.net(x[:, :6], return_intermediates=True)
    m = mask[:, :6].clone()
    m[1, 2:] = False
    per = custom(inter, mask=m)
    assert per.shape == (2, 6) and not bool(per[~m].any())
    latent = sf.TTTNextLatentPredictionLoss(dim=D)
    assert not bool(latent(inter, mask=m)[~torch.cat((m[:, 1:], m[:, :1]), 1)].any())


def test_fast_weights_never_run_on_packed_tokens():
    """With fast weights the stack keeps the padded path (per-sample weights on packed tokens would mix samples):
    a padded sample equals the sample alone under its own fast weights."""
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=8, attn_layers=sf.Decoder(dim=D, depth=1, heads=2,
                                                                                   unpadded=True))
    w = XLAutoregressiveWrapper(net, tbptt_steps=2, ttt_module_paths=(TO_V,))
    x = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(8))
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 3:] = False
    wrapper = w.ttt_wrappers[TO_V]
    w.init_ttt(2)
    fast = {k: v + 0.1 * torch.randn(v.shape, generator=torch.Generator().manual_seed(9)) for k, v in
            wrapper.batch_params.items()}
    wrapper.batch_params = fast
    out = net(x, mask=mask)
    wrapper.batch_params = {k: v[:1] for k, v in fast.items()}
    _close(out[0, :3], net(x[:1, :3])[0])


def test_ttt_paths_and_errors():
    net = make_net()
    with pytest.raises(ValueError, match="has no submodule '4'"):
        XLAutoregressiveWrapper(net, tbptt_steps=2, ttt_module_paths=("attn_layers.layers.1.1.ff.4",))
    with pytest.raises(ValueError, match="no submodule"):
        XLAutoregressiveWrapper(make_net(), tbptt_steps=2, ttt_module_paths=("attn_layers.layers.9.1.to_v",))
    with pytest.raises(ValueError, match="tbptt_steps"):
        XLAutoregressiveWrapper(make_net(), tbptt_steps=1, ttt_module_paths=(TO_V,))
    w = XLAutoregressiveWrapper(make_net(), tbptt_steps=2)
    with pytest.raises(ValueError, match="ttt_recurrent_steps"):
        w(torch.randint(0, V, (1, 9)), ttt_recurrent_steps=2)
    with pytest.raises(ValueError, match="mask"):
        w.generate(torch.randint(0, V, (1, 3)), 2, mask=torch.ones(1, 3, dtype=torch.bool))


def probe_xl(seed: int, value: float):
    """``XLAutoregressiveWrapper`` with test-time training, a padded batch (sample 0's later segments padded, garbage
    ids there) and initial memories with ``value`` at masked slots (sample 1's memory entirely masked)."""
    from doors import Probe

    g = torch.Generator().manual_seed(seed)
    net = make_net(seq=5, mem=5, rotary_pos_emb=True)
    wrapper = XLAutoregressiveWrapper(net, tbptt_steps=2, ttt_module_paths=(TO_V,), ttt_lr=0.1)
    b, n, m = 3, 13, 4
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, 4 + seed % 3:] = False
    x = torch.where(mask, torch.randint(0, V, (b, n), generator=g), 0 if value == 0 else V + 7)
    keep = torch.rand(b, m, generator=g) < 0.6
    keep[1] = False
    keep[2] = True
    mems = sf.Mems(torch.randn(b, m, D, generator=g).masked_fill(~keep[..., None], value).requires_grad_()
                   for _ in range(2))
    mems.masks = [keep, keep]
    out = wrapper(x, mems=mems, mask=mask)
    masked = ~keep[..., None].expand(b, m, D)
    return Probe(out, {f"mems[{i}]": t for i, t in enumerate(mems)}, {f"mems[{i}]": masked for i in range(2)}, bad_calls=[
        ("int mask", lambda: wrapper(x, mask=mask.int()), TypeError, "mask"),
        ("mem_masks of wrong shape", lambda: net(x[:, :5], mems=list(mems), mem_masks=keep[:, 1:]), ValueError,
         "mem_masks"),
    ])


def test_door_probe_clauses():
    check_probe(probe_xl, has_dead=False, seeds=(0, 1))


def test_per_block_memory_masks_equal_in_value_are_one_mask():
    """``mem_masks`` given per block as equal but distinct tensors are the same masks as one tensor given for every
    block: with a relative position bias (which refuses masks that really differ per block) they run, with the
    same output."""
    net = make_net(mem=4, seq=8, rel_pos_bias=True)
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, V, (2, 5), generator=g)
    keep = torch.rand(2, 4, generator=g) < 0.5
    mems = [torch.randn(2, 4, D, generator=g) for _ in range(2)]
    with torch.no_grad():
        assert torch.equal(net(x, mems=mems, mem_masks=[keep, keep.clone()]), net(x, mems=mems, mem_masks=keep))
        other = keep.clone()
        other[0, 0] = ~other[0, 0]
        with pytest.raises(ValueError, match="differ per block"):
            net(x, mems=mems, mem_masks=[keep, other])
