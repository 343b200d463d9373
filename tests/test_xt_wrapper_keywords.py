"""x-transformers' wrapper keywords ``TransformerWrapper(emb_frac_gradient=)``,
``ContinuousTransformerWrapper(post_emb_norm=)`` and ``ContinuousTransformerWrapper(max_mem_len=)`` with its forward's
``mems`` / ``mem_masks`` / ``return_mems``.

Each: parity with x-transformers built with the same keyword call (strict state-dict loads both ways, parameters
moved off their init; outputs at real positions of a right-padded batch and gradients), NaN planted in padded input
slots reaching no output or gradient (a padded sample equals itself alone), named errors, the config round trip
(``get_config``, ``save_pretrained`` / ``from_pretrained``) and, where generation runs, cached == uncached.

Shape legend: b batch, n positions, d input features, c model width, v vocabulary.
"""

from __future__ import annotations

import helpers as hp
import pytest
import torch

import safeformer as sf

xt = pytest.importorskip("x_transformers")

NAN = float("nan")
V, C, D, N = 13, 16, 3, 6
TOL = dict(atol=1e-5, rtol=1e-5)
GRAD_TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(autouse=True)
def _one_thread():
    with hp.single_thread():
        yield


def _pair(xt_cls, sf_cls, layer_kw: dict | None = None, seed: int = 0, **kw):
    """The x-transformers model and the safeformer one from the same keyword call, x-transformers' parameters moved
    off their init and loaded into safeformer's strictly (and back)."""
    layer_kw = dict(dim=C, depth=2, heads=2, attn_dim_head=8, **(layer_kw or {}))
    torch.manual_seed(seed)
    theirs = xt_cls(attn_layers=xt.Decoder(**layer_kw), **kw)
    ours = sf_cls(attn_layers=sf.Decoder(**layer_kw), **kw)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.2 * torch.randn_like(p))
    ours.load_state_dict(theirs.state_dict(), strict=True)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return theirs.eval(), ours.eval()


def _right_padded(lengths=(N, 4, 2)):
    return torch.arange(N)[None] < torch.tensor(lengths)[:, None]


def _ids(b=3, seed=1):
    return torch.randint(0, V, (b, N), generator=torch.Generator().manual_seed(seed))


def _vectors(b=3, n=N, seed=1):
    return torch.randn(b, n, D, generator=torch.Generator().manual_seed(seed))


def _close(actual, expected, what, tol=TOL):
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------------------
# TransformerWrapper(emb_frac_gradient=)
# ---------------------------------------------------------------------------------------------------

FRAC_CASES = {
    "plain": dict(),
    "post_emb_norm": dict(post_emb_norm=True),
    "emb_dim": dict(emb_dim=8),
    "recycling": dict(recycling=True, post_emb_norm=True),
    "interspersed": dict(num_memory_tokens=2, memory_tokens_interspersed_every=3, post_emb_norm=True),
}


