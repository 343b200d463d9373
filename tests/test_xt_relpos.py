"""T5's relative position bias (x-transformers' ``rel_pos_bias``): the module equals x-transformers' bit for bit,
the stack reads distances from the real tokens' positions (left padding changes nothing), and the bias is
safe under masks, with the KV cache and on the unpadded path."""

import pytest
import torch

import safeformer as sf
from safeformer.nn.relative_position import RelativePositionBias

KW = dict(dim=32, depth=2, heads=4, dim_head=8, rel_pos_bias=True, rel_pos_num_buckets=8, rel_pos_max_distance=20)


def _stack(causal=True, **kw):
    torch.manual_seed(0)
    s = (sf.Decoder if causal else sf.Encoder)(**{**KW, **kw}).eval()
    with torch.no_grad():
        s.rel_pos.relative_attention_bias.weight.normal_()
    return s


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("buckets,dist", [(32, 128), (8, 20)])
def test_module_equals_x_transformers(causal, buckets, dist):
    X = pytest.importorskip("x_transformers.x_transformers")
    theirs = X.RelativePositionBias(scale=8.0, causal=causal, num_buckets=buckets, max_distance=dist, heads=4)
    ours = RelativePositionBias(8.0, causal, buckets, dist, 4)
    ours.load_state_dict(theirs.state_dict())
    for i, j in ((7, 7), (3, 300), (1, 50)):
        assert torch.equal(ours(i, j), theirs(i, j))


def test_bias_matches_float64_formula():
    rp = RelativePositionBias(2.0, causal=False, num_buckets=8, max_distance=20, heads=2)
    q, k = torch.tensor([[0, 3, 9]]), torch.tensor([[0, 1, 2, 30]])
    got = rp.bias(q, k)
    for a in range(3):
        for c in range(4):
            n = -(int(k[0, c]) - int(q[0, a]))  # T5: the bucket of -(key - query)
            half = 4
            bucket = (half if n < 0 else 0)
            n = abs(n)
            if n < 2:
                bucket += n
            else:
                import math
                bucket += min(2 + int(math.log(n / 2) / math.log(20 / 2) * 2), 3)
            torch.testing.assert_close(got[0, :, a, c], rp.relative_attention_bias.weight[bucket] * 2.0)


@pytest.mark.parametrize("causal", [False, True])
def test_padding_changes_nothing_and_nan_stays_out(causal):
    s = _stack(causal)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 5, 32, generator=g)
    alone = s(x)
    padded = torch.full((2, 8, 32), float("nan"))
    padded[0, 3:] = x[0]  # left padding
    padded[1, :5] = x[0]  # right padding
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, 3:] = True
    mask[1, :5] = True
    padded.requires_grad_()
    out = s(padded, mask=mask)
    out.sum().backward()
    torch.testing.assert_close(out[0, 3:], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1, :5], alone[0], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(padded.grad).all() and (padded.grad[~mask] == 0).all()


def test_cache_and_unpadded_equal_the_padded_forward():
    s = _stack(True)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 7, 32, generator=g)
    mask = torch.tensor([[True] * 7, [False] * 3 + [True] * 4])
    full = s(x, mask=mask)  # unpadded='auto': 1 of 14 positions is padding, the padded path
    h, cache = s(x[:, :5], mask=mask[:, :5], return_cache=True)
    step, cache = s(x[:, 5:6], mask=mask[:, 5:6], cache=cache, return_cache=True)
    step2 = s(x[:, 6:], mask=mask[:, 6:], cache=cache)
    got = torch.cat((h, step, step2), dim=1)
    torch.testing.assert_close(got[mask], full[mask], rtol=1e-5, atol=1e-5)
    s.unpadded = True  # the real tokens only (packed)
    torch.testing.assert_close(s(x, mask=mask)[mask], full[mask], rtol=1e-5, atol=1e-5)


def test_refusals():
    with pytest.raises(ValueError, match="rel_pos_bias"):
        sf.Decoder(dim=32, depth=1, rel_pos_bias=True, alibi_pos_bias=True)
    with pytest.raises(ValueError, match="num_buckets"):
        RelativePositionBias(1.0, num_buckets=2)


def test_generation_on_the_static_step_matches_recomputing():
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=20, max_seq_len=32, use_abs_pos_emb=False,
                                attn_layers=sf.Decoder(**KW)).eval()
    from safeformer.decoding.static import static_reason
    assert static_reason(net) is None  # the step reads T5's bias at the slots' positions
    prompt = torch.randint(0, 20, (2, 4))
    cached = sf.AutoregressiveWrapper(net).generate(prompt, 6, temperature=0.0)
    plain = sf.AutoregressiveWrapper(net).generate(prompt, 6, temperature=0.0, cache_kv=False)
    assert torch.equal(cached, plain)


def test_position_biases_survive_a_checkpoint(tmp_path):
    """T5 buckets and custom ALiBi slopes are rebuilt from the config (slopes checked on the CPU, not on the
    meta device the loader builds on)."""
    for kw in (dict(rel_pos_bias=True, rel_pos_num_buckets=8, rel_pos_max_distance=20),
               dict(alibi_pos_bias=True, rel_pos_kwargs=dict(slopes=[0.5, 0.25]))):
        torch.manual_seed(0)
        m = sf.TransformerWrapper(num_tokens=20, max_seq_len=8, use_abs_pos_emb=False,
                                  attn_layers=sf.Decoder(dim=16, depth=1, heads=2, dim_head=8, **kw)).eval()
        m.save_pretrained(tmp_path / "m")
        back = sf.TransformerWrapper.from_pretrained(tmp_path / "m").eval()
        x = torch.randint(0, 20, (2, 5))
        assert torch.equal(back(x), m(x))
