"""``from_x_transformers`` dispatches x-transformers' other wrappers to their converters: the one entry
point returns the safeformer twin, whose outputs equal the original's on the same weights."""

from __future__ import annotations

import helpers as hp
import pytest
import torch

import safeformer as sf

xt = pytest.importorskip("x_transformers")


def _decoder(dim=16):
    return xt.Decoder(dim=dim, depth=1, heads=2, attn_dim_head=8, rotary_pos_emb=True)


def test_neo_mlp():
    torch.manual_seed(0)
    ref = xt.NeoMLP(dim_in=3, dim_hidden=4, dim_out=2, dim_model=16, depth=1).eval()
    ours = sf.from_x_transformers(ref)
    assert isinstance(ours, sf.NeoMLP)
    x = torch.randn(5, 3)
    hp.assert_close(ours.eval()(x), ref(x), "NeoMLP output", torch.float32)


def test_multi_input():
    torch.manual_seed(0)
    ref = xt.MultiInputTransformerWrapper(num_tokens=dict(a=7, b=5), max_seq_len=12, attn_layers=_decoder()).eval()
    ours = sf.from_x_transformers(ref)
    assert isinstance(ours, sf.MultiInputTransformerWrapper)
    x = dict(a=torch.randint(0, 7, (2, 6)), b=torch.randint(0, 5, (2, 6)))
    out, expected = ours.eval()(x), ref(x)
    for k in expected:
        hp.assert_close(out[k], expected[k], f"logits {k}", torch.float32)


def test_xval_and_dpo_dispatch():
    torch.manual_seed(0)
    xv = xt.XValTransformerWrapper(num_tokens=9, numerical_token_id=8, max_seq_len=12, attn_layers=_decoder())
    assert isinstance(sf.from_x_transformers(xv), sf.XValTransformerWrapper)
    xa = xt.XValAutoregressiveWrapper(xv)
    assert isinstance(sf.from_x_transformers(xa), sf.XValAutoregressiveWrapper)
    net = xt.TransformerWrapper(num_tokens=9, max_seq_len=12, attn_layers=_decoder())
    assert isinstance(sf.from_x_transformers(xt.DPO(net, beta=0.1, pad_id=0)), sf.DPO)


def test_entropy_tokenizer():
    torch.manual_seed(0)
    net = xt.TransformerWrapper(num_tokens=9, max_seq_len=16, attn_layers=_decoder())
    ref = xt.EntropyBasedTokenizer(net, entropy_threshold=1.5)
    ours = sf.from_x_transformers(ref)
    assert isinstance(ours, sf.EntropyBasedTokenizer)
    seq = torch.randint(0, 9, (2, 10))
    assert torch.equal(ours(seq), ref(seq))


def test_latent_and_belief_wrappers_dispatch():
    torch.manual_seed(0)
    fwd = xt.TransformerWrapper(num_tokens=9, max_seq_len=12, attn_layers=_decoder())
    assert isinstance(sf.from_x_transformers(xt.BeliefStateWrapper(fwd)), sf.BeliefStateWrapper)
    net = xt.TransformerWrapper(num_tokens=9, max_seq_len=12, attn_layers=_decoder())
    assert isinstance(sf.from_x_transformers(xt.NextLatentWrapper(net, dim=16)), sf.NextLatentWrapper)
    from x_transformers.gpt_vae import GPTVAE as XGPTVAE

    vae = XGPTVAE(num_tokens=9, dim=16, depth=1, enc_depth=1, max_seq_len=12, dim_latent=4, heads=2, attn_dim_head=8)
    assert isinstance(sf.from_x_transformers(vae), sf.GPTVAE)
