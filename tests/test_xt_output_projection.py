"""x-transformers' output-projection keywords: ``project_out`` (and its default: one head of width ``dim`` has no
projection), ``on_attn`` (a GLU-gated projection) and ``value_dim_head`` (values of another width than the queries
and keys): the same module tree, strict loads both ways, and the same numbers on the same weights on right-padded
inputs; padded content reaches nothing; checkpoints of earlier formats keep their projection."""

from __future__ import annotations

import json

import pytest
import torch

import safeformer as sf

xt = pytest.importorskip("x_transformers")

CASES = {
    "one_head_no_projection": dict(heads=1, attn_dim_head=16),
    "project_out_false": dict(heads=2, attn_dim_head=8, attn_project_out=False),
    "project_out_true_one_head": dict(heads=1, attn_dim_head=16, attn_project_out=True),
    "on_attn": dict(heads=2, attn_dim_head=8, attn_on_attn=True),
    "on_attn_one_head": dict(heads=1, attn_dim_head=16, attn_on_attn=True),
    "value_dim_head": dict(heads=2, attn_dim_head=8, attn_value_dim_head=12),
    "value_dim_head_gqa_gates": dict(heads=4, attn_dim_head=8, attn_value_dim_head=6, attn_kv_heads=2,
                                     attn_gate_values=True, attn_output_gate=True),
    "value_dim_head_on_attn_rotary": dict(heads=2, attn_dim_head=8, attn_value_dim_head=4, attn_on_attn=True,
                                          rotary_pos_emb=True),
    "value_dim_head_cross": dict(heads=2, attn_dim_head=8, attn_value_dim_head=12, cross_attend=True),
}


def _pair(opts: dict):
    torch.manual_seed(0)
    theirs = xt.TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=xt.Decoder(dim=16, depth=2, **opts))
    ours = sf.TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=sf.Decoder(dim=16, depth=2, **opts))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    ours.load_state_dict(theirs.state_dict(), strict=True)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return theirs.eval(), ours.eval()


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_module_tree_and_numbers_as_x_transformers(name):
    opts = CASES[name]
    theirs, ours = _pair(opts)
    x = torch.randint(0, 20, (3, 7))
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3, [True] * 2 + [False] * 5])
    kw = {}
    if opts.get("cross_attend"):
        kw = dict(context=torch.randn(3, 5, 16), context_mask=torch.tensor([[True] * 5, [True] * 3 + [False] * 2,
                                                                            [True] + [False] * 4]))
    ref = theirs(x, mask=mask, **kw)
    out = ours(x, mask=mask, **kw)
    torch.testing.assert_close(out[mask], ref[mask], atol=1e-5, rtol=1e-5)
    up = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2)) * mask[..., None]
    (ref * up).sum().backward()
    (out * up).sum().backward()
    torch.testing.assert_close(ours.token_emb.weight.grad, theirs.token_emb.emb.weight.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["one_head_no_projection", "on_attn", "value_dim_head"])
def test_padding_reaches_nothing_and_a_padded_sample_equals_itself_alone(name):
    _, ours = _pair(CASES[name])
    x = torch.randint(0, 20, (2, 6))
    mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    emb = ours.token_emb(x).detach()
    emb[~mask] = float("nan")
    net = ours.attn_layers
    emb.requires_grad_()
    out = net(emb, mask=mask)
    assert torch.isfinite(out[mask]).all()
    out[mask].sum().backward()
    assert torch.isfinite(emb.grad).all() and (emb.grad[~mask] == 0).all()
    alone = net(emb[1:2, :3].detach())
    torch.testing.assert_close(out[1:2, :3].detach(), alone, atol=1e-5, rtol=1e-5)


def test_value_dim_head_decodes_cached_as_uncached():
    _, ours = _pair(CASES["value_dim_head"])
    wrapper = sf.AutoregressiveWrapper(ours)
    prompt = torch.randint(0, 20, (2, 3))
    cached = wrapper.generate(prompt, 4, temperature=0.0)
    uncached = wrapper.generate(prompt, 4, temperature=0.0, cache_kv=False)
    assert torch.equal(cached, uncached)