@pytest.mark.parametrize("case", list(FRAC_CASES))
def test_emb_frac_gradient_matches_x_transformers(case):
    kw = dict(num_tokens=V, max_seq_len=N, emb_frac_gradient=0.25, **FRAC_CASES[case])
    theirs, ours = _pair(xt.TransformerWrapper, sf.TransformerWrapper, **kw)
    assert ours.emb_frac_gradient == 0.25 and ours.get_config()["emb_frac_gradient"] == 0.25
    ids, mask = _ids(), _right_padded()
    call = dict(recycle_steps=2) if "recycling" in kw else {}
    interspersed = "memory_tokens_interspersed_every" in kw  # x-transformers counts slots there: no padding
    if interspersed:
        mask = None
    a = theirs(ids, mask=mask, **call)
    b = ours(ids, mask=mask, **call)
    real = slice(None) if mask is None else mask
    _close(b[real], a[real], "logits")
    params = lambda m: [m.token_emb.emb.weight if m is theirs else m.token_emb.weight,  # noqa: E731
                        m.pos_emb.emb.weight, m.attn_layers.layers[0][1].to_q.weight]
    ga = torch.autograd.grad(a[real].square().mean(), params(theirs))
    gb = torch.autograd.grad(b[real].square().mean(), params(ours))
    for what, x, y in zip(("token_emb", "pos_emb", "to_q"), gb, ga):
        _close(x, y, f"gradient of {what}", GRAD_TOL)
    # the meaning: the same forward, the embeddings' gradient scaled by the fraction (the stack's untouched)
    whole = sf.TransformerWrapper(attn_layers=sf.Decoder(dim=C, depth=2, heads=2, attn_dim_head=8),
                                  **dict(kw, emb_frac_gradient=1.0)).eval()
    whole.load_state_dict(ours.state_dict())
    c = whole(ids, mask=mask, **call)
    hp.assert_bitwise(b, c, "forward with and without emb_frac_gradient")
    gc = torch.autograd.grad(c[real].square().mean(), params(whole))
    _close(gb[0], 0.25 * gc[0], "token_emb gradient = frac * the whole one")
    _close(gb[2], gc[2], "to_q gradient untouched")


def test_emb_frac_gradient_scales_the_prefix_gradient_and_padding_reaches_nothing():
    """x-transformers applies the fraction after the prefix joins: its gradient is scaled too. NaN in the padded
    slots of ``sum_embeds`` and in masked prefix rows reaches no output or gradient."""
    kw = dict(num_tokens=V, max_seq_len=N, emb_frac_gradient=0.5, post_emb_norm=True)
    theirs, ours = _pair(xt.TransformerWrapper, sf.TransformerWrapper, **kw)
    ids, mask = _ids(), _right_padded()
    prefix = torch.randn(3, 2, C, generator=torch.Generator().manual_seed(2))
    pa, pb = prefix.clone().requires_grad_(), prefix.clone().requires_grad_()
    full = torch.cat((torch.ones(3, 2, dtype=torch.bool), mask), 1)
    a, b = theirs(ids, mask=mask, prepend_embeds=pa), ours(ids, mask=mask, prepend_embeds=pb)
    _close(b[full], a[full], "logits with a prefix")
    ga, = torch.autograd.grad(a[full].square().mean(), pa)
    gb, = torch.autograd.grad(b[full].square().mean(), pb)
    _close(gb, ga, "prefix gradient", GRAD_TOL)
    # garbage at padded slots
    pmask = torch.tensor([[True, True], [True, False], [False, False]])
    dirty_prefix = torch.where(pmask[..., None], prefix, NAN).requires_grad_()
    sums = torch.where(mask[..., None], torch.randn(3, N, C), NAN)
    out = ours(ids, mask=mask, prepend_embeds=dirty_prefix, prepend_mask=pmask, sum_embeds=sums)
    real = torch.cat((pmask, mask), 1)
    out[real].square().mean().backward()
    hp.assert_finite(out, "output")
    hp.assert_finite(dirty_prefix.grad, "prefix gradient")
    hp.assert_finite(ours.token_emb.weight.grad, "token_emb gradient")
    i = 1  # the sample with one real prefix row and 4 real tokens, alone
    alone = ours(ids[i:i + 1, :4], prepend_embeds=prefix[i:i + 1, :1], sum_embeds=sums[i:i + 1, :4])
    _close(out[i][real[i]], alone[0], "padded sample vs alone")


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, float("nan"), True, "0.5"])
def test_emb_frac_gradient_refuses_values_outside_0_1(bad):
    with pytest.raises(ValueError, match="emb_frac_gradient"):
        sf.TransformerWrapper(num_tokens=V, max_seq_len=N, emb_frac_gradient=bad,
                              attn_layers=sf.Decoder(dim=C, depth=1, heads=2))


def test_continuous_wrapper_has_no_emb_frac_gradient():
    """x-transformers' ContinuousTransformerWrapper has no such keyword: refused by name (1, a no-op, accepted)."""
    with pytest.raises(TypeError, match="emb_frac_gradient"):
        sf.ContinuousTransformerWrapper(dim_in=D, max_seq_len=N, emb_frac_gradient=0.5,
                                        attn_layers=sf.Decoder(dim=C, depth=1, heads=2))


