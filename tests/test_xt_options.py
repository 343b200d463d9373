"""x-transformers' options in safeformer: memory key/values, learned sinks, logit softclamp,
attention maps and intermediates, memory and class tokens, average pooling, l2norm embeddings, tied
scales, ``pos=`` and ``seq_start_pos``.

Each option is checked three ways: against a float64 formula written out here, against x-transformers'
own module on the same weights where the math is the same, and for the contract (NaN planted in masked
slots reaches nothing, dead and padded rows are exact zeros, clear errors). The S1-S9 suite also runs
the cases ``Attention-memkv-sink``, ``Decoder-memkv-sink`` and ``TransformerWrapper-memory``
(``helpers.models.CASES``).
"""

from __future__ import annotations

import helpers as hp
import pytest
import torch

import safeformer as sf
from safeformer.nn.attention import _explicit_attention

NAN = float("nan")
xt = pytest.importorskip("x_transformers")


def _seed(seed: int = 0) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


MASK = torch.tensor([[True, True, True, False, False], [False, False, True, True, True],
                     [False] * 5, [True] * 5])


@pytest.mark.parametrize("opts", [
    dict(num_mem_kv=2), dict(learned_sink=True), dict(num_mem_kv=3, learned_sink=True),
    dict(softclamp_logits=True, logit_softclamp_value=1.5), dict(num_mem_kv=1, learned_sink=True, softclamp_logits=True),
], ids=["memkv", "sink", "memkv+sink", "softclamp", "all"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["f64", "f32", "bf16"])
def test_extra_keys_match_float64_formula(opts, causal, dtype):
    """Memory keys, sinks and softclamp equal the written-out float64 formula; NaN at padded positions of
    x changes nothing and reaches no gradient."""
    _seed(0)
    attn = sf.Attention(16, heads=4, dim_head=8, kv_heads=2, **opts)
    if attn.head_attn_sink is not None:
        torch.nn.init.normal_(attn.head_attn_sink)
    x = torch.randn(4, 5, 16)
    # float64, written out: a padded query's output is 0; every real query sees the sink (logit
    # head_attn_sink[h], value 0), the memory keys, and the real keys (at or before it if causal)
    want = hp.ref_attention(attn, x, allowed=MASK[:, None, None, :], causal=causal, queries=MASK)
    attn = attn.to(dtype)
    planted = x.clone()
    planted[~MASK] = NAN
    planted = planted.to(dtype).requires_grad_()
    out = attn(planted, mask=MASK, causal=causal)
    tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    assert bool((out[~MASK] == 0).all())
    out.float().square().sum().backward()
    assert bool(torch.isfinite(planted.grad).all()) and bool((planted.grad[~MASK] == 0).all())
    for name, p in attn.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name


def test_memory_keys_leave_no_row_dead_and_a_sink_alone_gives_zero():
    """With memory keys a query with no other key attends to them (x-transformers' semantics); with only a
    sink, such a query outputs exactly 0 (the sink's value is 0) with zero gradient, never NaN."""
    _seed(1)
    x = torch.randn(2, 3, 16)
    ctx = torch.randn(2, 4, 16)
    dropped = torch.zeros(2, 4, dtype=torch.bool)
    mem = sf.Attention(16, heads=2, dim_head=8, num_mem_kv=2)
    out = mem(x, ctx, mask=dropped)
    empty = mem(x, ctx[:, :0])
    torch.testing.assert_close(out, empty)  # the memory keys alone, whatever the masked context holds
    assert bool((out.abs() > 0).any())
    sink = sf.Attention(16, heads=2, dim_head=8, learned_sink=True)
    torch.nn.init.normal_(sink.head_attn_sink)
    xg = x.clone().requires_grad_()
    out = sink(xg, ctx, mask=dropped)
    assert bool((out == 0).all())
    out.sum().backward()
    assert bool((xg.grad == 0).all()) and bool((sink.head_attn_sink.grad == 0).all())


def _xt_attention(opts: dict, sf_attn: sf.Attention):
    """x-transformers' Attention with ``sf_attn``'s weights (equal head counts: no GQA reordering)."""
    a = xt.x_transformers.Attention(16, heads=sf_attn.heads, dim_head=sf_attn.dim_head, **opts)
    sd = {"to_q.weight": sf_attn.to_q.weight, "to_k.weight": sf_attn.to_k.weight, "to_v.weight": sf_attn.to_v.weight,
          "to_out.weight": sf_attn.to_out.weight}
    if sf_attn.num_mem_kv:
        sd.update({"mem_k": sf_attn.mem_k, "mem_v": sf_attn.mem_v})
    if sf_attn.head_attn_sink is not None:
        sd["attend.head_attn_sink"] = sf_attn.head_attn_sink
    missing = a.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    assert not missing.unexpected_keys, missing
    return a.eval()


@pytest.mark.parametrize("opts,xt_opts", [
    (dict(num_mem_kv=2), dict(num_mem_kv=2)),
    (dict(learned_sink=True), dict(head_learned_sink=True)),
    (dict(softclamp_logits=True, logit_softclamp_value=2.0), dict(softclamp_logits=True, logit_softclamp_value=2.0)),
], ids=["memkv", "sink", "softclamp"])
def test_extra_keys_match_x_transformers(opts, xt_opts):
    """The same weights give x-transformers' outputs at every real query (right padding)."""
    _seed(2)
    attn = sf.Attention(16, heads=4, dim_head=8, **opts).eval()
    if attn.head_attn_sink is not None:
        torch.nn.init.normal_(attn.head_attn_sink)
    peer = _xt_attention(xt_opts, attn)
    x = torch.randn(2, 6, 16)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    with torch.no_grad():
        ours = attn(x, mask=mask)
        theirs = peer(x, mask=mask)
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-5, rtol=1e-5)


