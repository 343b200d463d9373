"""``from_x_transformers`` on x-transformers' newer options: equal outputs on the same weights (float32), and a
clear refusal where safeformer has no exact counterpart."""

import pytest
import torch

import safeformer as sf

xt = pytest.importorskip("x_transformers")


def _same(m, s, *args, **kwargs):
    m.eval(), s.eval()
    torch.testing.assert_close(s(*args, **kwargs), m(*args, **kwargs), rtol=1e-5, atol=1e-5)


def test_attn_pool_converts():
    torch.manual_seed(0)
    m = xt.TransformerWrapper(num_tokens=20, max_seq_len=8, attn_pool=True, num_pooled_tokens=3, dim_pooled_tokens=7,
                              attn_layers=xt.Encoder(dim=16, depth=2, heads=2, attn_dim_head=8))
    s = sf.from_x_transformers(m)
    assert s.get_config()["num_pooled_tokens"] == 3
    _same(m, s, torch.randint(0, 20, (2, 6)))


def test_attn_pool_deeper_than_one_is_refused():
    m = xt.TransformerWrapper(num_tokens=20, max_seq_len=8, attn_pool=True, attn_pool_depth=2,
                              attn_layers=xt.Encoder(dim=16, depth=1, heads=2, attn_dim_head=8))
    with pytest.raises(ValueError, match="attn_pool_depth"):
        sf.from_x_transformers(m)


def test_ff_deep_embed_converts():
    torch.manual_seed(0)
    m = xt.TransformerWrapper(num_tokens=20, max_seq_len=8, ff_deep_embed=True,
                              attn_layers=xt.Decoder(dim=16, depth=2, heads=2, attn_dim_head=8))
    with torch.no_grad():
        m.ff_deep_embed.normal_()
    _same(m, sf.from_x_transformers(m), torch.randint(0, 20, (2, 6)))


# ---- residual routing (block.ResidualRouting) and per-layer schedules

DIM, HEADS, DIM_HEAD, VOCAB = 16, 2, 8, 30