def test_emb_frac_gradient_round_trips_and_generates(tmp_path):
    _, net = _pair(xt.TransformerWrapper, sf.TransformerWrapper, num_tokens=V, max_seq_len=16,
                   emb_frac_gradient=0.1)
    back = sf.TransformerWrapper.from_pretrained(net.save_pretrained(tmp_path / "frac")).eval()
    assert back.emb_frac_gradient == 0.1 and back.get_config()["emb_frac_gradient"] == 0.1
    ids = _ids()
    hp.assert_bitwise(back(ids), net(ids), "logits after reloading")
    gen = sf.AutoregressiveWrapper(net)
    prompts, pmask = _ids(2, seed=3)[:, :4], torch.tensor([[False, True, True, True], [True] * 4])
    static = gen.generate(prompts, 5, mask=pmask, temperature=0.0)
    assert torch.equal(static, gen.generate(prompts, 5, mask=pmask, temperature=0.0, cache_kv=False))
    assert torch.equal(static, gen.generate(prompts, 5, mask=pmask, temperature=0.0, static_cache=False))


# ---------------------------------------------------------------------------------------------------
# ContinuousTransformerWrapper(post_emb_norm=)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(), dict(num_memory_tokens=2), dict(scaled_sinu_pos_emb=True)],
                         ids=["plain", "memory_tokens", "sinusoids"])
def test_continuous_post_emb_norm_matches_x_transformers(kw):
    theirs, ours = _pair(xt.ContinuousTransformerWrapper, sf.ContinuousTransformerWrapper, dim_in=D, dim_out=4,
                         max_seq_len=N, post_emb_norm=True, **kw)
    assert "post_emb_norm.gamma" in ours.state_dict() and ours.get_config()["post_emb_norm"] is True
    x, mask = _vectors(), _right_padded()
    sums = torch.randn(3, N, C)
    a = theirs(x, mask=mask, sum_embeds=sums)
    b = ours(x, mask=mask, sum_embeds=sums)
    _close(b[mask], a[mask], "outputs")
    pa = [theirs.post_emb_norm.gamma, theirs.project_in.weight]
    pb = [ours.post_emb_norm.gamma, ours.project_in.weight]
    for what, u, v in zip(("gamma", "project_in"), torch.autograd.grad(b[mask].square().mean(), pb),
                          torch.autograd.grad(a[mask].square().mean(), pa)):
        _close(u, v, f"gradient of {what}", GRAD_TOL)
    plain = sf.ContinuousTransformerWrapper(attn_layers=sf.Decoder(dim=C, depth=2, heads=2, attn_dim_head=8),
                                            dim_in=D, dim_out=4, max_seq_len=N, **kw).eval()
    plain.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.startswith("post_emb_norm")})
    assert not torch.allclose(plain(x, mask=mask)[mask], b[mask])  # the norm is applied


def test_continuous_post_emb_norm_padding_reaches_nothing():
    _, net = _pair(xt.ContinuousTransformerWrapper, sf.ContinuousTransformerWrapper, dim_in=D, dim_out=4,
                   max_seq_len=N, post_emb_norm=True)
    x, mask = _vectors(), _right_padded()
    dirty = torch.where(mask[..., None], x, NAN).requires_grad_()
    out = net(dirty, mask=mask)
    out[mask].square().mean().backward()
    hp.assert_finite(out, "output")
    hp.assert_finite(dirty.grad, "input gradient")
    hp.assert_finite(net.post_emb_norm.gamma.grad, "gamma gradient")
    assert net.post_emb_norm.gamma.grad.abs().sum() > 0
    _close(out[1, :4], net(x[1:2, :4])[0], "padded sample vs alone")
    with pytest.raises(TypeError, match="post_emb_norm"):
        sf.ContinuousTransformerWrapper(dim_in=D, max_seq_len=N, post_emb_norm=1,
                                        attn_layers=sf.Decoder(dim=C, depth=1, heads=2))