def _decoder_pair(**layer_opts):
    _seed(3)
    peer = xt.TransformerWrapper(num_tokens=20, max_seq_len=16,
                                 attn_layers=xt.Decoder(dim=16, depth=2, heads=2, attn_dim_head=8, **layer_opts)).eval()
    return peer, sf.from_x_transformers(peer).eval()


def test_return_attn_matches_x_transformers_and_zeroes_padding():
    """``return_attn`` gives x-transformers' post-softmax maps at real queries; rows of padded queries
    and columns of padded keys are exactly 0; each live row sums to 1."""
    peer, ours = _decoder_pair(rotary_pos_emb=True)
    x = torch.randint(0, 20, (2, 6))
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    with torch.no_grad():
        logits, maps = ours(x, mask=mask, return_attn=True)
        _, peer_maps = peer(x, mask=mask, return_attn=True)
        plain = ours(x, mask=mask)
    torch.testing.assert_close(logits, plain, atol=1e-5, rtol=1e-5)
    assert len(maps) == len(peer_maps) == 2
    for m, p in zip(maps, peer_maps):
        assert m.dtype == torch.float32 and m.shape == p.shape
        real_rows = mask[:, None, :, None].expand_as(m) & mask[:, None, None, :].expand_as(m)
        torch.testing.assert_close(m[real_rows], p[real_rows], atol=1e-5, rtol=1e-5)
        assert bool((m[~mask[:, None, :, None].expand_as(m)] == 0).all())
        assert bool((m[~mask[:, None, None, :].expand_as(m)] == 0).all())
        torch.testing.assert_close(m.sum(-1)[mask[:, None, :].expand(m.shape[:3])], torch.ones(int(mask.sum()) * 2))


