"""x-transformers' stack keywords in safeformer: every one accepted at x-transformers' default, the ones
safeformer builds equal to x-transformers on the same weights, the rest refused by name.

The keyword list is read from x-transformers' own signatures (``AttentionLayers``' keywords and the
``attn_`` / ``ff_`` forms of ``Attention``'s and ``FeedForward``'s), so a keyword x-transformers adds shows
up here. The contract cases ``Decoder-xt-feedforward``, ``Encoder-xt-glu`` and
``TransformerWrapper-scaled-sinu`` (``helpers.CASES``) run every clause on these options.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import safeformer as sf
from safeformer.core.xt_defaults import XT_DEFAULT_ONLY as _XT_DEFAULT_ONLY
from safeformer.nn.modules import FeedForward
from safeformer.stack.layers import LAYER_ALIASES

xt = pytest.importorskip("x_transformers")
X = xt.x_transformers

# keywords x-transformers' AttentionLayers passes to Attention itself: an attn_ form collides there too
_COLLIDE = {"attn_dim", "attn_heads", "attn_causal", "ff_dim"}
_OWN_SKIP = {"dim", "depth", "heads", "causal", "cross_attend", "only_cross"}


def _params(fn) -> dict:
    return {k: p.default for k, p in inspect.signature(fn).parameters.items()
            if k != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def xt_stack_keywords() -> dict:
    """x-transformers' stack keywords and their defaults (its own, ``attn_<Attention's>``, ``ff_<FeedForward's>``)."""
    out = {f"attn_{k}": v for k, v in _params(X.Attention.__init__).items()}
    out.update({f"ff_{k}": v for k, v in _params(X.FeedForward.__init__).items()})
    out.update(_params(X.AttentionLayers.__init__))
    return {k: v for k, v in out.items()
            if k not in _COLLIDE | _OWN_SKIP and v is not inspect.Parameter.empty}


def test_every_x_transformers_stack_keyword_is_accepted_at_its_default():
    keywords = xt_stack_keywords()
    assert len(keywords) >= 170, len(keywords)  # x-transformers 2.31.10: 176
    refused = {}
    for name, default in sorted(keywords.items()):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sf.Decoder(dim=16, depth=1, heads=2, **{name: default})
        except Exception as err:  # noqa: BLE001  # the census lists every refusal, whatever its type
            refused[name] = f"{type(err).__name__}: {err}"
    assert not refused, refused


@pytest.mark.parametrize("name", sorted(_XT_DEFAULT_ONLY))
def test_default_only_keywords_refuse_another_value_by_name(name):
    default = _XT_DEFAULT_ONLY[name]
    if isinstance(default, bool):
        other = not default
    elif default is None:
        other = 3
    elif isinstance(default, dict):
        other = {"x": 1}
    else:
        other = default + 1
    with pytest.raises(TypeError, match=f"x-transformers' option {name}=.* is not supported by safeformer"):
        sf.Decoder(dim=16, depth=1, heads=2, **{name: other})


def test_sdp_kwargs_restrict_the_kernels_and_bad_ones_are_named():
    net = sf.Decoder(dim=16, depth=1, heads=2, attn_attend_sdp_kwargs=dict(enable_flash=False))
    assert net.layers[0][1].attend.sdpa_allowed == ("efficient", "math", "cudnn")
    only_math = sf.Decoder(dim=16, depth=1, heads=2, attn_attend_sdp_kwargs=dict(enable_flash=False,
                                                                                  enable_mem_efficient=False,
                                                                                  enable_cudnn=False))
    assert only_math.layers[0][1].attend.sdpa_allowed == ("math",)
    for bad in (dict(enable_flash=1), dict(enable_fast=True), "flash",
                dict(enable_flash=False, enable_math=False, enable_mem_efficient=False, enable_cudnn=False)):
        with pytest.raises(ValueError, match="attend_sdp_kwargs"):
            sf.Decoder(dim=16, depth=1, heads=2, attn_attend_sdp_kwargs=bad)


@pytest.mark.parametrize("name", ["attn_dim_context", "attn_dim_out", "attn_learned_value_residual_mix",
                                  "attn_qkv_receive_diff_residuals", "attn_rotate_num_heads"])
def test_x_transformers_itself_refuses_another_value_of_these(name):
    """``XT_REFUSES_TOO``: x-transformers' stack sets these on each block itself, so another value fails there too
    (a duplicate keyword at construction, or shapes that no longer fit in the forward)."""
    from safeformer.core.xt_defaults import XT_REFUSES_TOO

    assert name in XT_REFUSES_TOO and set(XT_REFUSES_TOO) <= set(_XT_DEFAULT_ONLY)
    xt = pytest.importorskip("x_transformers")
    other = {"attn_dim_context": 3, "attn_dim_out": 3, "attn_rotate_num_heads": 1}.get(name, True)
    with pytest.raises((TypeError, RuntimeError, AssertionError)):
        net = xt.TransformerWrapper(num_tokens=10, max_seq_len=8, attn_layers=xt.Decoder(dim=16, depth=1, heads=2,
                                                                                         **{name: other}))
        net(torch.randint(0, 10, (1, 4)))


