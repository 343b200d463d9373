"""x-transformers' packed sequences (``flash_pack_seq=True`` and ``flash_pack_seq_kwargs``, flash-attn's
``cu_seqlens_q`` / ``cu_seqlens_k``) on ``Attention`` and ``Attend``: one sequence of documents, each query seeing its
own document's keys. x-transformers runs them on flash-attn (CUDA only), so the reference here is each document run
alone; positions after the last document are dead rows (0); bad offsets are named."""

from __future__ import annotations

import pytest
import torch

import safeformer as sf
from safeformer.core.masks import packed_sequence_mask


def _kw(offsets):
    cu = torch.tensor(offsets)
    longest = int((cu[1:] - cu[:-1]).max())
    return dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("opts", [{}, dict(kv_heads=1, qk_norm=True), dict(num_mem_kv=2)])
def test_attention_packed_equals_each_document_alone(causal, opts):
    torch.manual_seed(0)
    attn = sf.Attention(16, heads=2, dim_head=8, causal=causal, flash_pack_seq=True, **opts)
    x = torch.randn(1, 9, 16, requires_grad=True)
    out = attn(x, flash_pack_seq_kwargs=_kw([0, 2, 6, 8]))
    ref = torch.cat([attn(x[:, a:b]) for a, b in ((0, 2), (2, 6), (6, 8))], dim=1)
    torch.testing.assert_close(out[:, :8], ref, atol=1e-5, rtol=1e-5)
    if not opts.get("num_mem_kv"):
        assert (out[:, 8] == 0).all()  # after the last document: no key
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_attend_packed_equals_each_document_alone():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 7, 8, generator=g) for _ in range(3))
    att = sf.Attend(causal=True, flash_pack_seq=True)
    out, _ = att(q, k, v, flash_pack_seq_kwargs=_kw([0, 4, 7]))
    ref = torch.cat([att(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])[0] for a, b in ((0, 4), (4, 7))], dim=2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_mask_is_block_diagonal():
    m = packed_sequence_mask(_kw([0, 2, 3]), 4, 4, "cpu")[0, 0]
    want = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(m, want)


@pytest.mark.parametrize("kwargs,exc,word", [
    (dict(cu_seqlens_q=torch.tensor([0, 3])), TypeError, "flash_pack_seq_kwargs"),
    (dict(cu_seqlens_q=torch.tensor([0.0, 3.0]), cu_seqlens_k=torch.tensor([0, 3])), TypeError, "cu_seqlens_q"),
    (dict(cu_seqlens_q=torch.tensor([1, 3]), cu_seqlens_k=torch.tensor([1, 3])), ValueError, "start at 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 4, 3]), cu_seqlens_k=torch.tensor([0, 4, 3])), ValueError, "never decrease"),
    (dict(cu_seqlens_q=torch.tensor([0, 9]), cu_seqlens_k=torch.tensor([0, 9])), ValueError, "at most"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 4]), cu_seqlens_k=torch.tensor([0, 4])), ValueError, "same number"),
    (dict(cu_seqlens_q=torch.tensor([0, 4]), cu_seqlens_k=torch.tensor([0, 4]), max_seqlen_q=-1), ValueError,
     "max_seqlen_q"),
])
def test_bad_offsets_are_named(kwargs, exc, word):
    attn = sf.Attention(16, heads=2, flash_pack_seq=True)
    with pytest.raises(exc, match=word):
        attn(torch.randn(1, 5, 16), flash_pack_seq_kwargs=kwargs)


def test_calls_that_cannot_be_packed_are_refused():
    x = torch.randn(2, 5, 16)
    with pytest.raises(TypeError, match="flash_pack_seq=True"):
        sf.Attention(16, heads=2)(x[:1], flash_pack_seq_kwargs=_kw([0, 5]))
    attn = sf.Attention(16, heads=2, flash_pack_seq=True)
    with pytest.raises(ValueError, match="batch 1"):
        attn(x, flash_pack_seq_kwargs=_kw([0, 5]))
    with pytest.raises(ValueError, match="batch 1"):
        attn(x[:1], mask=torch.ones(1, 5, dtype=torch.bool), flash_pack_seq_kwargs=_kw([0, 5]))
    with pytest.raises(TypeError, match="flash_pack_seq"):
        sf.Attention(16, flash_pack_seq=1)