def test_return_intermediates_hiddens_and_maps():
    """``return_intermediates``: one hidden state per layer (the first is the embedded input), padded
    rows 0; a cross-attention map of a dropped context is exactly 0; the cache comes along on request."""
    _seed(4)
    net = sf.TransformerWrapper(num_tokens=20, max_seq_len=16, num_memory_tokens=2,
                                attn_layers=sf.Decoder(dim=16, depth=3, heads=2, dim_head=8, cross_attend=True))
    x = torch.randint(0, 20, (2, 5))
    mask = torch.tensor([[True] * 5, [False, True, True, True, True]])
    ctx = torch.randn(2, 3, 16)
    ctx[0] = NAN
    ctx_mask = torch.tensor([[False] * 3, [True, True, False]])
    logits, inter = net(x, mask=mask, context=ctx, context_mask=ctx_mask, return_intermediates=True)
    assert torch.isfinite(logits).all()
    assert len(inter.hiddens) == 3 and inter.memory_tokens.shape == (2, 2, 16)
    first = net.token_emb(torch.where(mask, x, 0)) + net.pos_emb.embed_positions(sf.positions_from_mask(mask, 5, "cpu"))
    torch.testing.assert_close(inter.hiddens[0][:, 2:][mask], first[mask])
    assert bool((inter.hiddens[1][:, 2:][~mask] == 0).all())
    kinds = [a.layer_type for a in inter.attn_intermediates]
    assert kinds == ["a", "c"] * 3
    cross = inter.attn_intermediates[1].post_softmax_attn
    assert bool((cross[0] == 0).all()) and torch.isfinite(cross).all()
    out, cache, inter2 = net(x, mask=mask, context=ctx, context_mask=ctx_mask, return_cache=True, return_intermediates=True)
    assert isinstance(cache, sf.KVCache) and inter2.cache is cache


@pytest.mark.parametrize("kind", ["cls", "avg"])
def test_pooled_outputs_padding_invariant_and_safe(kind):
    """``use_cls_token`` / ``average_pool_embed`` give ``(b, logits_dim)``: each sample equals itself run
    alone; a fully padded sample is finite (average pooling: exactly the head of 0), NaN-free gradients."""
    _seed(5)
    opts = dict(use_cls_token=True) if kind == "cls" else dict(average_pool_embed=True)
    net = sf.TransformerWrapper(num_tokens=20, max_seq_len=16, logits_dim=3,
                                attn_layers=sf.Encoder(dim=16, depth=2, heads=2, dim_head=8), **opts)
    x = torch.randint(0, 20, (3, 5))
    mask = torch.tensor([[True] * 5, [True, True, False, False, False], [False] * 5])
    out = net(x, mask=mask)
    assert out.shape == (3, 3) and torch.isfinite(out).all()
    alone = net(x[1:2, :2])
    torch.testing.assert_close(out[1:2], alone, atol=1e-5, rtol=1e-5)
    if kind == "avg":
        assert bool((out[2] == 0).all())
    out.square().sum().backward()
    for name, p in net.named_parameters():
        assert p.grad is None or bool(torch.isfinite(p.grad).all()), name


def test_pooled_and_memory_tokens_match_x_transformers():
    """Memory tokens, class tokens and average pooling give x-transformers' outputs on the same weights."""
    for opts in (dict(num_memory_tokens=3), dict(use_cls_token=True, logits_dim=4), dict(average_pool_embed=True, logits_dim=4)):
        _seed(6)
        peer = xt.TransformerWrapper(num_tokens=20, max_seq_len=16, **opts,
                                     attn_layers=xt.Encoder(dim=16, depth=2, heads=2, attn_dim_head=8)).eval()
        base = {k: v for k, v in opts.items() if k == "logits_dim"}
        ours = sf.TransformerWrapper(num_tokens=20, max_seq_len=16, **opts,
                                     attn_layers=sf.Encoder(dim=16, depth=2, heads=2, dim_head=8)).eval()
        conv = sf.from_x_transformers(xt.TransformerWrapper(num_tokens=20, max_seq_len=16, **base,
                                      attn_layers=xt.Encoder(dim=16, depth=2, heads=2, attn_dim_head=8)))
        peer_base = {k: v for k, v in peer.state_dict().items() if "memory_tokens" not in k and "cls_token" not in k}
        shadow = xt.TransformerWrapper(num_tokens=20, max_seq_len=16, **base,
                                       attn_layers=xt.Encoder(dim=16, depth=2, heads=2, attn_dim_head=8))
        shadow.load_state_dict(peer_base)
        conv = sf.from_x_transformers(shadow)
        ours.load_state_dict(conv.state_dict(), strict=False)
        with torch.no_grad():
            if "num_memory_tokens" in opts:
                ours.memory_tokens.copy_(peer.memory_tokens)
            if "use_cls_token" in opts:
                ours.cls_token.copy_(peer.cls_token)
        x = torch.randint(0, 20, (2, 6))
        mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
        with torch.no_grad():
            a, b = ours(x, mask=mask), peer(x, mask=mask)
        if a.dim() == 3:
            a, b = a[mask], b[mask]
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=str(opts))