def test_every_default_only_keyword_is_an_x_transformers_keyword_with_that_default():
    keywords = xt_stack_keywords()
    for name, default in _XT_DEFAULT_ONLY.items():
        assert name in keywords, name
        assert keywords[name] == default, (name, keywords[name], default)
    from safeformer.stack.layers import ATTENTION_FIELDS

    # the table's other entries are x-transformers' spellings, or an attention field under the attn_ prefix
    # (safeformer's own Attention keywords too: attn_bias, attn_kv_head_order, ...)
    for name in LAYER_ALIASES:
        assert name in keywords or name.startswith("cross_attn_") or name == "attn_one_kv_head" \
            or name.removeprefix("attn_") in ATTENTION_FIELDS, name


# ------------------------------------------------------------------------------------------------------------
# parity on the same weights
# ------------------------------------------------------------------------------------------------------------

LAYER_OPTIONS = {
    "ff_no_bias": dict(ff_no_bias=True),
    "ff_no_bias_glu": dict(ff_no_bias=True, ff_glu=True),
    "use_scalenorm": dict(use_scalenorm=True),
    "use_simple_rmsnorm": dict(use_simple_rmsnorm=True),
    "ff_relu_squared": dict(ff_relu_squared=True),
    "ff_solu": dict(ff_solu=True),
    "ff_post_act_ln": dict(ff_post_act_ln=True),
    "ff_glu_mult_bias": dict(ff_glu=True, ff_glu_mult_bias=True),
    "ff_solu_post_act_ln_no_bias": dict(ff_solu=True, ff_post_act_ln=True, ff_no_bias=True),
    "attn_onnxable": dict(attn_onnxable=True),
    "disable_abs_pos_emb": dict(disable_abs_pos_emb=True),
    "ff_sublayer_dropout": dict(ff_sublayer_dropout=0.2),
    "verbose": dict(verbose=False),
    "rotary_disable_default": dict(rotary_pos_emb=True, disable_abs_pos_emb=None),
    "attn_head_scale": dict(attn_head_scale=True),
    "attn_head_scale_gqa": dict(attn_head_scale=True, attn_kv_heads=1),
    "attn_sublayer_dropout": dict(attn_sublayer_dropout=0.2, ff_sublayer_dropout=0.1),
    "attn_sparse_topk": dict(attn_sparse_topk=3),
    "attn_sparse_topk_rotary_gqa": dict(attn_sparse_topk=2, rotary_pos_emb=True, attn_kv_heads=1),
    "attn_sparse_topk_straight_through": dict(attn_sparse_topk=2, attn_sparse_topk_straight_through=True),
    "attn_hard": dict(attn_hard=True),
    "attn_pre_talking_heads": dict(attn_pre_talking_heads=True),
    "attn_post_talking_heads": dict(attn_post_talking_heads=True),
    "attn_talking_heads_all_gqa": dict(attn_pre_talking_heads=True, attn_post_talking_heads=True,
                                       attn_pre_scale_post_talking_heads=True, attn_kv_heads=1),
    "dynamic_pos_bias": dict(dynamic_pos_bias=True),
    "rotate_num_heads": dict(rotary_pos_emb=True, rotate_num_heads=1),
    "attn_add_zero_kv": dict(attn_add_zero_kv=True),
    "attn_add_zero_kv_memkv_sink_gqa": dict(attn_add_zero_kv=True, attn_num_mem_kv=2, attn_head_learned_sink=True,
                                            attn_kv_heads=1),
    "dynamic_pos_bias_all_gqa": dict(dynamic_pos_bias=True, dynamic_pos_bias_log_distance=True, dynamic_pos_bias_norm=True,
                                     dynamic_pos_bias_mlp_depth=3, attn_kv_heads=1),
}
WRAPPER_OPTIONS = {
    "max_seq_len_0": dict(max_seq_len=0),
    "scaled_sinu_pos_emb": dict(scaled_sinu_pos_emb=True),
}
CASES = [(k, v, {}) for k, v in LAYER_OPTIONS.items()] + [(k, {}, v) for k, v in WRAPPER_OPTIONS.items()]


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter moved off its init (gains of ones, zero biases), so that a wrong copy shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("name,layer_opts,wrapper_opts", CASES, ids=[c[0] for c in CASES])
def test_outputs_and_gradients_equal_x_transformers(name, layer_opts, wrapper_opts):
    """``from_x_transformers`` of a model built with the keyword gives x-transformers' logits at every real
    position of a right-padded batch, and the same gradient of the token embedding, to float32 tolerance."""
    torch.manual_seed(0)
    kw = dict(max_seq_len=16)
    kw.update(wrapper_opts)
    peer = xt.TransformerWrapper(num_tokens=20, **kw,
                                 attn_layers=xt.Decoder(dim=16, depth=2, heads=2, attn_dim_head=8, **layer_opts))
    peer = _perturbed(peer, 1).eval()
    ours = sf.from_x_transformers(peer).eval()
    for key in {**layer_opts, **wrapper_opts}:  # the converted model holds the keyword itself
        if key in ("ff_no_bias", "ff_solu", "ff_post_act_ln", "ff_glu_mult_bias", "ff_relu_squared"):
            assert ours.attn_layers.get_config()["ff_kwargs"][key.removeprefix("ff_")] is True, key
        if key in ("use_scalenorm", "use_simple_rmsnorm", "scaled_sinu_pos_emb"):
            cfg = ours.get_config() if key == "scaled_sinu_pos_emb" else ours.attn_layers.get_config()
            assert cfg[key] is True, key
    x = torch.randint(0, 20, (3, 7))
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3, [True] * 2 + [False] * 5])
    theirs = peer(x, mask=mask)
    mine = ours(x, mask=mask)
    torch.testing.assert_close(mine[mask], theirs[mask], atol=1e-5, rtol=1e-5)
    up = torch.randn(theirs.shape, generator=torch.Generator().manual_seed(2)) * mask[..., None]
    (theirs * up).sum().backward()
    (mine * up).sum().backward()
    torch.testing.assert_close(ours.token_emb.weight.grad, peer.token_emb.emb.weight.grad, atol=1e-5, rtol=1e-5)