def test_stack_packed_equals_each_document_alone_and_refuses_what_cannot_pack():
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=20, max_seq_len=16,
                                attn_layers=sf.Decoder(dim=16, depth=2, heads=2, rotary_pos_emb=True,
                                                       attn_flash_pack_seq=True))
    x = torch.randint(0, 20, (1, 10))
    emb = net.token_emb(x).detach().requires_grad_()
    out = net.attn_layers(emb, flash_pack_seq_kwargs=_kw([0, 4, 9]))
    ref = torch.cat([net.attn_layers(emb[:, :4]), net.attn_layers(emb[:, 4:9])], dim=1)
    torch.testing.assert_close(out[:, :9], ref, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert torch.isfinite(emb.grad).all()
    with pytest.raises(ValueError, match="batch 1"):
        net.attn_layers(emb.detach(), mask=torch.ones(1, 10, dtype=torch.bool), flash_pack_seq_kwargs=_kw([0, 10]))
    with pytest.raises(TypeError, match="attn_flash_pack_seq=True"):
        sf.Decoder(dim=16, depth=1, heads=2)(torch.randn(1, 4, 16), flash_pack_seq_kwargs=_kw([0, 4]))


def _kw2(q_offsets, k_offsets):
    """``flash_pack_seq_context_kwargs``: the query documents' offsets and the context documents'."""
    q, k = torch.tensor(q_offsets), torch.tensor(k_offsets)
    return dict(cu_seqlens_q=q, cu_seqlens_k=k, max_seqlen_q=int((q[1:] - q[:-1]).max()),
                max_seqlen_k=int((k[1:] - k[:-1]).max()))


@pytest.mark.parametrize("self_packed", [True, False])
def test_stack_packed_context_equals_each_document_alone(self_packed):
    """``flash_pack_seq_context_kwargs``: query document ``d`` cross-attends to context document ``d`` only (with
    packed self-attention too: each document with its own context, alone). x-transformers runs it on flash-attn
    (CUDA only): the reference is each document alone. NaN in context positions after the last context document
    reaches nothing; queries after the last document see no context."""
    torch.manual_seed(2)
    dec = sf.Decoder(dim=16, depth=2, heads=2, rotary_pos_emb=True, cross_attend=True, attn_flash_pack_seq=True)
    dec = dec.eval()
    x = torch.randn(1, 10, 16, requires_grad=True)
    ctx = torch.cat((torch.randn(1, 8, 16), torch.full((1, 1, 16), float("nan"))), 1).requires_grad_()
    q_docs, k_docs = [0, 4, 9], [0, 3, 8]
    kw = dict(flash_pack_seq_kwargs=_kw(q_docs)) if self_packed else {}
    out = dec(x, context=ctx, flash_pack_seq_context_kwargs=_kw2(q_docs, k_docs), **kw)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all() and torch.isfinite(ctx.grad).all()
    assert (ctx.grad[:, 8] == 0).all()
    with torch.no_grad():
        spans = list(zip(zip(q_docs, q_docs[1:]), zip(k_docs, k_docs[1:])))
        if self_packed:
            ref = torch.cat([dec(x[:, a:b], context=ctx[:, c:d]) for (a, b), (c, d) in spans], dim=1)
            torch.testing.assert_close(out[:, :9].detach(), ref, atol=1e-5, rtol=1e-5)
        else:  # causal self-attention over the whole sequence: document 0 alone, the others see it
            torch.testing.assert_close(out[:, :4].detach(), dec(x[:, :4], context=ctx[:, :3]), atol=1e-5, rtol=1e-5)
            whole = dec(x[:, :9], context=ctx[:, 3:8])
            assert not torch.allclose(out[:, 4:9].detach(), whole[:, 4:9])


def test_stack_packed_context_refusals_are_named():
    dec = sf.Decoder(dim=16, depth=1, heads=2, cross_attend=True, attn_flash_pack_seq=True)
    x, ctx, kw = torch.randn(1, 5, 16), torch.randn(1, 4, 16), _kw2([0, 2, 5], [0, 1, 4])
    with pytest.raises(ValueError, match="flash_pack_seq_context_kwargs"):
        dec(x, context=ctx, context_mask=torch.ones(1, 4, dtype=torch.bool), flash_pack_seq_context_kwargs=kw)
    with pytest.raises(ValueError, match="flash_pack_seq_context_kwargs"):
        dec(x.expand(2, -1, -1), context=ctx.expand(2, -1, -1), flash_pack_seq_context_kwargs=kw)
    with pytest.raises(ValueError, match="flash_pack_seq_context_kwargs"):
        dec(x, context=ctx, flash_pack_seq_context_kwargs=_kw2([0, 2, 5], [0, 4]))
    with pytest.raises(TypeError, match="flash_pack_seq_context_kwargs"):
        dec(x, context=ctx, flash_pack_seq_context_kwargs={"cu_seqlens_q": kw["cu_seqlens_q"]})
    for plain in (sf.Decoder(dim=16, depth=1, heads=2, cross_attend=True), sf.Decoder(dim=16, depth=1, heads=2)):
        with pytest.raises(TypeError, match="attn_flash_pack_seq=True"):
            plain(x, context=ctx, flash_pack_seq_context_kwargs=kw)