def test_l2norm_embed_and_tied_scale():
    """``l2norm_embed``: unit-norm token and position embeddings (a zero embedding row stays finite);
    ``tie_embedding_scale``: logits are ``h @ E.T * s``."""
    _seed(7)
    net = sf.TransformerWrapper(num_tokens=20, max_seq_len=16, l2norm_embed=True, tie_embedding=True,
                                tie_embedding_scale=0.25, attn_layers=sf.Encoder(dim=16, depth=1, heads=2, dim_head=8))
    with torch.no_grad():
        net.token_emb.weight[3] = 0.0
    x = torch.tensor([[1, 3, 5]])
    h = net(x, return_embeddings=True)
    torch.testing.assert_close(net(x), h @ net.token_emb.weight.t() * 0.25)
    emb = sf.nn.modules.l2norm(net.token_emb(x))
    torch.testing.assert_close(emb[0, [0, 2]].norm(dim=-1), torch.ones(2))
    assert bool((emb[0, 1] == 0).all())
    net(x).sum().backward()
    assert torch.isfinite(net.token_emb.weight.grad).all()
    assert sum(p.numel() for p in net.parameters()) == sum(p.numel() for p in net.attn_layers.parameters()) + 20 * 16 + 16 * 16


def test_pos_and_seq_start_pos():
    """``pos`` positions the tokens (x-transformers' shape rules: ``(n,)`` or ``(b, n)``), for the absolute
    embedding and rotary alike; ``seq_start_pos`` marks left padding, the same as the equivalent mask."""
    _seed(8)
    net = sf.TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=sf.Decoder(dim=16, depth=1, heads=2, dim_head=8))
    x = torch.randint(0, 20, (2, 5))
    torch.testing.assert_close(net(x, pos=torch.arange(5)), net(x))
    shifted = net(x, pos=torch.arange(5)[None].expand(2, 5) + 3)
    assert not torch.allclose(shifted, net(x))
    start = torch.tensor([0, 2])
    planted = x.clone()
    planted[1, :2] = 10**6  # outside the vocabulary, but before the start: padding
    left = torch.arange(5)[None] >= start[:, None]
    torch.testing.assert_close(net(planted, seq_start_pos=start)[left], net(x, mask=left)[left])
    peer = xt.TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=xt.Decoder(dim=16, depth=1, heads=2, attn_dim_head=8)).eval()
    conv = sf.from_x_transformers(peer).eval()
    with torch.no_grad():
        p = torch.tensor([[2, 3, 4, 5, 6], [0, 1, 2, 3, 4]])
        torch.testing.assert_close(conv(x, pos=p), peer(x, pos=p), atol=1e-5, rtol=1e-5)
        right = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
        s = torch.tensor([0, 0])
        torch.testing.assert_close(conv(x, mask=right, seq_start_pos=s)[right], peer(x, mask=right, seq_start_pos=s)[right],
                                   atol=1e-5, rtol=1e-5)