def test_converted_models_have_x_transformers_parameter_shapes():
    """No bias where x-transformers has none (a gated input projection keeps its bias, as there), one scalar
    ScaleNorm gain, no SimpleRMSNorm parameter, a learned GLU gain and SoLU / post-activation gains."""
    def conv(**opts):
        torch.manual_seed(0)
        return sf.from_x_transformers(xt.TransformerWrapper(
            num_tokens=20, max_seq_len=16, attn_layers=xt.Decoder(dim=16, depth=1, heads=2, **opts)))

    ff = conv(ff_no_bias=True).attn_layers.layers[1].mixer
    assert ff.proj_in.bias is None and ff.proj_out.bias is None
    ff = conv(ff_no_bias=True, ff_glu=True).attn_layers.layers[1].mixer
    assert ff.proj_in.bias is not None and ff.proj_out.bias is None
    norm = conv(use_scalenorm=True).attn_layers.layers[0][0]
    assert [tuple(p.shape) for p in norm.parameters()] == [(1,)]
    assert not list(conv(use_simple_rmsnorm=True).attn_layers.layers[0][0].parameters())
    ff = conv(ff_glu=True, ff_glu_mult_bias=True, ff_post_act_ln=True).attn_layers.layers[1].mixer
    assert ff.mult_bias.shape == (64,) and ff.post_act_norm.shape == (64,) and ff.solu_norm is None