def _perturbed(model: torch.nn.Module, seed: int = 0, scale: float = 0.2) -> torch.nn.Module:
    """``model`` with every parameter moved off its initial value (so zero-initialised gates count)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model.eval()


def _xt_net(encoder: bool = False, depth: int = 2, seed: int = 0, wrapper: dict | None = None, **opts):
    torch.manual_seed(seed)
    cls = xt.Encoder if encoder else xt.Decoder
    layers = cls(dim=DIM, depth=depth, heads=HEADS, attn_dim_head=DIM_HEAD, **opts)
    return _perturbed(xt.TransformerWrapper(num_tokens=VOCAB, max_seq_len=16, attn_layers=layers, **(wrapper or {})), seed)


def _parity(m, padded: bool = True, atol: float = 1e-5, n: int = 9, **kwargs):
    """The converted model gives x-transformers' outputs, unpadded and (``padded``) at the real positions of a
    right-padded batch; returns the converted model."""
    s = sf.from_x_transformers(m).eval()
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, n))
    with torch.no_grad():
        torch.testing.assert_close(s(tokens, **kwargs), m(tokens, **kwargs), atol=atol, rtol=atol)
        if padded:
            mask = torch.tensor([[True] * n, [True] * (n - 3) + [False] * 3])
            got, want = s(tokens, mask=mask, **kwargs), m(tokens, mask=mask, **kwargs)
            torch.testing.assert_close(got[mask], want[mask], atol=atol, rtol=atol)
    return s


ROUTING = [
    dict(unet_skips=True, depth=4),
    dict(unet_skips=True, depth=5, encoder=True),
    dict(reinject_input=True),
    dict(reinject_input=True, learned_reinject_input_gate=True),
    dict(pre_and_post_norm=True),
    dict(pre_and_post_norm=True, use_rmsnorm=True),
    dict(integrate_layers=True, depth=3),
    dict(integrate_layers=True, layer_integrate_use_softmax=False),
    dict(mv_split_residual=True),
    dict(mv_split_residual=True, residual_fn_kwargs=dict(learned=True), pre_and_post_norm=True),
    dict(orthog_residual=True),
    dict(ff_mult=(4, 2, 1), depth=3, attn_dropout=(0.0, 0.1, 0.2), ff_dropout=(0.3, 0.2, 0.1)),
    dict(ff_mult=(3, 1), cross_attend=True, attn_dropout=0.1, cross_attn_dropout=0.2),
    dict(pre_norm_has_final_norm=False),
]


@pytest.mark.parametrize("opts", ROUTING, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_routing_options_convert(opts):
    """Same outputs; orthog_residual reduces over padded positions in x-transformers (safeformer selects them
    away), so it is compared unpadded only."""
    opts = dict(opts)
    cross = opts.get("cross_attend", False)
    m = _xt_net(**opts)
    kwargs = dict(context=torch.randn(2, 3, DIM)) if cross else {}
    s = _parity(m, padded=not opts.get("orthog_residual"), **kwargs)
    cfg = s.attn_layers.get_config()
    for key in ("unet_skips", "reinject_input", "learned_reinject_input_gate", "pre_and_post_norm", "integrate_layers",
                "mv_split_residual", "orthog_residual", "ff_mult", "ff_dropout"):
        if key in opts:
            want = opts[key]
            assert (list(cfg[key]) == list(want)) if isinstance(want, tuple) else cfg[key] == want, key
    drops = [(blk.kind, blk.mixer.dropout) for blk in s.attn_layers.layers if blk.kind != "ff"]
    xt_drops = [(k, blk.attend.dropout) for k, (_, blk, _) in zip(m.attn_layers.layer_types, m.attn_layers.layers)
                if k != "f"]
    assert [d for _, d in drops] == pytest.approx([d for _, d in xt_drops])


def test_hyper_connections_are_refused_with_the_reason():
    m = _xt_net(num_residual_streams=2)
    with pytest.raises(ValueError, match=r"num_residual_streams=2 \(hyper-connections\).*all-ones"):
        sf.from_x_transformers(m)


# ---- attention scoring options

SCORING = [
    dict(attn_l2_distance=True),
    dict(attn_cog_signed=True, attn_kv_heads=1),
    dict(attn_sigmoid=True, cross_attend=True),
    dict(attn_laser=True, attn_laser_softclamp_value=3.0),
    dict(attn_use_latent_q=True, attn_dim_latent_q=12, attn_use_latent_kv=True, attn_dim_latent_kv=10),
    dict(attn_use_latent_kv=True, attn_dim_latent_kv=10, attn_latent_rope_subheads=1, heads=4, attn_dim_head=4),
    dict(attn_use_latent_kv=True, attn_dim_latent_kv=8, attn_latent_rope_subheads=1, rotary_pos_emb=True),
    dict(attn_use_cope=True, attn_cope_max_pos=4),
    dict(attn_use_rel_proj_pos_bias=True, attn_rel_proj_max_dist=8, attn_kv_heads=1),
    dict(cross_attend=True, cross_attn_inverted_attention=True, encoder=True),
]


@pytest.mark.parametrize("opts", SCORING, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_scoring_options_convert(opts):
    opts = dict(opts)
    cross = opts.get("cross_attend", False)
    heads, dh = opts.pop("heads", HEADS), opts.pop("attn_dim_head", DIM_HEAD)
    torch.manual_seed(0)
    cls = xt.Encoder if opts.pop("encoder", False) else xt.Decoder
    m = _perturbed(xt.TransformerWrapper(num_tokens=VOCAB, max_seq_len=16, attn_layers=cls(
        dim=DIM, depth=2, heads=heads, attn_dim_head=dh, **opts)))
    kwargs = dict(context=torch.randn(2, 3, DIM), context_mask=torch.tensor([[True, True, False], [True] * 3])) \
        if cross else {}
    s = _parity(m, **kwargs)
    cfg = s.attn_layers.get_config()
    for key, value in opts.items():
        if key.startswith("attn_") and key != "attn_kv_heads":
            assert cfg[key] == value, key


def test_laser_with_a_learned_sink_is_refused():
    """safeformer's sink key holds a zero value, which laser's exp makes 1: not x-transformers' numbers."""
    with pytest.raises(ValueError, match="attn_laser with attn_head_learned_sink"):
        sf.from_x_transformers(_xt_net(attn_laser=True, attn_head_learned_sink=True))


# ---- positions, norms and feed-forward options

MODULES = [
    dict(alibi_pos_bias=True, alibi_num_heads=1, heads=4, wrapper=dict(use_abs_pos_emb=False)),
    dict(alibi_pos_bias=True, rel_pos_kwargs=dict(slopes=[0.7, 0.1, 0.0, 0.3]), heads=4, attn_kv_heads=2,
         wrapper=dict(use_abs_pos_emb=False)),
    dict(rotary_pos_emb=True, rotary_xpos=True, rotary_xpos_scale_base=8),
    dict(polar_pos_emb=True),  # (x-transformers 2.31.10 fails to build polar_bias_uniform_init=True)
    dict(use_derf=True),
    dict(ff_custom_activation=torch.nn.Tanh()),
    dict(ff_glu=True, ff_custom_activation=torch.nn.ReLU()),
    dict(ff_glu=True, ff_glu_softclamp=True, ff_glu_gate_softclamp_value=0.5, ff_glu_up_softclamp_value=0.7),
    dict(ff_glu=True, ff_swish=True, ff_glu_softclamp=True),
    dict(rel_pos_bias=True, rel_pos_num_buckets=8, rel_pos_max_distance=20, heads=4, attn_kv_heads=2),
]