def test_explicit_attention_zero_length_keys_keeps_graph():
    """The explicit path with no keys: zero output and zero (not missing) gradients."""
    q = torch.randn(2, 2, 3, 8, requires_grad=True)
    k = torch.randn(2, 2, 0, 8, requires_grad=True)
    v = torch.randn(2, 2, 0, 8, requires_grad=True)
    out, w = _explicit_attention(q, k, v)
    assert out.shape == (2, 2, 3, 8) and w.shape == (2, 2, 3, 0) and bool((out == 0).all())
    out.sum().backward()
    assert q.grad is not None and bool((q.grad == 0).all())


def test_bad_option_values_raise_clear_errors():
    """S9 for the new options: each bad value names its argument."""
    enc = lambda **kw: sf.Encoder(dim=16, depth=1, heads=2, dim_head=8, **kw)  # noqa: E731
    wrap = lambda **kw: sf.TransformerWrapper(num_tokens=20, max_seq_len=8, attn_layers=enc(), **kw)  # noqa: E731
    cases = [
        (lambda: enc(attn_num_mem_kv=-1), ValueError, "num_mem_kv"),
        (lambda: enc(attn_num_mem_kv=1.5), ValueError, "num_mem_kv"),
        (lambda: enc(attn_softclamp_logits=True, attn_logit_softclamp_value=0.0), ValueError, "logit_softclamp_value"),
        (lambda: enc(attn_num_mem_kv=2, unpadded=True), ValueError, "unpadded"),
        (lambda: wrap(num_memory_tokens=-2), ValueError, "num_memory_tokens"),
        (lambda: wrap(use_cls_token=True, num_cls_tokens=0), ValueError, "num_cls_tokens"),
        (lambda: wrap(use_cls_token=True, average_pool_embed=True), ValueError, "average_pool_embed"),
        (lambda: wrap(tie_embedding_scale=0.5), ValueError, "tie_embedding_scale"),
        (lambda: wrap(tie_embedding=True, tie_embedding_scale=float("inf")), ValueError, "tie_embedding_scale"),
    ]
    net = wrap()
    x = torch.randint(0, 20, (2, 4))
    cases += [
        (lambda: net(x, pos=torch.arange(4.0)), TypeError, "pos"),
        (lambda: net(x, pos=torch.arange(5)), ValueError, "pos"),
        (lambda: net(x, pos=torch.arange(4) + 6), ValueError, "max_seq_len"),
        (lambda: net(x, pos=-torch.arange(4)), ValueError, "pos"),
        (lambda: net(x, seq_start_pos=torch.tensor([0])), ValueError, "seq_start_pos"),
        (lambda: net(x, seq_start_pos=torch.tensor([0.0, 1.0])), TypeError, "seq_start_pos"),
        (lambda: wrap(num_memory_tokens=2)(x, pos=torch.arange(4)), ValueError, "pos"),
    ]
    for call, exc, text in cases:
        with pytest.raises(exc, match=text):
            call()


def test_continuous_wrapper_memory_tokens_lens_and_pooling():
    """``ContinuousTransformerWrapper`` takes ``num_memory_tokens``, ``average_pool_embed``, ``lens`` and
    ``return_intermediates``: ``lens`` equals the right-padding mask, NaN beyond it changes nothing, each
    sample equals itself alone, a zero length pools to exactly the head of 0."""
    _seed(9)
    layers = sf.Encoder(dim=16, depth=2, heads=2, dim_head=8)
    net = sf.ContinuousTransformerWrapper(dim_in=4, dim_out=3, max_seq_len=8, num_memory_tokens=2, attn_layers=layers)
    x = torch.randn(3, 5, 4)
    lens = torch.tensor([5, 3, 0])
    mask = torch.arange(5)[None] < lens[:, None]
    planted = x.clone()
    planted[~mask] = NAN
    out, inter = net(planted, lens=lens, return_intermediates=True)
    torch.testing.assert_close(out, net(x, mask=mask))
    torch.testing.assert_close(out[1:2, :3], net(x[1:2, :3]), atol=1e-5, rtol=1e-5)
    assert inter.memory_tokens.shape == (3, 2, 16) and len(inter.attn_maps) == 2
    pooled = sf.ContinuousTransformerWrapper(dim_in=4, dim_out=3, max_seq_len=8, average_pool_embed=True, attn_layers=layers)
    p = pooled(planted, lens=lens)
    assert p.shape == (3, 3)
    torch.testing.assert_close(p[2], pooled.project_out(torch.zeros(16)))
    with pytest.raises(ValueError, match="lens"):
        net(x, lens=lens, mask=mask)