@pytest.mark.parametrize("opts", [dict(solu=True), dict(post_act_ln=True), dict(glu=True, glu_mult_bias=True),
                                  dict(solu=True, post_act_ln=True, no_bias=True), dict(relu_squared=True)],
                         ids=["solu", "post_act_ln", "glu_mult_bias", "solu_post_no_bias", "relu_squared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_feedforward_module_equals_x_transformers(opts, dtype):
    """``FeedForward`` alone, x-transformers' keywords, the same weights: the same output (float64 reference of
    x-transformers' module for the tolerance), finite in bfloat16 with hidden values in the hundreds."""
    torch.manual_seed(0)
    peer = _perturbed(X.FeedForward(8, mult=2, **opts), 3).double()
    ours = FeedForward(8, mult=2, **opts).double()
    sd = peer.state_dict()
    with torch.no_grad():
        lin_in = peer.ff[0].proj if opts.get("glu") else peer.ff[0][0]
        ours.proj_in.weight.copy_(lin_in.weight)
        if ours.proj_in.bias is not None:
            ours.proj_in.bias.copy_(lin_in.bias)
        outs = [m for m in peer.ff if isinstance(m, torch.nn.Linear)]
        ours.proj_out.weight.copy_(outs[-1].weight)
        if ours.proj_out.bias is not None:
            ours.proj_out.bias.copy_(outs[-1].bias)
        if opts.get("glu_mult_bias"):
            ours.mult_bias.copy_(peer.ff[0].mult_bias)
        if opts.get("solu"):
            ours.solu_norm.copy_(sd["ff.0.1.norm.gamma"])
        if opts.get("post_act_ln"):
            ours.post_act_norm.copy_(sd["ff.1.gamma"])
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    want = peer(x)
    ours = ours.to(dtype)
    got = ours(x.to(dtype))
    tol = 1e-5 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(got.double(), want, atol=tol * want.abs().max().item(), rtol=tol)
    big = ours(x.to(dtype) * 300)  # hidden values in the thousands: statistics in float32 (S7)
    assert torch.isfinite(big).all()


def test_zero_init_outputs_and_depth_scaled_init():
    dec = sf.Decoder(dim=16, depth=2, heads=2, attn_zero_init_output=True, ff_zero_init_output=True)
    assert all(bool((blk.mixer.to_out.weight == 0).all()) for blk in dec.layers if blk.kind == "self")
    assert all(bool((blk.mixer.proj_out.weight == 0).all()) for blk in dec.layers if blk.kind == "ff")
    torch.manual_seed(0)
    ff = FeedForward(64, mult=4, output_proj_depth=3)
    std = ff.proj_out.weight.std().item()
    assert abs(std - (2 * 256 * 3) ** -0.5) < 0.1 * (2 * 256 * 3) ** -0.5


def test_sublayer_dropout_acts_in_training_only():
    torch.manual_seed(0)
    ff = FeedForward(8, sublayer_dropout=0.5)
    x = torch.randn(4, 6, 8)
    ff.eval()
    torch.testing.assert_close(ff(x), ff.proj_out(ff.act(ff.proj_in(x))))
    ff.train()
    assert bool((ff(x) == 0).any())


def test_max_seq_len_zero_has_no_bound():
    """``max_seq_len=0``: no absolute position embedding (x-transformers'), and generation runs past any length
    without a window."""
    net = sf.TransformerWrapper(num_tokens=20, max_seq_len=0, attn_layers=sf.Decoder(dim=16, depth=1, heads=2,
                                                                                     rotary_pos_emb=True))
    assert net.pos_emb is None and net.max_seq_len == 0 and net.can_cache_kv_outside_max_seq_len
    out = sf.AutoregressiveWrapper(net).generate(torch.randint(0, 20, (2, 3)), 40, filter_logits_fn="top_k",
                                                 temperature=0.0)
    assert out.shape == (2, 40)
    plain = sf.TransformerWrapper(num_tokens=20, max_seq_len=0, attn_layers=sf.Decoder(dim=16, depth=1, heads=2))
    assert plain.pos_emb is None


def test_scaled_sinusoids_count_real_tokens_only():
    """Left padding shifts no real position: a left-padded sample equals itself alone."""
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=20, max_seq_len=16, scaled_sinu_pos_emb=True,
                                attn_layers=sf.Decoder(dim=16, depth=1, heads=2)).eval()
    assert list(dict(net.pos_emb.named_parameters())) == ["scale"]
    x = torch.randint(0, 20, (1, 5))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), x], dim=1)
    mask = torch.tensor([[False] * 3 + [True] * 5])
    torch.testing.assert_close(net(padded, mask=mask)[:, 3:], net(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: sf.Decoder(dim=16, depth=1, use_scalenorm=True, use_rmsnorm=True), ValueError, "choose one norm"),
    (lambda: sf.Decoder(dim=16, depth=1, use_simple_rmsnorm=True, use_dynamic_tanh=True), ValueError, "choose one norm"),
    (lambda: sf.Decoder(dim=16, depth=1, ff_dim_out=8), ValueError, "ff_dim_out must be the stack's width 16"),
    (lambda: sf.Decoder(dim=16, depth=1, ff_kwargs=dict(glu=True)), TypeError, "ff_kwargs got an unexpected keyword 'glu'"),
    (lambda: sf.Decoder(dim=16, depth=1, attn_kwargs=dict(heads=3)), TypeError, "attn_kwargs got an unexpected keyword 'heads'"),
    (lambda: sf.Decoder(dim=16, depth=1, ff_kwargs=[1]), TypeError, "ff_kwargs must be a dict"),
    (lambda: sf.Decoder(dim=16, depth=1, ff_no_bias=True, ff_kwargs=dict(no_bias=False)), TypeError, "given twice"),
    (lambda: sf.Decoder(dim=16, depth=1, ff_glu_mult_bias=True), ValueError, "needs glu=True"),
    (lambda: sf.Decoder(dim=16, depth=1, ff_solu=True, ff_relu_squared=True), ValueError, "choose one activation"),
    (lambda: sf.Decoder(dim=16, depth=1, ff_sublayer_dropout=1.0), ValueError, "sublayer_dropout"),
    (lambda: sf.Decoder(dim=16, depth=1, ff_output_proj_depth=0), ValueError, "output_proj_depth"),
    (lambda: sf.Decoder(dim=16, depth=1, disable_abs_pos_emb=1), TypeError, "disable_abs_pos_emb must be"),
    (lambda: sf.TransformerWrapper(num_tokens=5, max_seq_len=-1, attn_layers=sf.Decoder(dim=16, depth=1)),
     ValueError, "max_seq_len must be a non-negative integer"),
    (lambda: sf.TransformerWrapper(num_tokens=5, max_seq_len=8, scaled_sinu_pos_emb=1,
                                   attn_layers=sf.Decoder(dim=16, depth=1)), TypeError, "scaled_sinu_pos_emb"),
    (lambda: sf.TransformerWrapper(num_tokens=5, max_seq_len=8, scaled_sinu_pos_emb=True, emb_dim=7,
                                   attn_layers=sf.Decoder(dim=16, depth=1)), ValueError, "even embedding width"),
    (lambda: sf.Decoder(dim=16, depth=1, norm_add_unit_offset=1), TypeError, "norm_add_unit_offset must be a bool"),
], ids=["scale+rms", "simple+dyt", "ff_dim_out", "ff_kwargs-key", "attn_kwargs-key", "ff_kwargs-type", "twice",
        "mult_bias-no-glu", "two-activations", "sublayer-dropout", "proj-depth", "disable-type",
        "max_seq_len", "sinu-type", "sinu-odd", "unit-offset"])