@pytest.mark.parametrize("opts", MODULES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_module_options_convert(opts):
    opts = dict(opts)
    wrapper, heads = opts.pop("wrapper", None), opts.pop("heads", HEADS)
    torch.manual_seed(0)
    m = _perturbed(xt.TransformerWrapper(num_tokens=VOCAB, max_seq_len=16, **(wrapper or {}), attn_layers=xt.Decoder(
        dim=DIM, depth=2, heads=heads, attn_dim_head=DIM_HEAD, **opts)))
    if opts.get("alibi_pos_bias"):  # slopes are a buffer: set them as given (perturbing moved only parameters)
        assert m.attn_layers.rel_pos.slopes.flatten().tolist() == pytest.approx(
            opts.get("rel_pos_kwargs", {}).get("slopes") or m.attn_layers.rel_pos.slopes.flatten().tolist())
    s = _parity(m)
    cfg = s.attn_layers.get_config()
    for key in ("alibi_num_heads", "rotary_xpos", "polar_pos_emb", "use_derf", "ff_glu_softclamp", "rel_pos_num_buckets"):
        if key in opts:
            assert cfg[key] == opts[key], key


def test_xpos_and_polar_keep_refusing_an_absolute_embedding():
    m = _xt_net(polar_pos_emb=True, disable_abs_pos_emb=False)
    with pytest.raises(ValueError, match="polar_pos_emb with the absolute position embedding"):
        sf.from_x_transformers(m)


@pytest.mark.parametrize("causal", [True, False])
def test_hybrid_module_converts(causal):
    """A GRU beside attention: a causal one compared padded too, a bidirectional one (which reads x-transformers'
    padding, and the zeros its fold pads an odd length with) unpadded, at an even length."""
    gru = torch.nn.GRU(DIM, HEADS * DIM_HEAD // (1 if causal else 2), batch_first=True, bidirectional=not causal)
    m = _xt_net(encoder=not causal, attn_hybrid_module=gru, attn_hybrid_fold_axial_dim=1 if causal else 2,
                attn_hybrid_learned_mix=not causal)
    s = _parity(m, padded=causal, n=9 if causal else 8)
    assert s.attn_layers.get_config()["attn_hybrid_fold_axial_dim"] == (1 if causal else 2)


# ---- wrapper options

def test_looped_converts():
    """The looped LM (pre_and_post_norm stack, exit gate): the same logits, also with other step counts."""
    m = _xt_net(pre_and_post_norm=True, wrapper=dict(looped=True, max_looped_steps=3))
    s = _parity(m)
    assert s.get_config()["max_looped_steps"] == 3
    tokens = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(s(tokens, looped_steps=2), m(tokens, looped_steps=2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("opts", [dict(mixture_of_softmax=True, mixture_of_softmax_k=3),
                                  dict(recycling=True, train_max_recycle_steps=2),
                                  dict(add_continuous_pred_head=True),
                                  dict(logits_dim=1, squeeze_out_last_dim=True)],
                         ids=lambda c: next(iter(c)) if "logits_dim" not in c else "squeeze_out_last_dim")
def test_head_options_convert(opts):
    m = _xt_net(wrapper=opts)
    s = _parity(m, **(dict(recycle_steps=2) if opts.get("recycling") else {}))
    cfg = s.get_config()
    for key, value in opts.items():
        assert cfg[key] == value, key


def test_continuous_pred_head_predicts_the_same_embeddings():
    m = _xt_net(wrapper=dict(add_continuous_pred_head=True))
    s = sf.from_x_transformers(m).eval()
    tokens = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        (got, (pred, _)), (want, (wpred, _)) = (f(tokens, return_next_embed_pred=True) for f in (s, m))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pred, wpred, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("wopts", [dict(emb_dim=8), dict(emb_dim=24, num_memory_tokens=2), dict(num_output_heads=3),
                                   dict(num_memory_tokens=2, memory_tokens_interspersed_every=4),
                                   dict(sigsoftmax_logits=True), dict(embed_num_tokens=dict(kind=3, part=5)),
                                   dict(emb_dim=8, embed_num_tokens=dict(kind=3), num_output_heads=2)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_embedding_and_output_options_convert(wopts):
    m = _xt_net(wrapper=wopts)
    s = sf.from_x_transformers(m).eval()
    cfg = s.get_config()
    for key, value in wopts.items():
        assert cfg[key] == value, key
    tokens = torch.randint(0, VOCAB, (2, 9))
    kw = {"embed_ids": {name: torch.randint(0, n, (2, 9)) for name, n in wopts["embed_num_tokens"].items()}} \
        if "embed_num_tokens" in wopts else {}
    mask = torch.tensor([[True] * 9, [True] * 6 + [False] * 3])
    with torch.no_grad():
        # (x-transformers 2.31.10 fails on a mask with memory_tokens_interspersed_every: compared unpadded)
        for msk in (None,) if "memory_tokens_interspersed_every" in wopts else (None, mask):
            got, want = s(tokens, mask=msk, **kw), m(tokens, mask=msk, **kw)
            real = torch.ones(2, 9, dtype=torch.bool) if msk is None else msk
            got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
            assert len(got) == len(want) == wopts.get("num_output_heads", 1)
            for a, b in zip(got, want):
                torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=1e-5)


def test_xtransformer_and_autoregressive_wrappers_carry_the_new_options(tmp_path):
    """Per-side options land in enc_options / dec_options; a looped net converts inside AutoregressiveWrapper;
    a converted model with routing, per-layer widths and ALiBi on some heads saves and reloads as it is."""
    torch.manual_seed(0)
    m = _perturbed(xt.XTransformer(dim=DIM, enc_num_tokens=VOCAB, enc_depth=2, enc_heads=2, enc_max_seq_len=16,
                                   dec_num_tokens=VOCAB, dec_depth=2, dec_heads=2, dec_max_seq_len=16,
                                   enc_reinject_input=True, dec_ff_mult=(2, 3), dec_attn_l2_distance=True,
                                   tie_token_emb=False))
    m.encoder.to_logits = None
    s = sf.from_x_transformers(m).eval()
    src, tgt = torch.randint(0, VOCAB, (2, 6)), torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(s(src, tgt), m(src, tgt), atol=1e-5, rtol=1e-5)
    ar = xt.AutoregressiveWrapper(_xt_net(pre_and_post_norm=True, wrapper=dict(looped=True, max_looped_steps=2)))
    with torch.no_grad():
        torch.testing.assert_close(sf.from_x_transformers(ar)(tgt), ar(tgt), atol=1e-5, rtol=1e-5)
    net = sf.from_x_transformers(_xt_net(unet_skips=True, depth=4, ff_mult=(4, 3, 2, 1), alibi_pos_bias=True,
                                         alibi_num_heads=1, wrapper=dict(use_abs_pos_emb=False, emb_dim=8))).eval()
    net.save_pretrained(tmp_path)
    back = sf.TransformerWrapper.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tgt), net(tgt))


# ---- layer patterns and residual-path options

STACK = [
    dict(custom_layers=("a", "f", "a", "a", "f"), depth=None),
    dict(custom_layers=("a", "c", "f", "c", "f"), cross_attend=True, depth=None),
    dict(depth=3, par_ratio=2),
    dict(depth=3, sandwich_coef=1),
    dict(macaron=True),
    dict(depth=3, weight_tie_layers=True),
    dict(layers_execute_order=(0, 1, 0, 1, 2, 3)),
    dict(only_attn=True, cross_attend=True),
    dict(sandwich_norm=True, use_layerscale=True, layerscale_init_value=0.1),
    dict(pre_norm=False),
    dict(scale_residual=True, scale_residual_constant=0.7, softclamp_output=True, softclamp_output_value=2.0),
    dict(scale_residual=0.5),
    dict(depth_scale_residual=0.5, macaron=True, use_rmsnorm=True),
    dict(gate_residual=True, scale_residual=True),
    dict(shift_tokens=1),
    dict(shift_tokens=(2, 0, 1, 0), encoder=True),
    dict(depth=3, residual_attn=True, alibi_pos_bias=True, wrapper=dict(use_abs_pos_emb=False)),
    dict(residual_attn=True, cross_residual_attn=True, cross_attend=True, encoder=True),
]


@pytest.mark.parametrize("opts", STACK, ids=lambda c: ",".join(k for k in c if k not in ("depth", "wrapper")))
def test_stack_options_convert(opts):
    """Same outputs, unpadded and right-padded (a bidirectional shift reads x-transformers' padding: unpadded)."""
    opts = dict(opts)
    cross = opts.get("cross_attend", False)
    m = _xt_net(**{"depth": 2, **opts})
    kwargs = dict(context=torch.randn(2, 3, DIM), context_mask=torch.tensor([[True, True, False], [True] * 3])) \
        if cross else {}
    s = _parity(m, padded=not (opts.get("encoder") and opts.get("shift_tokens")), **kwargs)
    assert tuple(s.attn_layers.layer_types) == tuple(m.attn_layers.layer_types)


ADAPTIVE = [
    dict(use_adaptive_layernorm=True),
    dict(use_adaptive_rmsnorm=True, use_adaptive_layerscale=True, dim_condition=6),
    dict(use_adaptive_layerscale=True, dim_condition=6, adaptive_condition_mlp=True, adaptive_condition_mlp_expansion=2),
    dict(use_adaptive_rmsnorm=True, pre_and_post_norm=True, dim_condition=6),
]


@pytest.mark.parametrize("opts", ADAPTIVE, ids=lambda c: ",".join(k for k in c if k.startswith(("use_", "adaptive",
                                                                                                    "pre_and"))))
def test_adaptive_options_convert(opts):
    """DiT-style conditioning: adaptive norms (no shift in x-transformers: safeformer's to_beta stays 0), adaptive
    layerscale, the condition MLP; the same outputs for a per-sample condition."""
    m = _xt_net(**opts)
    condition = torch.randn(2, opts.get("dim_condition", DIM))
    s = _parity(m, condition=condition)
    assert s.attn_layers.get_config()["dim_condition"] == opts.get("dim_condition", DIM)


@pytest.mark.parametrize("opts,expected", [
    (dict(attn_gate_value_heads=True), "attn_gate_value_heads"),
    (dict(gated_multi_residual=True, num_residual_streams=2, residual_fn_kwargs=dict(read_gate_rank=4)),
     "gated_multi_residual"),
    (dict(attn_use_cope=True, attn_cope_talking_heads=True), "cope_talking_heads"),
    (dict(attn_gumbel_softmax=True), "attn_gumbel_softmax"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_what_has_no_counterpart_stays_refused(opts, expected):
    with pytest.raises(ValueError, match="cannot represent") as info:
        sf.from_x_transformers(_xt_net(**opts))
    assert expected in str(info.value)


@pytest.mark.parametrize("opts", [dict(orthog_residual=True),
                                  dict(rotary_pos_emb=True, rotary_xpos=True, rotary_xpos_scale_base=8, attn_num_mem_kv=2),
                                  dict(shift_tokens=1, encoder=True)],
                         ids=["orthog_residual", "rotary_xpos+attn_num_mem_kv", "bidirectional shift_tokens"])
def test_where_x_transformers_reads_padding_the_conversion_equals_it_on_each_sample_alone(opts):
    """x-transformers' outputs move with right padding here (orthog_residual reduces over padded positions, xpos scales
    memory keys by the padded length, a bidirectional shift reads padded rows); the converted model's padded outputs
    equal x-transformers' on each sample alone."""
    m = _xt_net(**opts)
    s = sf.from_x_transformers(m).eval()
    tokens = torch.randint(0, VOCAB, (2, 9))
    mask = torch.tensor([[True] * 9, [True] * 6 + [False] * 3])
    with torch.no_grad():
        got = s(tokens, mask=mask)
        for b in range(2):
            alone = m(tokens[b : b + 1, mask[b]])
            torch.testing.assert_close(got[b, mask[b]], alone[0], atol=1e-5, rtol=1e-5)


def test_autoregressive_wrapper_loss_options_carry_over():
    """An x-transformers AutoregressiveWrapper's looped-loss options convert with the net: the same loss (the
    options are not dropped back to their defaults)."""
    m = _xt_net(pre_and_post_norm=True, wrapper=dict(looped=True, max_looped_steps=3))
    ar = xt.AutoregressiveWrapper(m, looped_loss_threshold_exit=0.2, looped_loss_slope=20, looped_exit_loss_weight=0.5)
    s = sf.from_x_transformers(ar)
    assert (s.looped_loss_threshold_exit, s.looped_loss_slope, s.looped_exit_loss_weight) == (0.2, 20, 0.5)
    ar.eval(), s.eval()
    seq = torch.randint(0, 20, (2, 8))
    torch.testing.assert_close(s(seq), ar(seq), rtol=1e-5, atol=1e-5)


def test_attn_z_loss_stays_refused_with_the_reason():
    ar = xt.AutoregressiveWrapper(_xt_net(), add_attn_z_loss=True)
    with pytest.raises(ValueError, match="z-loss counts"):
        sf.from_x_transformers(ar)