def test_xtransformer_per_side_options():
    """``XTransformer`` takes x-transformers' ``enc_<option>`` / ``dec_<option>`` spellings (layer and wrapper
    options, aliases included; a side's option overrides the shared one), saves and reloads them, and
    names an unknown one."""
    import tempfile

    _seed(10)
    base = dict(dim=32, enc_num_tokens=20, enc_depth=1, enc_heads=2, enc_max_seq_len=16, dec_num_tokens=20,
                dec_depth=1, dec_heads=2, dec_max_seq_len=16, dim_head=8)
    m = sf.XTransformer(**base, enc_attn_flash=True, dec_rotary_pos_emb=True, enc_num_memory_tokens=2,
                        dec_attn_dim_head=16, enc_ff_mult=2, dec_attn_num_mem_kv=1)
    assert m.decoder.net.attn_layers.rotary is not None and m.decoder.net.pos_emb is None
    assert m.encoder.num_memory_tokens == 2 and m.decoder.net.attn_layers.layers[0][1].dim_head == 16
    assert m.encoder.attn_layers.layers[0][1].dim_head == 8 and m.decoder.net.attn_layers.layers[0][1].num_mem_kv == 1
    src, tgt = torch.randint(0, 20, (2, 5)), torch.randint(0, 20, (2, 6))
    with tempfile.TemporaryDirectory() as d:
        m.save_pretrained(d)
        torch.testing.assert_close(sf.XTransformer.from_pretrained(d)(src, tgt), m(src, tgt))
    for bad, text in ((dict(enc_foo=1), "enc_foo"), (dict(dec_attn_dim_heads=3), "dec_attn_dim_head"),
                      (dict(bogus=1), "bogus"), (dict(enc_dim=3), "enc_dim")):
        with pytest.raises(TypeError, match=text):
            sf.XTransformer(**base, **bad)


def test_attention_layers_take_pos():
    """``AttentionLayers.forward(pos=...)`` is x-transformers' name for ``positions``; both at once is an error."""
    _seed(11)
    stack = sf.Decoder(dim=16, depth=1, heads=2, dim_head=8, rotary_pos_emb=True)
    x = torch.randn(2, 5, 16)
    p = torch.arange(5) + 3
    torch.testing.assert_close(stack(x, pos=p), stack(x, positions=p))
    with pytest.raises(ValueError, match="pos"):
        stack(x, pos=p, positions=p)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16], ids=["f64", "f16"])