def test_errors_name_the_keyword(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_disable_abs_pos_emb_attribute_as_x_transformers():
    for opts, want in ((dict(), False), (dict(rotary_pos_emb=True), True), (dict(disable_abs_pos_emb=True), True),
                       (dict(alibi_pos_bias=True), False), (dict(rel_pos_bias=True), True)):
        assert sf.Decoder(dim=16, depth=1, heads=2, **opts).disable_abs_pos_emb is want, opts
    net = sf.TransformerWrapper(num_tokens=5, max_seq_len=8,
                                attn_layers=sf.Decoder(dim=16, depth=1, heads=2, disable_abs_pos_emb=True))
    assert net.pos_emb is None


def test_attention_takes_x_transformers_keywords_at_their_defaults():
    """``Attention`` used on its own (a door): every keyword of x-transformers' ``Attention`` at its default is
    accepted; the ones safeformer does not build refuse another value by name; a misspelt one is a TypeError."""
    refused = {}
    for name, default in _params(X.Attention.__init__).items():
        if name in ("dim",) or default is inspect.Parameter.empty:
            continue
        try:
            sf.Attention(16, **{name: default})
        except Exception as err:  # noqa: BLE001
            refused[name] = f"{type(err).__name__}: {err}"
    assert not refused, refused
    from safeformer.core.xt_defaults import ATTENTION_DEFAULT_ONLY

    assert ATTENTION_DEFAULT_ONLY == {}  # every keyword of x-transformers' Attention is built
    with pytest.raises(TypeError, match="unexpected keyword argument 'sparse_topc'; did you mean 'sparse_topk'"):
        sf.Attention(16, sparse_topc=4)
    sf.Attention(16, onnxable=True)


# ------------------------------------------------------------------------------------------------------------
# call arguments
# ------------------------------------------------------------------------------------------------------------

def _forward_params(a, b) -> set[str]:
    """``a``'s named parameters that ``b`` lacks."""
    return set(inspect.signature(a).parameters) - set(inspect.signature(b).parameters) - {"self", "kwargs"}


def test_every_x_transformers_call_argument_is_a_parameter():
    import x_transformers.autoregressive_wrapper as xa
    import x_transformers.continuous as xc

    for theirs, ours in ((X.AttentionLayers.forward, sf.AttentionLayers.forward),
                         (X.Attention.forward, sf.Attention.forward),
                         (X.TransformerWrapper.forward, sf.TransformerWrapper.forward),
                         (xc.ContinuousTransformerWrapper.forward, sf.ContinuousTransformerWrapper.forward),
                         (xa.AutoregressiveWrapper.forward, sf.AutoregressiveWrapper.forward),
                         (xt.XTransformer.__init__, sf.XTransformer.__init__),
                         (X.FeedForward.__init__, FeedForward.__init__)):
        assert not _forward_params(theirs, ours), (theirs.__qualname__, _forward_params(theirs, ours))


def _stack_pair():
    torch.manual_seed(0)
    peer = xt.TransformerWrapper(num_tokens=20, max_seq_len=16,
                                 attn_layers=xt.Decoder(dim=16, depth=2, heads=2, attn_dim_head=8))
    peer = _perturbed(peer, 4).eval()
    return peer.attn_layers, sf.from_x_transformers(peer).attn_layers.eval()


def test_self_attn_kv_mask_equals_x_transformers():
    """A key mask beside the query/key padding: x-transformers' numbers where a query has a key; NaN planted in
    a masked key's input reaches no other position."""
    peer, ours = _stack_pair()
    x = torch.randn(2, 6, 16)
    kv = torch.tensor([[True] * 6, [True, False, True, True, False, True]])
    with torch.no_grad():
        torch.testing.assert_close(ours(x, self_attn_kv_mask=kv), peer(x, self_attn_kv_mask=kv), atol=1e-5, rtol=1e-5)
    enc = sf.Encoder(dim=16, depth=1, heads=2).eval()
    planted = x.clone()
    planted[1, 1] = float("nan")  # a masked key; its own query row is real and attends elsewhere
    clean = x.clone()
    clean[1, 1] = 0.0
    with torch.no_grad():
        a, b = enc(planted, self_attn_kv_mask=kv), enc(clean, self_attn_kv_mask=kv)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[1, 1] = False
    torch.testing.assert_close(a[keep], b[keep])


def test_seq_start_pos_equals_x_transformers_and_zeroes_the_padding():
    peer, ours = _stack_pair()
    x = torch.randn(2, 6, 16)
    x[1, :2] = float("nan")  # left padding of sample 1: never read
    start = torch.tensor([0, 2])
    real = torch.arange(6)[None] >= start[:, None]
    with torch.no_grad():
        got = ours(x, seq_start_pos=start)
        want = peer(torch.nan_to_num(x), seq_start_pos=start)
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert bool((got[~real] == 0).all())


@pytest.mark.parametrize("name,value", [("flash_pack_seq_context_kwargs", {}), ("polar_pos_emb", (1, 2))])
def test_bad_stack_call_arguments_are_refused_by_name(name, value):
    """Both are supported (tests/test_flash_pack_seq.py, tests/test_xt_polar_call.py); a bad value (here: a stack
    with no cross-attention, angles that are no tensors) is a ``TypeError`` naming the keyword."""
    enc = sf.Encoder(dim=16, depth=1, heads=2)
    with pytest.raises(TypeError, match=name):
        enc(torch.randn(1, 3, 16), **{name: value})


@pytest.mark.parametrize("name", ["polar_pos_emb"])
def test_bad_attention_call_arguments_are_refused_by_name(name):
    with pytest.raises(TypeError, match=name):
        sf.Attention(16, heads=2)(torch.randn(1, 3, 16), **{name: torch.zeros(1)})


def test_autoregressive_wrapper_lens_equals_x_transformers():
    import x_transformers.autoregressive_wrapper as xa

    torch.manual_seed(0)
    peer = xa.AutoregressiveWrapper(xt.TransformerWrapper(num_tokens=20, max_seq_len=16,
                                                          attn_layers=xt.Decoder(dim=16, depth=1, heads=2))).eval()
    ours = sf.from_x_transformers(peer).eval()
    x = torch.randint(0, 20, (3, 8))
    lens = torch.tensor([8, 5, 3])
    with torch.no_grad():
        torch.testing.assert_close(ours(x, lens=lens), peer(x, lens=lens), atol=1e-5, rtol=1e-5)
        masked = ours(x, mask=torch.arange(8)[None] < lens[:, None])
    torch.testing.assert_close(ours(x, lens=lens), masked)
    with pytest.raises(ValueError, match="mask or lens"):
        ours(x, lens=lens, mask=torch.ones(3, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="lens"):
        ours(x, lens=torch.tensor([9, 1, 1]))


def test_transform_token_embeds_runs_on_the_embeddings_and_padding_stays_unread():
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=sf.Decoder(dim=16, depth=1, heads=2)).eval()
    x = torch.randint(0, 20, (2, 5))
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    with torch.no_grad():
        doubled = net(x, mask=mask, transform_token_embeds=lambda e: e * 2)
        nan_pad = net(x, mask=mask, transform_token_embeds=lambda e: torch.where(mask[..., None], e * 2, float("nan")))
        ref = net(x, mask=mask, sum_embeds=net.token_emb(x))  # e + e
    torch.testing.assert_close(doubled[mask], ref[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nan_pad[mask], doubled[mask])
    with pytest.raises(ValueError, match="transform_token_embeds must return"):
        net(x, transform_token_embeds=lambda e: e[..., :3])
    with torch.no_grad():  # x-transformers' hook between blocks (tests/test_xt_stack_call_args.py): identity here
        torch.testing.assert_close(net(x, mask=mask, transform_block_inputs=lambda d, h: h)[mask],
                                   net(x, mask=mask)[mask])


def test_continuous_wrapper_call_arguments():
    """``seq_start_pos`` is left padding, ``sum_embeds`` adds to the projected inputs (padded rows unread),
    ``use_identity_if_same_dim`` leaves out equal-width projections, XL memories are refused by name."""
    torch.manual_seed(0)
    net = sf.ContinuousTransformerWrapper(dim_in=16, dim_out=16, max_seq_len=16, use_identity_if_same_dim=True,
                                          attn_layers=sf.Encoder(dim=16, depth=1, heads=2)).eval()
    assert isinstance(net.project_in, torch.nn.Identity) and isinstance(net.project_out, torch.nn.Identity)
    x = torch.randn(2, 5, 16)
    start = torch.tensor([0, 2])
    real = torch.arange(5)[None] >= start[:, None]
    extra = torch.randn(2, 5, 16)
    extra[~real] = float("nan")
    with torch.no_grad():
        got = net(x, seq_start_pos=start, sum_embeds=extra)
        want = net(x + torch.nan_to_num(extra), mask=real)
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()
    with pytest.raises(ValueError, match="sum_embeds must be"):
        net(x, sum_embeds=torch.randn(2, 5, 3))


def test_xtransformer_cross_attn_tokens_dropout():
    kw = dict(dim=16, enc_num_tokens=10, enc_max_seq_len=8, dec_num_tokens=10, dec_max_seq_len=8, enc_depth=1,
              dec_depth=1)
    model = sf.XTransformer(**kw, cross_attn_tokens_dropout=0.25)
    assert model.decoder.net.attn_layers.cross_attn_tokens_dropout == 0.25
    assert model.encoder.attn_layers.cross_attn_tokens_dropout == 0.0
    rebuilt = sf.XTransformer(**model.get_config())
    assert rebuilt.decoder.net.attn_layers.cross_attn_tokens_dropout == 0.25
    with pytest.raises(TypeError, match="given twice"):
        sf.XTransformer(**kw, cross_attn_tokens_dropout=0.25, dec_cross_attn_tokens_dropout=0.5)
    merged = sf.XTransformer(**kw, enc_ff_no_bias=True, enc_ff_solu=True)
    assert merged.encoder.attn_layers.get_config()["ff_kwargs"] == {"no_bias": True, "solu": True}


def test_attention_head_scale_sublayer_dropout_and_depth_init():
    """``Attention(head_scale=True)`` equals x-transformers' on the same weights (gains moved off 1), padded
    queries exactly 0; ``sublayer_dropout`` acts in training only; ``output_proj_depth`` draws OLMo's init."""
    torch.manual_seed(0)
    peer = _perturbed(X.Attention(16, heads=4, dim_head=4, head_scale=True), 5).eval()
    ours = sf.Attention(16, heads=4, dim_head=4, head_scale=True).eval()
    assert ours.head_scale_params.shape == (1, 4, 1, 1)
    ours.load_state_dict(peer.state_dict(), strict=False)
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    with torch.no_grad():
        torch.testing.assert_close(ours(x, mask=mask)[mask], peer(x, mask=mask)[mask], atol=1e-5, rtol=1e-5)
        assert bool((ours(x, mask=mask)[~mask] == 0).all())
    drop = sf.Attention(16, heads=2, sublayer_dropout=0.5)
    drop.eval()
    a = drop(x)
    torch.testing.assert_close(a, drop(x))
    drop.train()
    assert bool((drop(x) == 0).any()) and not bool((a == 0).any())
    torch.manual_seed(0)
    deep = sf.Attention(64, heads=4, dim_head=64, output_proj_depth=3)
    want = (2 * 256 * 3) ** -0.5
    assert abs(deep.to_out.weight.std().item() - want) < 0.1 * want
    with pytest.raises(ValueError, match="head_scale .* hybrid"):
        sf.Attention(16, heads=2, dim_head=8, head_scale=True, hybrid_module=torch.nn.GRU(16, 16, batch_first=True))


def test_gated_no_bias_checkpoint_of_before_loads_strictly():
    """A gated ``FeedForward(no_bias=True)`` saved when its input projection had no bias loads strictly (a zero
    bias) and computes what it computed then."""
    torch.manual_seed(0)
    ff = FeedForward(8, glu=True, no_bias=True)
    with torch.no_grad():
        ff.proj_in.bias.zero_()
    old = {k: v for k, v in ff.state_dict().items() if k != "proj_in.bias"}
    fresh = FeedForward(8, glu=True, no_bias=True)
    fresh.load_state_dict(old, strict=True)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(fresh(x), ff(x))


def test_sparse_topk_keeps_the_top_live_keys_and_reads_no_masked_key():
    """Each query softmaxes over its k largest live logits (all of them when fewer are live); a masked key holding
    NaN, a padded query and a dead row stay safe: finite, 0 where they should be, zero gradient there."""
    torch.manual_seed(0)
    attn = sf.Attention(8, heads=2, dim_head=4, sparse_topk=2)
    x = torch.randn(3, 5, 8)
    mask = torch.tensor([[True] * 5, [True] * 2 + [False] * 3, [True] + [False] * 4])  # 5, 2 and 1 live keys
    planted = x.clone()
    planted[~mask] = float("nan")
    planted.requires_grad_()
    out, weights = attn(planted, mask=mask, return_attn=True)
    assert torch.isfinite(out).all() and bool((out[~mask] == 0).all())
    live_keys = mask[:, None, None, :].expand_as(weights)
    live_rows = mask[:, None, :, None].expand_as(weights)
    counts = ((weights > 0) & live_rows).sum(-1)  # kept keys per live query row
    assert bool((counts[0] == 2).all()) and bool((counts[1][:, :2] == 2).all()) and bool((counts[2][:, :1] == 1).all())
    assert bool((weights[~live_keys] == 0).all())
    torch.testing.assert_close(weights.sum(-1)[live_rows[..., 0]], torch.ones(int(live_rows[..., 0].sum())))
    out.square().sum().backward()
    assert torch.isfinite(planted.grad).all() and bool((planted.grad[~mask] == 0).all())
    with pytest.raises(ValueError, match="sparse_topk must be a positive integer"):
        sf.Attention(8, sparse_topk=0)
    with pytest.raises(ValueError, match="at most one of"):
        sf.Attention(8, sparse_topk=2, sigmoid=True)
    with pytest.raises(ValueError, match="sparse_topk_straight_through needs sparse_topk"):
        sf.Attention(8, sparse_topk_straight_through=True)
    # straight through: the same forward, the full softmax's gradient
    torch.manual_seed(1)
    st = sf.Attention(8, heads=2, dim_head=4, sparse_topk=2, sparse_topk_straight_through=True)
    st.load_state_dict(attn.state_dict())
    leaves = [x.clone().requires_grad_() for _ in range(2)]
    outs = [m(t, mask=mask) for m, t in zip((attn, st), leaves)]
    torch.testing.assert_close(outs[0], outs[1])
    for o in outs:
        o.square().sum().backward()
    assert not torch.allclose(leaves[0].grad, leaves[1].grad)
    assert torch.isfinite(leaves[1].grad).all() and bool((leaves[1].grad[~mask] == 0).all())


def test_hard_attention_one_hot_forward_softmax_gradient_and_safe():
    """``hard``: each live query takes the value of its largest live logit, exactly (one-hot forward); the
    gradient is the softmax's; masked keys holding NaN and dead rows stay out (0, zero gradient)."""
    torch.manual_seed(0)
    attn = sf.Attention(8, heads=2, dim_head=4, hard=True)
    x = torch.randn(2, 4, 8)
    mask = torch.tensor([[True] * 4, [True] * 2 + [False] * 2])
    planted = x.clone()
    planted[~mask] = float("nan")
    planted.requires_grad_()
    out, weights = attn(planted, mask=mask, return_attn=True)
    live_rows = mask[:, None, :, None].expand_as(weights)
    # one_hot + soft - soft.detach(), in x-transformers' order: 0 or 1 up to one rounding
    near = torch.minimum(weights.detach().abs(), (weights.detach() - 1).abs())
    assert bool((near[live_rows] < 1e-6).all())
    torch.testing.assert_close(weights.sum(-1)[live_rows[..., 0]], torch.ones(int(live_rows[..., 0].sum())))
    assert bool((weights[~mask[:, None, None, :].expand_as(weights)] == 0).all()) and bool((out[~mask] == 0).all())
    out.square().sum().backward()
    assert torch.isfinite(planted.grad).all() and bool((planted.grad[~mask] == 0).all())
    assert bool((planted.grad[mask] != 0).any())  # the softmax's gradient reaches the live inputs
    with pytest.raises(ValueError, match="at most one of"):
        sf.Attention(8, hard=True, sigmoid=True)


@pytest.mark.parametrize("opts", [dict(pre_talking_heads=True), dict(post_talking_heads=True),
                                  dict(pre_scale_post_talking_heads=True),
                                  dict(pre_talking_heads=True, post_talking_heads=True, pre_scale_post_talking_heads=True)],
                         ids=["pre", "post", "pre-scale-post", "all"])
def test_talking_heads_mix_only_what_a_query_may_see(opts):
    """Talking heads mixed off the identity: NaN planted at padded positions changes no real output and reaches
    no gradient; padded queries and a fully padded sample give exactly 0; a head-wise mask keeps a masked key's
    weight at 0 in every head."""
    torch.manual_seed(0)
    attn = sf.Attention(8, heads=3, dim_head=4, **opts)
    with torch.no_grad():
        for name in ("pre_softmax_talking_heads", "post_softmax_talking_heads", "pre_scale_post_talking_heads"):
            conv = getattr(attn, name)
            if conv is not None:
                assert torch.equal(conv.weight[:, :, 0, 0], torch.eye(3))  # x-transformers' dirac init
                conv.weight.add_(0.3 * torch.randn(conv.weight.shape))
    x = torch.randn(3, 5, 8)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2, [False] * 5])
    clean = torch.where(mask[..., None], x, 0.0)
    planted = torch.where(mask[..., None], x, float("nan")).requires_grad_()
    out = attn(planted, mask=mask)
    torch.testing.assert_close(out, attn(clean, mask=mask))
    assert bool((out[~mask] == 0).all())
    out.square().sum().backward()
    assert torch.isfinite(planted.grad).all() and bool((planted.grad[~mask] == 0).all())
    per_head = torch.ones(1, 3, 5, 5, dtype=torch.bool)
    per_head[0, 1, :, 2] = False  # key 2 masked for head 1 only
    _, weights = attn(x[:1], attn_mask=per_head, return_attn=True)
    assert bool((weights[0, 1, :, 2] == 0).all()) and torch.isfinite(weights).all()