def test_continuous_post_emb_norm_round_trips_and_generates(tmp_path):
    _, net = _pair(xt.ContinuousTransformerWrapper, sf.ContinuousTransformerWrapper, dim_in=D, dim_out=D,
                   max_seq_len=16, post_emb_norm=True, layer_kw=dict(rotary_pos_emb=True))
    back = sf.ContinuousTransformerWrapper.from_pretrained(net.save_pretrained(tmp_path / "norm")).eval()
    assert back.post_emb_norm is not None and back.get_config()["post_emb_norm"] is True
    x = _vectors()
    hp.assert_bitwise(back(x), net(x), "outputs after reloading")
    gen = sf.ContinuousAutoregressiveWrapper(net)
    start, smask = _vectors(2, 4, seed=5), torch.tensor([[False, True, True, True], [True] * 4])
    cached = gen.generate(start, 4, mask=smask, cache_kv=True)
    _close(cached, gen.generate(start, 4, mask=smask, cache_kv=False), "cached vs uncached")
    _close(cached[0], gen.generate(start[:1, 1:], 4, cache_kv=False)[0], "left-padded start vs alone")


# ---------------------------------------------------------------------------------------------------
# ContinuousTransformerWrapper(max_mem_len=) and forward(mems=, mem_masks=, return_mems=)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer_kw", [dict(), dict(rotary_pos_emb=True), dict(alibi_pos_bias=True)],
                         ids=["abs", "rotary", "alibi"])
def test_continuous_memories_match_x_transformers(layer_kw):
    theirs, ours = _pair(xt.ContinuousTransformerWrapper, sf.ContinuousTransformerWrapper, dim_in=D, dim_out=4,
                         max_seq_len=N, max_mem_len=4, layer_kw=layer_kw)
    assert ours.get_config()["max_mem_len"] == 4
    x1, x2 = _vectors(seed=1), _vectors(n=3, seed=2)
    mask1 = _right_padded()
    a1, ma = theirs(x1, mask=mask1, return_mems=True)
    b1, mb = ours(x1, mask=mask1, return_mems=True)
    _close(b1[mask1], a1[mask1], "first segment")
    assert isinstance(mb, tuple) and type(ma) is tuple and len(mb) == len(ma) == 2
    keep = mask1[:, -4:]  # the last max_mem_len positions; x-transformers' padded rows hold what it computed
    for u, v in zip(mb, ma):
        assert u.shape == v.shape == (3, 4, C) and not u.requires_grad
        _close(u[keep], v[keep], "memories")
    assert torch.equal(mb.masks[0], keep)
    # the next segment: x-transformers told the padding of its memories (its own list, as its forward needs one).
    # With relative positions (rotary, ALiBi) x-transformers places a padded memory's rows by slot, safeformer by
    # real row (the sample alone: test_continuous_memories_padding_reaches_nothing): compared where none is padded
    same = slice(None) if not layer_kw else slice(0, 1)
    x2t, x2g = x2.clone().requires_grad_(), x2.clone().requires_grad_()
    a2 = theirs(x2t, mems=list(ma), mem_masks=[keep, keep])
    b2 = ours(x2g, mems=mb)  # the masks come along
    _close(b2[same], a2[same], "second segment")
    assert not torch.allclose(b2, ours(x2))  # the memories matter
    ga = torch.autograd.grad(a2[same].square().mean(), [x2t, theirs.project_in.weight])
    gb = torch.autograd.grad(b2[same].square().mean(), [x2g, ours.project_in.weight])
    for what, u, v in zip(("input", "project_in"), gb, ga):
        _close(u, v, f"gradient of {what}", GRAD_TOL)
    # x-transformers' forms: the intermediates win over return_mems; only this segment's stream is kept
    a3, ia = theirs(x2, mems=list(ma), mem_masks=[keep, keep], return_mems=True, return_intermediates=True)
    b3, ib = ours(x2, mems=mb, return_mems=True, return_intermediates=True)
    assert type(ib).__name__ == type(ia).__name__ == "LayerIntermediates"
    _close(b3[same], a3[same], "with the intermediates")
    _, mb2 = ours(x2, mems=mb, return_mems=True)
    _, ma2 = theirs(x2, mems=list(ma), mem_masks=[keep, keep], return_mems=True)
    for u, v, w in zip(mb2, ma2, ib.mems):
        assert u.shape == (3, 3, C) and mb2.masks is None
        _close(u[same], v[same], "next memories")
        hp.assert_bitwise(w, u, "memories on the intermediates")