def test_explicit_path_equals_attend(dtype):
    """The explicit path (attention maps, softclamp) gives ``attend``'s outputs and gradients: key padding,
    causal, GQA, a bias of -inf on a row and -1e9 (-inf in float16) on another, NaN at masked slots."""
    g = _seed(12)
    b, h, hkv, i, j, d = 3, 4, 2, 5, 6, 8
    mask = torch.rand(b, j, generator=g) > 0.3
    mask[0] = False
    bias = torch.randn(1, h, i, j, generator=g)
    bias[:, :, 1] = -float("inf")
    bias[:, :, 2] = -1e9
    q, k, v = (torch.randn(b, n, L, d, generator=g).to(dtype) for n, L in ((h, i), (hkv, j), (hkv, j)))
    k[~mask[:, None, :, None].expand_as(k)] = NAN
    v[~mask[:, None, :, None].expand_as(v)] = NAN
    outs = []
    for fn in (lambda *t: sf.attend(*t, mask=mask, causal=True, bias=bias, backend="reference"),
               lambda *t: _explicit_attention(*t, mask=mask, causal=True, bias=bias)[0]):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.float().square().sum().backward()
        outs.append((out, [t.grad for t in leaves]))
    tol = 1e-10 if dtype == torch.float64 else 2e-3
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=tol, rtol=tol)
    for a, e in zip(outs[1][1], outs[0][1]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, e, atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------------------
# gated attention: gate_values, output_gate (per feature, per head, low rank), swiglu_values
# ---------------------------------------------------------------------------------------------------

GATE_CONFIGS = [(False, None), (False, 8), (True, None)]  # (headwise, rank), x-transformers' test grid


@pytest.mark.parametrize("x_gate", GATE_CONFIGS, ids=["x-dim", "x-rank8", "x-head"])
@pytest.mark.parametrize("h_gate", GATE_CONFIGS + [None], ids=["h-dim", "h-rank8", "h-head", "no-h"])
@pytest.mark.parametrize("swiglu", [False, True], ids=["sigmoid", "silu"])
def test_gated_attention_matches_x_transformers(x_gate, h_gate, swiglu):
    """``Attention(gate_values=..., output_gate=..., swiglu_values=...)`` equals x-transformers' module on the
    same weights (its state dict loads as is); padded queries and NaN planted there change nothing."""
    import importlib

    xx = importlib.import_module("x_transformers.x_transformers")
    kw = dict(gate_values=True, gate_values_headwise=x_gate[0], gate_values_rank=x_gate[1], swiglu_values=swiglu)
    if h_gate is not None:
        kw.update(output_gate=True, output_gate_headwise=h_gate[0], output_gate_rank=h_gate[1])
    _seed(0)
    theirs = xx.Attention(dim=32, heads=4, dim_head=8, causal=True, **kw).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    ours = sf.Attention(32, heads=4, dim_head=8, causal=True, **kw).double()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    hp.assert_close(ours(x), theirs(x), f"gated {kw}", torch.float32)  # x-transformers softmaxes in float32
    pad = torch.tensor([[True] * 6, [False, False, True, True, True, True]])
    clean = ours(x, mask=pad)
    dirty = x.clone()
    dirty[~pad] = NAN
    dirty.requires_grad_()
    out = ours(dirty, mask=pad)
    hp.assert_bitwise(out, clean, "NaN at padded positions changes nothing")
    assert bool(out[~pad].eq(0).all())
    out.sum().backward()
    assert bool(torch.isfinite(dirty.grad).all()) and bool(dirty.grad[~pad].eq(0).all())


def test_gated_attention_dropped_context_is_an_exact_no_op_and_options_are_checked():
    _seed(0)
    attn = sf.Attention(16, heads=2, dim_head=8, dim_context=12, gate_values=True, output_gate=True)
    for gate in (attn.to_v_gate, attn.to_output_gate):
        torch.nn.init.normal_(gate.weight)
    x, ctx = torch.randn(2, 3, 16), torch.randn(2, 4, 12)
    out = attn(x, ctx, context_mask=torch.tensor([[True] * 4, [False] * 4]))
    assert bool(out[1].eq(0).all()) and bool(torch.isfinite(out).all())
    with pytest.raises(ValueError, match="gate_values_rank"):
        sf.Attention(16, gate_values=True, gate_values_rank=4, gate_values_headwise=True)
    with pytest.raises(ValueError, match="output_gate"):
        sf.Attention(16, output_gate_headwise=True)
    with pytest.raises(ValueError, match="swiglu_values"):
        sf.Attention(16, swiglu_values=True)
    dec = sf.Decoder(dim=16, depth=1, heads=2, dim_head=8, attn_gate_values=True, attn_output_gate=True,
                     attn_output_gate_rank=4)
    again = sf.Decoder.from_config(dec.get_config())
    assert again.layers[0].mixer.to_output_gate.up.weight.shape == (16, 4)
