"""x-transformers' checkpoints load as they are: for the same constructor call in both libraries, the state dicts
have the same keys, shapes and dtypes, each loads into the other with ``strict=True``, and the outputs on the same
weights agree within float32 tolerance on right-padded inputs (at the real positions), with gradients too.

The configurations: ``benchmarks/state_dict_parity.py``'s table (the plain stacks and wrappers users bring) and
below, one per further option family (norms, residual routing, position schemes, attention options,
feed-forward options, grouped-query heads).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import safeformer as sf

xt = pytest.importorskip("x_transformers")

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("state_dict_parity_script", ROOT / "benchmarks" / "state_dict_parity.py")
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench
spec.loader.exec_module(bench)

V, N, DIM = bench.V, bench.N, bench.DIM


def _stack(lib, kind: str, heads: int, depth: int, **kw):
    return getattr(lib, kind)(dim=DIM, depth=depth, heads=heads, attn_dim_head=8 if heads > 2 else 16, **kw)


def dec(lib, kind: str = "Decoder", heads: int = 2, depth: int = 2, wrap_kw: dict | None = None, **kw):
    return lib.TransformerWrapper(num_tokens=V, max_seq_len=N, attn_layers=_stack(lib, kind, heads, depth, **kw),
                                  **(wrap_kw or {}))


def enc(lib, **kw):
    return dec(lib, "Encoder", **kw)


# name -> builder(lib): the same call in both libraries
MORE: dict[str, Callable] = {
    "GQA 4 heads / 2 kv": lambda lib: dec(lib, heads=4, attn_kv_heads=2),
    "GQA + ALiBi": lambda lib: dec(lib, heads=4, attn_kv_heads=2, alibi_pos_bias=True),
    "GQA + ALiBi on half the heads": lambda lib: dec(lib, heads=4, attn_kv_heads=2, alibi_pos_bias=True,
                                                     alibi_num_heads=2),
    "GQA + sink + gates": lambda lib: dec(lib, heads=4, attn_kv_heads=2, attn_head_learned_sink=True,
                                          attn_gate_values=True, attn_output_gate=True),
    "GQA + cross + memory kv": lambda lib: dec(lib, heads=4, attn_kv_heads=2, cross_attend=True, attn_num_mem_kv=2),
    "qk-norm dim scale + GQA": lambda lib: dec(lib, heads=4, attn_kv_heads=2, attn_qk_norm=True,
                                               attn_qk_norm_dim_scale=True),
    "qk-norm groups + scale": lambda lib: dec(lib, attn_qk_norm=True, attn_qk_norm_groups=2, attn_qk_norm_scale=7),
    "talking heads": lambda lib: dec(lib, attn_pre_talking_heads=True, attn_post_talking_heads=True),
    "head scale + value heads gate": lambda lib: dec(lib, attn_head_scale=True, attn_gate_value_heads=True),
    "qk rmsnorm": lambda lib: dec(lib, attn_qk_rmsnorm=True),
    "post_emb_norm + emb_dim": lambda lib: dec(lib, wrap_kw=dict(post_emb_norm=True, emb_dim=16)),
    "max attend past + memory kv + cross": lambda lib: dec(lib, attn_max_attend_past=3, attn_num_mem_kv=2,
                                                           cross_attend=True),
    "selective attention + memory kv": lambda lib: dec(lib, heads=4, attn_selective=True, attn_num_mem_kv=2),
    "data-dependent ALiBi": lambda lib: dec(lib, attn_data_dependent_alibi=True),
    "data-dependent ALiBi per row": lambda lib: dec(lib, attn_data_dependent_alibi=True,
                                                    attn_data_dependent_alibi_per_row=True),
    "per-row ALiBi, dim 4, scaled": lambda lib: dec(lib, heads=4, attn_data_dependent_alibi=True,
                                                    attn_data_dependent_alibi_per_row=True,
                                                    attn_data_dependent_alibi_per_row_dim_head=4,
                                                    attn_data_dependent_alibi_kwargs=dict(post_log_scale=0.5)),
    "k rmsnorm + GQA + memory kv + rotary": lambda lib: dec(lib, heads=4, attn_kv_heads=2, attn_k_rmsnorm=True,
                                                             attn_num_mem_kv=2, rotary_pos_emb=True),
    "qk rmsnorm after qk-norm": lambda lib: dec(lib, attn_qk_norm=True, attn_qk_rmsnorm=True),
    "scalenorm": lambda lib: dec(lib, use_scalenorm=True),
    "simple rmsnorm": lambda lib: dec(lib, use_simple_rmsnorm=True),
    "dynamic tanh": lambda lib: dec(lib, use_dynamic_tanh=True),
    "no unit offset": lambda lib: dec(lib, norm_add_unit_offset=False, use_layerscale=True),
    "adaptive rmsnorm + layerscale": lambda lib: dec(lib, use_adaptive_rmsnorm=True, use_adaptive_layerscale=True,
                                                     dim_condition=4),
    "hyper-connections": lambda lib: dec(lib, num_residual_streams=2),
    "LIMe": lambda lib: dec(lib, integrate_layers=True),
    "U-Net skips": lambda lib: dec(lib, depth=4, unet_skips=True),
    "reinject input": lambda lib: dec(lib, reinject_input=True, learned_reinject_input_gate=True),
    "pre and post norm": lambda lib: dec(lib, pre_and_post_norm=True),
    "gated + scaled residual": lambda lib: dec(lib, gate_residual=True, scale_residual=True),
    "ff options": lambda lib: dec(lib, ff_no_bias=True, ff_relu_squared=True, ff_post_act_ln=True),
    "ff glu mult bias": lambda lib: dec(lib, ff_glu=True, ff_glu_mult_bias=True),
    "ff solu": lambda lib: dec(lib, ff_solu=True),
    "T5 bias encoder": lambda lib: enc(lib, rel_pos_bias=True),
    "dynamic position bias": lambda lib: dec(lib, dynamic_pos_bias=True),
    "scaled sinusoidal": lambda lib: dec(lib, wrap_kw=dict(scaled_sinu_pos_emb=True)),
    "value rmsnorm": lambda lib: dec(lib, attn_value_rmsnorm=True),
    "learned value residual mix": lambda lib: dec(lib, add_value_residual=True, learned_value_residual_mix=True),
    "shift tokens per layer + layerscale": lambda lib: dec(lib, shift_tokens=(1, 0, 2, 0), use_layerscale=True),
    "weight-tied layers": lambda lib: dec(lib, weight_tie_layers=True),
    "float residual scale + macaron": lambda lib: dec(lib, scale_residual=0.5, macaron=True),
    "rotate_num_heads": lambda lib: dec(lib, rotary_pos_emb=True, rotate_num_heads=1),
    "absolute + rotary": lambda lib: dec(lib, rotary_pos_emb=True, disable_abs_pos_emb=False),
}


def _build(lib, name: str):
    build = bench.CONFIGS.get(name) or MORE[name]
    return build(lib)


NAMES = list(bench.CONFIGS) + list(MORE)
# the listed differences (docs/moving_from_x_transformers.md): the keys load, the numbers differ on purpose
NUMBERS_DIFFER = {"hyper-connections"}


def _inputs(name: str):
    if name in bench.CONFIGS:
        return bench.inputs(name)
    args, kw = bench.inputs("Decoder")
    if "cross" in name:
        kw["context"] = torch.randn(2, 3, DIM, generator=torch.Generator().manual_seed(1))
    if "adaptive" in name:
        kw["condition"] = torch.randn(2, 4, generator=torch.Generator().manual_seed(2))
    return args, kw


def _output(name: str, model, args, kw):
    out = model(*args, **kw)
    if name == "XTransformer":
        return out, None
    keep = kw["mask"][..., None] if out.dim() == 3 else kw["mask"]
    return out, keep


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_loads_strictly_both_ways_with_equal_outputs(name):
    torch.manual_seed(0)
    theirs = _build(xt, name)
    ours = _build(sf, name)
    a, b = theirs.state_dict(), ours.state_dict()
    assert set(a) == set(b), f"only x-transformers: {sorted(set(a) - set(b))}; only safeformer: {sorted(set(b) - set(a))}"
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
    # weights moved off their initial values (zero-initialised gates and scales included), then shared
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    back = _build(xt, name)
    back.load_state_dict(ours.state_dict(), strict=True)
    for k, v in back.state_dict().items():
        assert torch.equal(v, theirs.state_dict()[k]), f"{k} changed on the way through safeformer"
    theirs.eval()
    ours.eval()
    if name in NUMBERS_DIFFER:
        return
    args, kw = _inputs(name)
    want, keep = _output(name, theirs, args, kw)
    got, _ = _output(name, ours, args, kw)
    if keep is None:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(torch.where(keep, got, 0.0), torch.where(keep, want, 0.0), rtol=1e-5, atol=1e-5)
    # gradients of the same loss reach the same parameters with the same values
    (want if keep is None else torch.where(keep, want, 0.0)).square().mean().backward()
    (got if keep is None else torch.where(keep, got, 0.0)).square().mean().backward()
    mine = dict(ours.named_parameters())
    # float32 sums in another order: the tolerance is relative to the largest gradient entry of the model
    scale = max(float(p.grad.abs().max()) for p in theirs.parameters() if p.grad is not None)
    for k, p in theirs.named_parameters():
        if p.grad is None:
            continue
        assert mine[k].grad is not None, f"no gradient reached {k}"
        torch.testing.assert_close(mine[k].grad, p.grad, rtol=1e-3, atol=1e-5 * scale, msg=lambda m, k=k: f"{k}: {m}")


def test_layer_indexing_is_x_transformers():
    """``attn_layers.layers[i]`` is ``[norms, block, residual]``; a hook on ``layers[i][-1]`` (the residual module)
    sees the residual stream, as in x-transformers (projects hook it)."""
    torch.manual_seed(0)
    theirs, ours = dec(xt), dec(sf)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    seen: dict[str, list] = {"xt": [], "sf": []}
    for tag, model in (("xt", theirs), ("sf", ours)):
        for layer in model.attn_layers.layers:
            assert len(layer) == 3 and len(layer[0]) == 3
            layer[-1].register_forward_hook(lambda _m, _i, out, tag=tag: seen[tag].append(out))
    ids = torch.randint(0, V, (2, N))
    theirs.eval()(ids)
    ours.eval()(ids)
    assert len(seen["sf"]) == len(seen["xt"]) == len(ours.attn_layers.layers)
    for a, b in zip(seen["xt"], seen["sf"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_hyper_connection_residual_mix_is_doubly_stochastic_where_x_transformers_sums_every_stream():
    """The one listed numeric difference of a loaded hyper-connection model: x-transformers 2.31.10 reshapes the
    ``(S, S)`` residual-mixing logits to ``(S, 1, S)`` before its Sinkhorn step (``'... (s1 s2) -> ... s1 s2'`` with
    ``s2 = streams``), so every entry comes out 1 and each stream becomes the sum of all streams (the streams grow
    ``S`` times per layer: float16 overflows within a few dozen layers); safeformer's mix is the doubly stochastic
    matrix the hyper-connection papers describe."""
    torch.manual_seed(0)
    theirs = xt.Decoder(dim=DIM, depth=1, heads=2, attn_dim_head=16, num_residual_streams=3)
    ours = sf.Decoder(dim=DIM, depth=1, heads=2, attn_dim_head=16, num_residual_streams=3)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    streams = torch.randn(2, 5, 3, DIM)
    from einops import rearrange

    _, mixed_xt, _ = theirs.layers[0][2].prepare(rearrange(streams, "b n s d -> (b s) n d"))
    _, mixed_sf, _ = ours.layers[0][2].prepare(streams)
    torch.testing.assert_close(mixed_xt, streams.sum(dim=-2, keepdim=True).expand_as(streams) * 1.0)
    hc = ours.layers[0][2]
    normed = hc.norm(streams)
    alpha = (normed @ hc.dynamic_alpha_fn) * hc.dynamic_alpha_scale + hc.static_alpha
    mix = sf.nn.block.sinkhorn(alpha[..., hc.num_input_views:], hc.sinkhorn_iters)
    torch.testing.assert_close(mix.sum(-1), torch.ones_like(mix.sum(-1)), rtol=0, atol=1e-3)
    torch.testing.assert_close(mix.sum(-2), torch.ones_like(mix.sum(-2)), rtol=0, atol=1e-3)
    torch.testing.assert_close(mixed_sf, torch.einsum("...st,...sd->...td", mix, streams))


def test_autoregressive_loss_drops_masked_targets_where_x_transformers_counts_them():
    """The listed difference of ``AutoregressiveWrapper``'s loss on the same weights: with ``mask``, x-transformers
    averages the cross-entropy over every target (a padded one included: pix2tex pads targets with 0, not
    ``ignore_index``); safeformer over the targets whose position is real."""
    torch.manual_seed(0)
    theirs = xt.AutoregressiveWrapper(dec(xt)).eval()
    ours = sf.AutoregressiveWrapper(dec(sf)).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    g = torch.Generator().manual_seed(5)
    x = torch.randint(1, V, (2, N), generator=g)
    mask = torch.arange(N)[None] < torch.tensor([N, 5])[:, None]
    x = torch.where(mask, x, 0)  # right padding with token 0
    with torch.no_grad():
        logits = ours.net(x[:, :-1], mask=mask[:, :-1]).double()
        per = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
        real = mask[:, 1:]
        torch.testing.assert_close(ours(x, mask=mask).double(), per[real].mean(), rtol=1e-5, atol=1e-6)
        # x-transformers' own logits (those of padded positions are its, and depend on the padding)
        per_xt = torch.nn.functional.cross_entropy(theirs.net(x[:, :-1], mask=mask[:, :-1]).double().transpose(1, 2),
                                                   x[:, 1:], reduction="none")
        torch.testing.assert_close(per_xt[real], per[real], rtol=1e-5, atol=1e-5)  # the real targets agree
        torch.testing.assert_close(theirs(x, mask=mask).double(), per_xt.mean(), rtol=1e-5, atol=1e-6)
        assert abs(float(per[real].mean() - per_xt.mean())) > 1e-3
