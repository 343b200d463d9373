"""Four places where safeformer parted from x-transformers 2.31.10 on the same weights, each compared against
x-transformers itself (weights perturbed off their init, a right-padded batch, outputs at real positions and every
gradient):

- ``residual_attn`` beside memory keys (``attn_num_mem_kv``) and a learned sink (``attn_head_learned_sink``): the
  logits handed to the next attention leave the sink's column out; each attention's sink keeps its own logit.
  x-transformers 2.31.10 fails on the sink there (it hands on the sink's column and adds it to logits one column
  narrower), so the sink cases are compared against x-transformers with that column dropped from ``prev_attn``.
- ``attn_qk_norm`` with ``attn_qk_rmsnorm`` / ``attn_k_rmsnorm``: the RMS norm after the L2 norm is x-transformers'
  ``F.normalize(x) * sqrt(d)`` (its epsilon no longer shows), float64 to 1e-9.
- ``from_x_transformers`` of PoPE with another base (or edited frequencies) and of edited rotary frequencies: the
  ``inv_freq`` buffers are copied.
- ``RotaryEmbedding`` reads its (loaded) ``inv_freq`` buffer, so a checkpoint with a rescaled base gives
  x-transformers' numbers; the constructor's frequencies are still computed in the model's dtype (float64 exact).

Shape legend: b batch, n positions, c model width.
"""

from __future__ import annotations

import pytest
import torch
import x_transformers as xt
from helpers import check_padded_equals_alone, perturb_params
from x_transformers.attend import Attend as XAttend
from x_transformers.x_transformers import PolarEmbedding as XPolar

import safeformer as sf
from safeformer.nn.modules import RotaryEmbedding

DIM, HEADS, DIM_HEAD, VOCAB, N = 16, 2, 8, 20, 9
MASK = torch.tensor([[True] * N, [True] * 6 + [False] * (N - 6)])  # right padding

pytestmark = pytest.mark.usefixtures("one_thread")


def _pair(dtype: torch.dtype = torch.float32, seed: int = 0, **layer_kw):
    """``(ours, peer)``: x-transformers' decoder LM with ``layer_kw`` (weights perturbed), safeformer's on the same
    weights (strict loads both ways), both in ``dtype``."""
    torch.manual_seed(seed)
    peer = xt.TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, attn_layers=xt.Decoder(
        dim=DIM, depth=3, heads=HEADS, attn_dim_head=DIM_HEAD, **layer_kw))
    perturb_params(peer, seed, 0.2)
    ours = sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, attn_layers=sf.Decoder(
        dim=DIM, depth=3, heads=HEADS, attn_dim_head=DIM_HEAD, **layer_kw))
    ours.load_state_dict(peer.state_dict(), strict=True)
    peer.load_state_dict(ours.state_dict(), strict=True)
    return ours.to(dtype).eval(), peer.to(dtype).eval()