def test_dynamic_pos_bias_counts_real_tokens_and_decodes():
    """``dynamic_pos_bias``: distances count real tokens (a left-padded sample equals itself alone), the cached
    decode equals the full forward, x-transformers' module keys (``rel_pos.mlp.*``), clear errors."""
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=sf.Decoder(
        dim=16, depth=2, heads=2, dynamic_pos_bias=True, dynamic_pos_bias_log_distance=True)).eval()
    assert all(k.startswith("mlp.") for k in net.attn_layers.rel_pos.state_dict())
    x = torch.randint(0, 20, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), x], dim=1)
    mask = torch.tensor([[False] * 3 + [True] * 6])
    with torch.no_grad():
        torch.testing.assert_close(net(padded, mask=mask)[:, 3:], net(x), atol=1e-5, rtol=1e-5)
        full = net(x)
        out, cache = net(x[:, :4], return_cache=True)
        step1, cache = net(x[:, 4:5], cache=cache, return_cache=True)
        step2 = net(x[:, 5:6], cache=cache)
    torch.testing.assert_close(torch.cat([out, step1, step2], dim=1), full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="need dynamic_pos_bias=True"):
        sf.Decoder(dim=16, depth=1, dynamic_pos_bias_norm=True)
    with pytest.raises(ValueError, match="choose one relative position bias"):
        sf.Decoder(dim=16, depth=1, dynamic_pos_bias=True, rel_pos_bias=True)


