"""The unpadded path (``AttentionLayers(unpadded=...)``): token-wise work on the real tokens only equals the
padded path for every kind of stack and wrapper (outputs and every gradient, float64), padded outputs
stay exactly 0, and ``"auto"`` picks it from the padding fraction. The contract clauses on this path run
in test_contract_models.py (the ``*-unpadded`` cases).

Shape legend: b batch, n positions, j context length, c width.
"""

from __future__ import annotations

import helpers as hp
import pytest
import torch

import safeformer as sf
from safeformer.stack.unpadded import UNPADDED_THRESHOLD

STACKS = {
    "encoder-alibi-qknorm-bias": lambda: sf.Encoder(dim=16, depth=2, heads=2, dim_head=8, alibi_pos_bias=True,
                                                     attn_qk_norm=True, attn_bias=True),
    "decoder-rotary-gqa-cross": lambda: sf.Decoder(dim=16, depth=2, heads=4, dim_head=4, kv_heads=2, cross_attend=True,
                                                   rotary_pos_emb=True, ff_glu=True),
    "cross-attender": lambda: sf.CrossAttender(dim=16, depth=2, heads=2, dim_head=8, attn_bias=True),
    "decoder-adaptive": lambda: sf.Decoder(dim=16, depth=2, heads=2, dim_head=8, cross_attend=True,
                                           use_adaptive_rmsnorm=True, use_adaptive_layerscale=True, dim_condition=3),
    "decoder-checkpointed": lambda: sf.Decoder(dim=16, depth=2, heads=2, dim_head=8, checkpoint_layers=True),
}


def _inputs(name: str):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 6, 16, generator=g, dtype=torch.float64)
    mask = torch.tensor([[False, False, True, True, True, True], [True, True, True, False, False, False], [False] * 6])
    kw = {}
    if "cross" in name or "adaptive" in name:
        kw.update(context=torch.randn(3, 4, 16, generator=g, dtype=torch.float64),
                  context_mask=torch.tensor([[True, False, True, False], [False] * 4, [True] * 4]))
    if "adaptive" in name:
        kw.update(condition=torch.randn(3, 3, generator=g, dtype=torch.float64), condition_mask=torch.tensor([True, False, True]))
    return x, mask, kw


def _run(model, x, mask, kw, unpadded):
    hp.set_unpadded(model, unpadded)
    model.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_()
    out = model(xx, mask=mask, **kw)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    return out.detach(), xx.grad, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(STACKS))
def test_unpadded_stack_equals_padded_path(name):
    torch.manual_seed(0)
    model = STACKS[name]().double().train()  # train mode: checkpointing engages; no dropout configured
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x, mask, kw = _inputs(name)
    a, b = _run(model, x, mask, kw, False), _run(model, x, mask, kw, True)
    hp.assert_close(b[0], a[0], f"{name}: output", torch.float64)
    hp.assert_zero(b[0][~mask], f"{name}: padded outputs on the unpadded path")
    hp.assert_close(b[1], a[1], f"{name}: grad of x", torch.float64)
    for n, g in a[2].items():
        if g is None:
            assert b[2][n] is None or not bool(b[2][n].any()), n
        else:
            hp.assert_close(b[2][n], g, f"{name}: grad of {n}", torch.float64)


@pytest.mark.parametrize("kind", ["tokens", "tokens-tied", "prefix", "continuous", "xtransformer"])
def test_unpadded_wrappers_equal_padded_path(kind):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(4)
    mask = torch.tensor([[False, True, True, True, True], [True, True, False, False, False], [True] * 5])
    if kind == "xtransformer":
        model = sf.XTransformer(dim=16, enc_num_tokens=9, enc_max_seq_len=8, dec_num_tokens=9, dec_max_seq_len=8,
                                enc_depth=1, dec_depth=1, enc_heads=2, dec_heads=2, dim_head=8).double()
        src = torch.randint(0, 9, (3, 5), generator=g)
        tgt = torch.randint(0, 9, (3, 5), generator=g)
        run = lambda: model(src, tgt, mask=mask, tgt_mask=mask[[2, 0, 1]])  # noqa: E731
    elif kind == "continuous":
        model = sf.ContinuousTransformerWrapper(dim_in=5, dim_out=7, max_seq_len=8, attn_layers=sf.Encoder(
            dim=16, depth=2, heads=2, dim_head=8, cross_attend=True)).double()
        x = torch.randn(3, 5, 5, generator=g, dtype=torch.float64)
        ctx = torch.randn(3, 2, 16, generator=g, dtype=torch.float64)
        run = lambda: model(x, mask=mask, context=ctx, context_mask=torch.tensor([[True, False], [False, False], [True, True]]))  # noqa: E731
    else:
        model = sf.TransformerWrapper(num_tokens=11, max_seq_len=12, tie_embedding=kind == "tokens-tied",
                                      attn_layers=sf.Decoder(dim=16, depth=2, heads=2, dim_head=8)).double()
        ids = torch.randint(0, 11, (3, 5), generator=g)
        extra = {}
        if kind == "prefix":
            extra = dict(prepend_embeds=torch.randn(3, 2, 16, generator=g, dtype=torch.float64),
                         prepend_mask=torch.tensor([[True, False], [False, False], [True, True]]))
        run = lambda: model(ids, mask=mask, **extra)  # noqa: E731
    outs = []
    for flag in (False, True):
        hp.set_unpadded(model, flag)
        model.zero_grad(set_to_none=True)
        out = run()
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
        outs.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = outs
    hp.assert_close(b, a, f"{kind}: output", torch.float64)
    for n, g_ in ga.items():
        if g_ is not None:
            hp.assert_close(gb[n], g_, f"{kind}: grad of {n}", torch.float64)


def test_auto_picks_the_unpadded_path_from_the_padding_fraction():
    dec = sf.Decoder(dim=16, depth=1, heads=2, dim_head=8)
    full = torch.ones(4, 10, dtype=torch.bool)
    assert dec.plan_unpadded(full) is None
    few = full.clone()
    few[0, 8:] = False  # 5% padding
    assert dec.plan_unpadded(few) is None
    many = full.clone()
    many[:, 10 - int(10 * UNPADDED_THRESHOLD) - 1:] = False
    assert dec.plan_unpadded(many) is not None
    assert not dec.plan_unpadded(many, return_cache=True) is not None, "a forward that returns a cache stays padded"
    dec.unpadded = False
    assert not dec.plan_unpadded(many) is not None
    dec.unpadded = True
    assert dec.plan_unpadded(few) is not None
    with pytest.raises(ValueError, match="unpadded"):
        sf.Decoder(dim=16, depth=1, unpadded="sometimes")


def test_auto_keeps_the_padded_path_on_cuda_without_the_varlen_kernel(monkeypatch):
    """On an H200 with torch 2.11 (no varlen kernel) the unpadded path's length groups made a training
    step 2.0x-2.5x slower than the padded path: "auto" unpads on CUDA only where the varlen kernel runs."""
    import safeformer.stack.unpadded as up

    assert up.auto_unpads_on(torch.device("cpu"))
    monkeypatch.setattr(up, "varlen_kernel_available", lambda device=None: False)
    assert not up.auto_unpads_on(torch.device("cuda"))
    assert not up.auto_unpads_on(torch.device("cuda", 0))
    monkeypatch.setattr(up, "varlen_kernel_available", lambda device=None: True)
    assert up.auto_unpads_on(torch.device("cuda"))