def _run(model, mask: torch.Tensor = MASK, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(logits at real positions, {name: gradient})`` of ``model`` on seeded tokens, the upstream gradient at real
    positions only (x-transformers' padded positions read padding)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, mask.shape, generator=g)
    dtype = next(model.parameters()).dtype
    upstream = torch.randn(*mask.shape, VOCAB, generator=g, dtype=torch.float64).to(dtype) * mask[..., None]
    model.zero_grad()
    out = model(tokens, mask=mask)
    (out * upstream).sum().backward()
    return out.detach()[mask], {n: p.grad for n, p in model.named_parameters() if p.grad is not None and p.grad.any()}


def _compare(ours, peer, atol: float = 1e-5, mask: torch.Tensor = MASK) -> None:
    """The same logits at real positions and the same gradient of every parameter."""
    (got, ours_g), (want, peer_g) = _run(ours, mask), _run(peer, mask)
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    assert ours_g.keys() == peer_g.keys()
    for name, grad in ours_g.items():
        torch.testing.assert_close(grad, peer_g[name], atol=atol, rtol=atol, msg=lambda m, n=name: f"{n}: {m}")


def _x_drops_sink_column(monkeypatch) -> None:
    """x-transformers' ``Attend`` with the sink's column of ``prev_attn`` dropped: residual attention as safeformer
    defines it beside a sink (x-transformers 2.31.10 itself fails there)."""
    orig = XAttend.forward

    def forward(self, q, k, v, mask=None, attn_bias=None, prev_attn=None, **kwargs):
        if prev_attn is not None and self.head_learned_sink:
            prev_attn = prev_attn[..., 1:]
        return orig(self, q, k, v, mask=mask, attn_bias=attn_bias, prev_attn=prev_attn, **kwargs)

    monkeypatch.setattr(XAttend, "forward", forward)


# ---------------------------------------------------------------------------------------------------------------
# residual attention beside memory keys and a learned sink
# ---------------------------------------------------------------------------------------------------------------

EXTRA_KEYS = {
    "memory": dict(attn_num_mem_kv=2),
    "sink": dict(attn_head_learned_sink=True),
    "memory+sink": dict(attn_num_mem_kv=2, attn_head_learned_sink=True),
    "zero+memory+sink": dict(attn_add_zero_kv=True, attn_num_mem_kv=1, attn_head_learned_sink=True),
}


@pytest.mark.parametrize("name", list(EXTRA_KEYS))
def test_residual_attention_with_memory_keys_and_sink_matches_x_transformers(name, monkeypatch):
    kw = dict(EXTRA_KEYS[name], residual_attn=True)
    ours, peer = _pair(**kw)
    with torch.no_grad():  # sinks off zero, so that a sink column added where it should not be shows
        for m in (ours, peer):
            for n, p in m.named_parameters():
                if n.endswith("head_attn_sink"):
                    p.copy_(torch.tensor([1.5, -0.7]))
    if "sink" in name:
        with pytest.raises(RuntimeError, match="size of tensor"):  # x-transformers 2.31.10: the widths differ
            peer(torch.randint(0, VOCAB, (2, N)), mask=MASK)
        _x_drops_sink_column(monkeypatch)
    _compare(ours, peer)


@pytest.mark.parametrize("causal", [True, False])
def test_residual_attention_with_sink_keeps_padding_out(causal):
    """NaN at every padded position (left, inner, right, a fully padded sample): finite outputs and gradients,
    padded positions 0, each sample equal to itself alone."""
    torch.manual_seed(0)
    cls = sf.Decoder if causal else sf.Encoder
    stack = perturb_params(cls(dim=DIM, depth=3, heads=HEADS, dim_head=DIM_HEAD, residual_attn=True,
                               attn_num_mem_kv=2, attn_head_learned_sink=True), 0, 0.2).eval()
    mask = torch.tensor([[False, False] + [True] * 5, [True, True, False, True, True, False, False], [False] * 7])
    check_padded_equals_alone(stack, DIM, mask)


def test_residual_attention_with_sink_decodes_from_the_cache_as_the_full_forward():
    ours, _ = _pair(residual_attn=True, attn_num_mem_kv=2, attn_head_learned_sink=True)
    torch.manual_seed(4)
    tokens = torch.randint(0, VOCAB, (2, 6))
    mask = torch.tensor([[False, True, True, True, True, True], [True] * 6])  # left padding
    with torch.no_grad():
        full = ours(tokens, mask=mask)
        out, cache = ours(tokens[:, :3], mask=mask[:, :3], return_cache=True)
        outs = [out]
        for t in range(3, 6):
            out, cache = ours(tokens[:, t: t + 1], mask=mask[:, t: t + 1], cache=cache, return_cache=True)
            outs.append(out)
    got = torch.cat(outs, dim=1)
    torch.testing.assert_close(got[mask], full[mask], atol=1e-5, rtol=1e-5)
    gen = sf.AutoregressiveWrapper(ours)
    cached = gen.generate(tokens[:, :4], 4, mask=mask[:, :4], temperature=0.0, cache_kv=True)
    uncached = gen.generate(tokens[:, :4], 4, mask=mask[:, :4], temperature=0.0, cache_kv=False)
    assert torch.equal(cached, uncached)


# ---------------------------------------------------------------------------------------------------------------
# qk_norm with the RMS norms after it
# ---------------------------------------------------------------------------------------------------------------

QK_RMS = {
    "qk": dict(attn_qk_rmsnorm=True),
    "k": dict(attn_k_rmsnorm=True),
    "qk+groups": dict(attn_qk_rmsnorm=True, attn_qk_norm_groups=2),
    "qk+dim_scale": dict(attn_qk_rmsnorm=True, attn_qk_norm_dim_scale=True),
    "qk+gqa+memory": dict(attn_qk_rmsnorm=True, attn_kv_heads=1, attn_num_mem_kv=2),
}


@pytest.mark.parametrize("name", list(QK_RMS))
def test_qk_norm_with_rmsnorm_matches_x_transformers_in_float64(name):
    """With qk_norm x-transformers' softmax runs in the model's dtype: float64 agrees to rounding (the RMS norm's
    epsilon used to show as ~1e-5 in the gradients)."""
    ours, peer = _pair(torch.float64, attn_qk_norm=True, **QK_RMS[name])
    with torch.no_grad():  # the RMS gains off their init
        for m in (ours, peer):
            g = torch.Generator().manual_seed(2)
            for n, p in m.named_parameters():
                if "rmsnorm" in n:
                    p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    _compare(ours, peer, atol=1e-9)


def test_qk_norm_with_rmsnorm_in_float32_as_x_transformers():
    """float32: the logits as x-transformers' at 1e-5; the gradients as close to the float64 ones as x-transformers'
    float32 gradients are (the logits reach ~qk_norm_scale * dim_head, and x-transformers' own float32 gradients
    are ~1e-4 off its float64 ones, so 1e-5 between two float32 runs would measure rounding, not the math)."""
    kw = dict(attn_qk_norm=True, attn_qk_rmsnorm=True)
    ours, peer = _pair(**kw)
    truth = _run(_pair(torch.float64, **kw)[1])
    (got, ours_g), (want, peer_g) = _run(ours), _run(peer)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert ours_g.keys() == peer_g.keys() == truth[1].keys()
    ours_err = max((g.double() - truth[1][n]).abs().max().item() for n, g in ours_g.items())
    peer_err = max((g.double() - truth[1][n]).abs().max().item() for n, g in peer_g.items())
    assert ours_err <= 2 * peer_err + 1e-6, (ours_err, peer_err)


# ---------------------------------------------------------------------------------------------------------------
# from_x_transformers: PoPE with another base, edited rotary frequencies
# ---------------------------------------------------------------------------------------------------------------

def _xt_lm(**layer_kw):
    torch.manual_seed(0)
    return perturb_params(xt.TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, attn_layers=xt.Decoder(
        dim=DIM, depth=2, heads=HEADS, attn_dim_head=DIM_HEAD, **layer_kw)), 0, 0.2).eval()


def _converted_matches(peer) -> sf.TransformerWrapper:
    ours = sf.from_x_transformers(peer)
    _compare(ours, peer)
    peer.load_state_dict(ours.state_dict(), strict=True)  # and back
    # a padded sample equals itself alone, whatever tokens sit in its padding
    tokens = torch.randint(0, VOCAB, MASK.shape)
    with torch.no_grad():
        both = ours(tokens, mask=MASK)
        alone = ours(tokens[1:, :6])
    torch.testing.assert_close(both[1, :6], alone[0], atol=1e-5, rtol=1e-5)
    return ours


def test_from_x_transformers_converts_polar_with_another_base():
    peer = _xt_lm(polar_pos_emb=True)
    pope = XPolar(DIM_HEAD, HEADS, base=500)
    with torch.no_grad():
        pope.learned_bias.uniform_(-6.0, 0.0)
    peer.attn_layers.polar_pos_emb = pope
    ours = _converted_matches(peer)
    assert torch.equal(ours.attn_layers.polar_pos_emb.inv_freq, pope.inv_freq)
    with torch.no_grad():  # and frequencies of no single base
        pope.inv_freq.mul_(torch.linspace(0.5, 3.0, DIM_HEAD))
    _converted_matches(peer)


def test_from_x_transformers_converts_edited_rotary_frequencies():
    peer = _xt_lm(rotary_pos_emb=True, rotary_emb_dim=DIM_HEAD)
    with torch.no_grad():
        peer.attn_layers.rotary_pos_emb.inv_freq.mul_(torch.linspace(0.4, 2.5, DIM_HEAD // 2))
    ours = _converted_matches(peer)
    assert torch.equal(ours.attn_layers.rotary_pos_emb.inv_freq, peer.attn_layers.rotary_pos_emb.inv_freq)


def test_from_x_transformers_refuses_non_finite_frequencies():
    peer = _xt_lm(polar_pos_emb=True)
    with torch.no_grad():
        peer.attn_layers.polar_pos_emb.inv_freq[2] = float("nan")
    with pytest.raises(ValueError, match="polar_pos_emb with non-finite frequencies"):
        sf.from_x_transformers(peer)


# ---------------------------------------------------------------------------------------------------------------
# RotaryEmbedding reads its inv_freq buffer
# ---------------------------------------------------------------------------------------------------------------

def test_rotary_reads_a_loaded_rescaled_base():
    """An x-transformers checkpoint built with ``rotary_base_rescale_factor`` loaded into a model built without it:
    x-transformers' numbers, on the padded forward and on the KV cache."""
    torch.manual_seed(0)
    kw = dict(dim=DIM, depth=2, heads=HEADS, attn_dim_head=DIM_HEAD, rotary_pos_emb=True, rotary_emb_dim=DIM_HEAD)
    peer = perturb_params(xt.TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, attn_layers=xt.Decoder(
        rotary_base_rescale_factor=8.0, **kw)), 0, 0.2).eval()
    ours = sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, attn_layers=sf.Decoder(**kw)).eval()
    assert not torch.equal(ours.attn_layers.rotary_pos_emb.inv_freq, peer.attn_layers.rotary_pos_emb.inv_freq)
    ours.load_state_dict(peer.state_dict(), strict=True)
    _compare(ours, peer)
    gen = sf.AutoregressiveWrapper(ours)
    prompts = torch.randint(0, VOCAB, (2, 5))
    mask = torch.tensor([[False, False, True, True, True], [True] * 5])
    cached = gen.generate(prompts, 5, mask=mask, temperature=0.0, cache_kv=True)
    assert torch.equal(cached, gen.generate(prompts, 5, mask=mask, temperature=0.0, cache_kv=False))


def test_rotary_edited_frequencies_and_precision():
    """Edited frequencies are read as they are; the constructor's are computed in the requested dtype (float64
    exactly, as before), also when the buffer was cast to float64 or below float32."""
    pos = torch.arange(3000)[None]
    module = RotaryEmbedding(DIM_HEAD, theta=500.0)
    exact64 = 1.0 / (500.0 ** (torch.arange(0, DIM_HEAD, 2, dtype=torch.float64) / DIM_HEAD))
    exact32 = 1.0 / (500.0 ** (torch.arange(0, DIM_HEAD, 2, dtype=torch.float32) / DIM_HEAD))
    assert torch.equal(module.angles(pos)[0, 0, :, ::2], pos[0, :, None].float() * exact32)
    for cast in (torch.float64, torch.bfloat16):
        m = RotaryEmbedding(DIM_HEAD, theta=500.0).to(cast)
        assert torch.equal(m.angles(pos, torch.float64)[0, 0, :, ::2], pos[0, :, None].double() * exact64)
        assert torch.equal(m.frequencies(), exact32)
    peer = xt.x_transformers.RotaryEmbedding(DIM_HEAD, base=500)
    with torch.no_grad():
        peer.inv_freq.mul_(torch.tensor([0.5, 0.8, 1.5, 2.0]))
    module.load_state_dict(peer.state_dict(), strict=True)
    for t in (torch.tensor([3, 1, 4, 1, 5, 9]), torch.arange(8).reshape(2, 4)):
        got, want = module(t), peer(t)
        torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
    assert torch.equal(module.frequencies(torch.float64), peer.inv_freq.double())