def test_zero_kv_leaves_no_row_dead_and_a_lone_query_gives_zero():
    """``add_zero_kv``: a query whose every key is masked (a dropped context) attends to the zero key only and
    outputs exactly 0 with zero gradient; NaN at masked keys reaches nothing; x-transformers' equal on padded
    cross-attention."""
    torch.manual_seed(0)
    attn = sf.Attention(8, heads=2, dim_head=4, add_zero_kv=True)
    x, ctx = torch.randn(2, 3, 8), torch.randn(2, 4, 8)
    cmask = torch.tensor([[True, True, False, False], [False] * 4])
    planted = torch.where(cmask[..., None], ctx, float("nan")).requires_grad_()
    xq = x.clone().requires_grad_()
    out = attn(xq, planted, context_mask=cmask)
    assert bool((out[1] == 0).all()) and torch.isfinite(out).all()
    out.square().sum().backward()
    assert bool((xq.grad[1] == 0).all()) and bool((planted.grad[~cmask] == 0).all())
    peer = X.Attention(8, heads=2, dim_head=4, add_zero_kv=True)
    peer.load_state_dict(attn.state_dict(), strict=False)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, ctx, context_mask=cmask), peer(x, ctx, context_mask=cmask), atol=1e-5, rtol=1e-5)