def test_bare_attention_keywords():
    one = sf.Attention(16, dim_head=16, heads=1)
    assert isinstance(one.to_out, torch.nn.Identity) and one.out_bias is None and len(one.muon_parameters()) == 1
    # one head of another width keeps its projection (x-transformers' identity would not fit the residual)
    assert isinstance(sf.Attention(16, dim_head=8, heads=1).to_out, torch.nn.Linear)
    glu = sf.Attention(16, dim_head=8, heads=2, on_attn=True, bias=True)
    assert glu.to_out[0].out_features == 32 and glu.out_bias is not None
    x = torch.randn(2, 4, 16)
    mask = torch.tensor([[True] * 4, [False] * 4])
    out = glu(x, context=x, context_mask=mask)
    assert (out[1] == 0).all()  # a dead row stays 0 through the gated projection's bias
    v = sf.Attention(16, dim_head=8, heads=2, value_dim_head=5)
    assert v.to_v.out_features == 10 and v.to_out.in_features == 10
    out, inter = v(x, return_intermediates=True)
    assert inter.cached_kv[1].shape[-1] == 5
    more = v(x[:, :1], cache=inter)
    assert more.shape == (2, 1, 16)


@pytest.mark.parametrize("kw,exc,word", [
    (dict(heads=1, dim_head=8, project_out=False), ValueError, "project_out"),
    (dict(heads=2, project_out="yes"), TypeError, "project_out"),
    (dict(heads=2, on_attn=True, project_out=False), ValueError, "on_attn"),
    (dict(heads=2, on_attn=1), TypeError, "on_attn"),
    (dict(heads=2, value_dim_head=0), ValueError, "value_dim_head"),
    (dict(heads=2, value_dim_head=2.5), ValueError, "value_dim_head"),
    (dict(heads=2, value_dim_head=4, hybrid_module=torch.nn.GRU(16, 16, batch_first=True)), ValueError,
     "value_dim_head"),
    (dict(heads=1, dim_head=16, zero_init_output=True), ValueError, "zero_init_output"),
])
def test_bad_values_are_named(kw, exc, word):
    with pytest.raises(exc, match=word):
        sf.Attention(16, **kw)


def test_earlier_checkpoints_keep_their_output_projection(tmp_path):
    """A format-2 checkpoint of a one-head model (which then had a projection) loads with it, same outputs."""
    torch.manual_seed(0)
    model = sf.TransformerWrapper(num_tokens=20, max_seq_len=8,
                                  attn_layers=sf.Decoder(dim=16, depth=1, heads=1, attn_dim_head=16,
                                                         attn_project_out=True))
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["version"] == 3
    cfg["version"] = 2
    del cfg["config"]["attn_layers"]["config"]["attn_project_out"]  # what format 2 wrote
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = sf.TransformerWrapper.from_pretrained(tmp_path)
    assert isinstance(loaded.attn_layers.layers[0][1].to_out, torch.nn.Linear)
    x = torch.randint(0, 20, (2, 5))
    torch.testing.assert_close(loaded(x), model(x))


@pytest.mark.parametrize("name", ["one_head_no_projection", "on_attn", "value_dim_head_gqa_gates",
                                  "value_dim_head_on_attn_rotary", "value_dim_head_cross"])
def test_from_x_transformers_converts_them(name):
    opts = CASES[name]
    theirs, _ = _pair(opts)
    ours = sf.from_x_transformers(theirs)
    x = torch.randint(0, 20, (2, 6))
    mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    kw = dict(context=torch.randn(2, 4, 16)) if opts.get("cross_attend") else {}
    torch.testing.assert_close(ours(x, mask=mask, **kw)[mask], theirs(x, mask=mask, **kw)[mask], atol=1e-5, rtol=1e-5)