def test_continuous_memories_padding_reaches_nothing():
    _, net = _pair(xt.ContinuousTransformerWrapper, sf.ContinuousTransformerWrapper, dim_in=D, dim_out=4,
                   max_seq_len=N, max_mem_len=N, layer_kw=dict(rotary_pos_emb=True))
    x1, x2, mask1 = _vectors(seed=1), _vectors(n=3, seed=2), _right_padded((N, 4, 0))
    dirty = torch.where(mask1[..., None], x1, NAN)
    _, mems = net(dirty, mask=mask1, return_mems=True)
    for t in mems:
        hp.assert_finite(t, "memories")
    x2g = x2.clone().requires_grad_()
    out = net(x2g, mems=mems)
    out.square().mean().backward()
    hp.assert_finite(out, "output")
    hp.assert_finite(x2g.grad, "input gradient")
    _, alone = net(x1[1:2, :4], return_mems=True)
    _close(out[1], net(x2[1:2], mems=alone)[0], "padded memory vs the sample alone")
    _close(out[2], net(x2[2:3])[0], "a fully padded memory is no memory")
    # a memory of length 0 (max_mem_len=0) is no memory either
    net.max_mem_len = 0
    _, empty = net(x1, mask=mask1, return_mems=True)
    assert empty[0].shape == (3, 0, C)
    _close(net(x2, mems=empty), net(x2), "empty memories")


def test_continuous_memories_errors():
    with pytest.raises(ValueError, match="max_mem_len"):
        sf.ContinuousTransformerWrapper(dim_in=D, max_seq_len=N, max_mem_len=-1,
                                        attn_layers=sf.Decoder(dim=C, depth=1, heads=2))
    with pytest.raises(ValueError, match="max_mem_len"):
        sf.ContinuousTransformerWrapper(dim_in=D, max_seq_len=N, max_mem_len=True,
                                        attn_layers=sf.Decoder(dim=C, depth=1, heads=2))
    _, net = _pair(xt.ContinuousTransformerWrapper, sf.ContinuousTransformerWrapper, dim_in=D, max_seq_len=N,
                   max_mem_len=3)
    x = _vectors()
    _, mems = net(x, return_mems=True)
    with pytest.raises(ValueError, match="mem_masks"):
        net(x, mem_masks=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mems"):
        net(x, mems=mems, return_cache=True)
    with pytest.raises(ValueError, match="mems"):
        net(x, mems=mems, prepend_embeds=torch.randn(3, 2, C))
    with pytest.raises(TypeError, match="return_mems"):
        net(x, return_mems=1)


def test_continuous_max_mem_len_round_trips(tmp_path):
    _, net = _pair(xt.ContinuousTransformerWrapper, sf.ContinuousTransformerWrapper, dim_in=D, dim_out=4,
                   max_seq_len=N, max_mem_len=3, post_emb_norm=True)
    back = sf.ContinuousTransformerWrapper.from_pretrained(net.save_pretrained(tmp_path / "xl")).eval()
    assert back.max_mem_len == 3 and back.get_config()["max_mem_len"] == 3
    x = _vectors()
    _, mems = back(x, return_mems=True)
    assert mems[0].shape == (3, 3, C)
    hp.assert_bitwise(back(x, mems=mems), net(x, mems=net(x, return_mems=True)[1]), "reloaded with memories")