def test_rotate_num_heads_rotates_the_last_heads_and_decodes():
    """``rotate_num_heads``: only the last heads' queries and keys are rotated (the others are position-free);
    the KV cache decodes as the full forward; clear errors (needs rotary, not with grouped heads, in range)."""
    torch.manual_seed(0)
    attn = sf.Attention(16, heads=4, dim_head=8, rotate_num_heads=1)
    t = torch.randn(2, 4, 3, 8)
    angles = torch.randn(1, 1, 3, 4)
    out = attn._rotate(t, angles)
    torch.testing.assert_close(out[:, :3], t[:, :3])
    assert not torch.allclose(out[:, 3:], t[:, 3:])
    net = sf.TransformerWrapper(num_tokens=20, max_seq_len=0, attn_layers=sf.Decoder(
        dim=32, depth=2, heads=4, rotary_pos_emb=True, rotate_num_heads=2)).eval()
    x = torch.randint(0, 20, (1, 7))
    with torch.no_grad():
        full = net(x)
        first, cache = net(x[:, :5], return_cache=True)
        rest = net(x[:, 5:], cache=cache)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="needs rotary_pos_emb"):
        sf.Decoder(dim=32, depth=1, heads=4, rotate_num_heads=2)
    with pytest.raises(ValueError, match="grouped key/value heads"):
        sf.Attention(16, heads=4, dim_head=8, kv_heads=2, rotate_num_heads=1)
    with pytest.raises(ValueError, match="rotate_num_heads must be an integer in"):
        sf.Attention(16, heads=4, dim_head=8, rotate_num_heads=5)
