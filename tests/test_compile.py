"""``torch.compile(fullgraph=True)`` traces the model doors whole: no graph break, no host sync, and the
compiled forward equals the eager one (padding, a padded context with a dropped row, an adaptive condition)."""

from __future__ import annotations

import helpers as hp
import pytest
import torch

import safeformer as sf


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["tokens", "continuous"])
def test_wrapper_forward_compiles_fullgraph(wrapper):
    torch.manual_seed(0)
    layers = sf.Decoder(dim=32, depth=1, heads=2, dim_head=16, rotary_pos_emb=True, cross_attend=True,
                        use_adaptive_layernorm=True, dim_condition=8, unpadded=False)
    if wrapper == "tokens":
        net = sf.TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=layers).eval()
        x = torch.randint(0, 20, (3, 7))
    else:
        net = sf.ContinuousTransformerWrapper(dim_in=5, dim_out=5, max_seq_len=16, attn_layers=layers).eval()
        x = torch.randn(3, 7, 5)
    mask = torch.arange(7)[None] >= torch.tensor([[0], [3], [6]])
    ctx = torch.randn(3, 4, 32)
    ctx_mask = torch.tensor([[True, True, False, False], [False] * 4, [True] * 4])
    kw = dict(mask=mask, context=ctx, context_mask=ctx_mask, condition=torch.randn(3, 8))
    compiled = torch.compile(net, fullgraph=True)
    with torch.no_grad():
        hp.assert_close(compiled(x, **kw), net(x, **kw), "compiled forward")
