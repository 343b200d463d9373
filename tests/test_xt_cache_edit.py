"""x-transformers' intermediates carry each attention block's ``cached_kv``; code written for x-transformers reads
and edits them (regroups the batch, keeps the first positions) and passes the intermediates back as ``cache``.
safeformer attaches its cache's own tuples there and rebuilds the cache from edited ones, or refuses the edit
where the cache holds something per sample that the edit does not say how to change."""

import pytest
import torch

import safeformer as sf


def _dec():
    torch.manual_seed(0)
    return sf.Decoder(dim=32, depth=2, heads=4, dim_head=8, rotary_pos_emb=True).eval()


def test_cached_kv_are_the_caches_own_tensors():
    dec = _dec()
    _, inter = dec(torch.randn(2, 5, 32), return_hiddens=True)
    selfs = [a.cached_kv for a in inter.attn_intermediates if a.layer_type == "a"]
    assert all(e[0] is o[0] and e[1] is o[1] for e, o in zip(selfs, inter.cache.self_kv))


def test_truncated_cached_kv_continue_like_the_truncated_sequence():
    dec = _dec()
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        _, inter = dec(x[:, :5], return_hiddens=True)
        for a in inter.attn_intermediates:  # keep the first 3 positions (x-transformers' code does such edits)
            a.cached_kv = tuple(t[:, :, :3] for t in a.cached_kv)
        step = dec(x[:, 3:4], cache=inter)
        want = dec(x[:, :4])[:, 3:]
    torch.testing.assert_close(step, want, rtol=1e-5, atol=1e-5)


def test_regrouped_batch_continues_per_row():
    dec = _dec()
    x = torch.randn(4, 5, 32)
    with torch.no_grad():
        _, inter = dec(x[:, :4], return_hiddens=True)
        for a in inter.attn_intermediates:  # keep rows 1 and 3
            a.cached_kv = tuple(t[[1, 3]] for t in a.cached_kv)
        step = dec(x[[1, 3], 4:], cache=inter)
        want = dec(x[[1, 3]])[:, 4:]
    torch.testing.assert_close(step, want, rtol=1e-5, atol=1e-5)


def test_same_edits_as_x_transformers_give_the_same_outputs():
    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(1)
    peer = xt.TransformerWrapper(num_tokens=40, max_seq_len=16, use_abs_pos_emb=False,
                                 attn_layers=xt.Decoder(dim=32, depth=2, heads=4, attn_dim_head=8,
                                                        rotary_pos_emb=True)).eval()
    ours = sf.from_x_transformers(peer).eval()
    ids = torch.randint(0, 40, (3, 6))
    outs = []
    for m in (peer, ours):
        with torch.no_grad():
            _, inter = m(ids[:, :5], return_intermediates=True)
            for a in inter.attn_intermediates:
                a.cached_kv = tuple(t[[0, 2], :, :4] for t in a.cached_kv)
            outs.append(m(ids[[0, 2]][:, :5], cache=inter))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_edit_of_a_padded_cache_is_refused():
    dec = _dec()
    x = torch.randn(2, 5, 32)
    mask = torch.tensor([[False, True, True, True, True], [True] * 5])
    _, inter = dec(x, mask=mask, return_hiddens=True)
    for a in inter.attn_intermediates:
        a.cached_kv = tuple(t[:, :, :3] for t in a.cached_kv)
    with pytest.raises(ValueError, match="cached_kv were edited"):
        dec(x[:, :1], cache=inter)
    _, inter = dec(x, return_hiddens=True)
    inter.attn_intermediates[0].cached_kv = (torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 8))
    with pytest.raises(ValueError, match="disagree"):
        dec(x[:, :1], cache=inter)
