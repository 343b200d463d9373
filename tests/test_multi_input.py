"""``MultiInputTransformerWrapper`` (safeformer/multi_input.py): a float64 reference, the safety contract
(S1-S4, S8, S9: garbage at padded ids, padded ``sum_embeds`` rows and masked context positions; fully
padded samples), the KV cache under both protocols, checkpoints, and parity with x-transformers'
``MultiInputTransformerWrapper`` on converted weights (float32).

Shape legend: b batch, n positions, j context length, c width, v a vocabulary.
"""

from __future__ import annotations

import helpers as hp
import pytest
import torch
from doors import INF, NAN, PLANT_VALUES, Probe, _gen, _leaf, _lengths_mask
from torch import Tensor

import safeformer as sf
from safeformer.research.multi_input import MultiInputTransformerWrapper, multi_input_from_x_transformers

VOCABS = {"note": 7, "pitch": 11, "tone": 5}


def _model(*, cross: bool = False, memory: int = 0, rotary: bool = False, dtype=torch.float32, **kw) -> MultiInputTransformerWrapper:
    torch.manual_seed(0)
    layers = sf.Decoder(dim=16, depth=2, heads=2, dim_head=8, rotary_pos_emb=rotary, cross_attend=cross,
                        **({"dim_context": 6} if cross else {}))
    return MultiInputTransformerWrapper(num_tokens=VOCABS, max_seq_len=32, attn_layers=layers,
                                        num_memory_tokens=memory or None, **kw).to(dtype)


def _ids(g: torch.Generator, b: int, n: int) -> dict[str, Tensor]:
    return {k: torch.randint(0, v, (b, n), generator=g) for k, v in VOCABS.items()}


def _garbage(ids: dict[str, Tensor], mask: Tensor, value: float) -> dict[str, Tensor]:
    """Ids outside every vocabulary at padded positions (the value decides which)."""
    bad = 0 if value == 0 else (10**6 if value == value else -7)
    return {k: t.masked_fill(~mask, bad) for k, t in ids.items()}


def _ref(model: MultiInputTransformerWrapper, ids: dict[str, Tensor], mask: Tensor | None, sum_embeds=None, **ctx):
    """float64 logits: the summed embeddings (and sum_embeds) plus the scaled absolute position of each real
    token, the stack (``hp.ref_stack``), one head per input."""
    b, n = next(iter(ids.values())).shape
    h = sum(model.embeds[f"{k}_embed"].weight.detach().double()[t if mask is None else torch.where(mask, t, 0)]
            for k, t in ids.items())
    if sum_embeds is not None:
        h = h + (sum_embeds.double() if mask is None else torch.where(mask[..., None], sum_embeds.double(), 0.0))
    if model.pos_emb is not None:
        h = h + model.pos_emb.emb.weight.detach().double()[hp.ref_positions(mask, b, n)] * model.pos_emb.scale
    h = hp.ref_stack(model.attn_layers, h, mask=mask, **ctx)
    return {k: h @ head.weight.detach().double().T for k, head in model.to_logits.items()}, h


# ----------------------------------------------------------------------------------------------------
# the math
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rotary", [False, True])
def test_equals_float64_reference(dtype, rotary):
    g = _gen(1)
    model = _model(cross=True, rotary=rotary, dtype=dtype).eval()
    b, n, j = 4, 6, 3
    mask = _lengths_mask(g, b, n)
    ids = _ids(g, b, n)
    se = torch.randn(b, n, 16, generator=g, dtype=dtype)
    ctx, ctx_mask = torch.randn(b, j, 6, generator=g, dtype=dtype), _lengths_mask(g, b, j)
    got, h = model(ids, mask=mask, sum_embeds=se, context=ctx, context_mask=ctx_mask, return_logits_and_embeddings=True)
    want, want_h = _ref(model, ids, mask, se, context=ctx, context_mask=ctx_mask)
    assert set(got) == set(VOCABS)
    for k in VOCABS:
        assert got[k].shape == (b, n, VOCABS[k]) and got[k].dtype == dtype
        hp.assert_close(got[k][mask], want[k][mask], f"logits[{k}]")
        hp.assert_zero(got[k][~mask], f"logits[{k}] at padded positions")
    hp.assert_close(h[mask], want_h[mask], "embeddings")
    assert torch.equal(model(ids, mask=mask, sum_embeds=se, context=ctx, context_mask=ctx_mask, return_embeddings=True), h)


def test_one_input_is_a_transformer_wrapper():
    """With one input and the same weights, the model is ``TransformerWrapper`` exactly."""
    torch.manual_seed(0)
    layers = sf.Decoder(dim=16, depth=2, heads=2, dim_head=8)
    multi = MultiInputTransformerWrapper(num_tokens={"tok": 9}, max_seq_len=16, attn_layers=layers).eval()
    single = sf.TransformerWrapper(num_tokens=9, max_seq_len=16, attn_layers=layers).eval()
    with torch.no_grad():
        single.token_emb.weight.copy_(multi.embeds["tok_embed"].weight)
        single.pos_emb.emb.weight.copy_(multi.pos_emb.emb.weight)
        single.to_logits.weight.copy_(multi.to_logits["tok"].weight)
    g = _gen(2)
    x, mask = torch.randint(0, 9, (3, 7), generator=g), _lengths_mask(g, 3, 7, left=True)
    hp.assert_bitwise(multi({"tok": x}, mask=mask)["tok"], single(x, mask=mask))


def test_unpadded_path_equals_padded_path():
    """The stack's unpadded path (real tokens only) gives the padded path's logits, exactly 0 at padding."""
    g = _gen(10)
    b, n = 4, 7
    mask = _lengths_mask(g, b, n, left=True)
    ids = _ids(g, b, n)
    outs = []
    for unpadded in (False, True):
        torch.manual_seed(0)
        layers = sf.Decoder(dim=16, depth=2, heads=2, dim_head=8, unpadded=unpadded)
        model = MultiInputTransformerWrapper(num_tokens=VOCABS, max_seq_len=32, attn_layers=layers).eval()
        outs.append(model(_garbage(ids, mask, NAN), mask=mask))
    for k in VOCABS:
        hp.assert_close(outs[1][k], outs[0][k], k)
        hp.assert_zero(outs[1][k][~mask], f"{k} at padded positions (unpadded path)")


@pytest.mark.parametrize("left", [False, True])
def test_padding_does_not_matter(left):
    """S4: each sample alone equals its row in a padded batch (left or right), garbage ids in the padding."""
    g = _gen(3)
    model = _model(memory=2).eval()
    b, n = 3, 6
    mask = _lengths_mask(g, b, n, left=left)
    ids = _ids(g, b, n)
    got = model(_garbage(ids, mask, NAN), mask=mask)
    for s in range(b):
        real = mask[s]
        if not bool(real.any()):
            for k in VOCABS:
                hp.assert_zero(got[k][s], "a fully padded sample")
            continue
        alone = model({k: t[s : s + 1, real] for k, t in ids.items()})
        for k in VOCABS:
            hp.assert_close(got[k][s, real], alone[k][0], f"sample {s}, {k}")


def test_prefix_memory_and_condition():
    """prepend_embeds with a fully masked prefix row equals no prefix; return_intermediates keeps the memory
    tokens; excise_prepend_embeds cuts the prefix."""
    g = _gen(4)
    model = _model(memory=2).eval()
    b, n, m = 2, 5, 3
    ids = _ids(g, b, n)
    pre = torch.randn(b, m, 16, generator=g)
    pre_mask = torch.zeros(b, m, dtype=torch.bool)
    out = model(ids, prepend_embeds=pre.masked_fill(~pre_mask[..., None], NAN), prepend_mask=pre_mask,
                excise_prepend_embeds=True)
    plain = model(ids)
    for k in VOCABS:
        hp.assert_close(out[k], plain[k], k)
    out, inter = model(ids, return_intermediates=True)
    assert inter.memory_tokens.shape == (b, 2, 16)
    maps = model(ids, return_attn=True)[1]
    assert len(maps) == 2 and all(torch.isfinite(a).all() for a in maps)


@pytest.mark.parametrize("protocol", ["kvcache", "intermediates"])
def test_cache_equals_full_forward(protocol):
    g = _gen(5)
    model = _model(memory=1, rotary=True).eval()
    b, n = 3, 7
    mask = _lengths_mask(g, b, n, left=True, empty=False)
    ids = _ids(g, b, n)
    full = model(ids, mask=mask)
    with torch.no_grad():
        if protocol == "kvcache":
            first = {k: t[:, :4] for k, t in ids.items()}
            _, cache = model(first, mask=mask[:, :4], return_cache=True)
            steps = []
            for t in range(4, n):
                out, cache = model({k: v[:, t : t + 1] for k, v in ids.items()}, mask=mask[:, t : t + 1], cache=cache,
                                   return_cache=True)
                steps.append(out)
        else:
            _, inter = model({k: t[:, :4] for k, t in ids.items()}, mask=mask[:, :4], return_intermediates=True)
            steps = []
            for t in range(4, n):
                out, inter = model({k: v[:, : t + 1] for k, v in ids.items()}, mask=mask[:, : t + 1], cache=inter,
                                   return_intermediates=True)
                steps.append(out)
    for i, out in enumerate(steps):
        for k in VOCABS:
            hp.assert_close(out[k][:, 0], full[k][:, 4 + i], f"step {i}, {k}")


def test_all_padding_batch_gives_zero_not_missing_gradients():
    """S8: an all-padding batch: logits exactly 0, and every parameter gets a gradient (zeros), none missing."""
    model = _model(cross=True).train()
    g = _gen(6)
    ids = _ids(g, 2, 4)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    out = model(_garbage(ids, mask, INF), mask=mask, context=torch.randn(2, 3, 6), context_mask=torch.zeros(2, 3, dtype=torch.bool))
    loss = sum(o.sum() for o in out.values())
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    names = [n for n, _ in model.named_parameters()]
    missing = [nm for nm, gr in zip(names, grads) if gr is None]
    assert not missing, f"no gradient reached {missing}"
    for nm, gr in zip(names, grads):
        hp.assert_zero(gr, f"grad of {nm}")
    for k in VOCABS:
        hp.assert_zero(out[k], k)


def test_save_and_load(tmp_path):
    model = _model(cross=True, memory=2).eval()
    model.save_pretrained(tmp_path / "ckpt")
    again = MultiInputTransformerWrapper.from_pretrained(tmp_path / "ckpt").eval()
    g = _gen(7)
    ids = _ids(g, 2, 5)
    ctx = torch.randn(2, 3, 6, generator=g)
    a, b = model(ids, context=ctx), again(ids, context=ctx)
    for k in VOCABS:
        hp.assert_bitwise(a[k], b[k], k)


# ----------------------------------------------------------------------------------------------------
# the contract (the probe below is the door's registry probe)
# ----------------------------------------------------------------------------------------------------


def probe_multi_input(seed: int, value: float) -> Probe:
    """``MultiInputTransformerWrapper`` (a Decoder with cross-attention and memory tokens by seed): garbage ids
    at padded positions, ``value`` in padded rows of ``sum_embeds`` and at masked context positions (one
    sample's context empty), left or right padding with one sample fully padded. The output is every
    head's logits side by side; those of padded positions are exactly 0."""
    g = _gen(seed)
    b, n, j = 4, 5, 3
    model = _model(cross=True, memory=seed % 3, rotary=bool(seed % 2)).train()
    mask = _lengths_mask(g, b, n, left=seed % 4 < 2)
    ctx_mask = _lengths_mask(g, b, j)
    ids = _ids(g, b, n)
    x = _garbage(ids, mask, value)
    se = _leaf(torch.randn(b, n, 16, generator=g), ~mask[..., None], value)
    ctx = _leaf(torch.randn(b, j, 6, generator=g), ~ctx_mask[..., None], value)
    logits = model(x, mask=mask, sum_embeds=se, context=ctx, context_mask=ctx_mask)
    out = torch.cat([logits[k] for k in VOCABS], -1)  # (b, n, sum of vocabularies)
    wrong_vocab = dict(ids)
    wrong_vocab["note"] = ids["note"].masked_fill(mask, VOCABS["note"])
    layers = model.attn_layers
    return Probe(
        out, {"sum_embeds": se, "context": ctx},
        {"sum_embeds": ~mask[..., None].expand_as(se), "context": ~ctx_mask[..., None].expand_as(ctx)},
        dead=~mask[..., None].expand_as(out),
        bad_calls=[
            ("x not a dict", lambda: model(ids["note"]), TypeError, "x"),
            ("an input missing", lambda: model({"note": ids["note"]}), ValueError, "x"),
            ("an unknown input", lambda: model({**ids, "velocity": ids["note"]}), ValueError, "x"),
            ("inputs of different shapes", lambda: model({**ids, "tone": ids["tone"][:, :-1]}), ValueError, "x['tone']"),
            ("float ids", lambda: model({**ids, "pitch": ids["pitch"] + 0.5}), TypeError, "x['pitch']"),
            ("an id outside its vocabulary at a real position", lambda: model(wrong_vocab, mask=mask), ValueError, "x['note']"),
            ("float mask", lambda: model(ids, mask=mask.float()), TypeError, "mask"),
            ("mask of wrong shape", lambda: model(ids, mask=mask[:, :-1]), ValueError, "mask"),
            ("sum_embeds of wrong width", lambda: model(ids, sum_embeds=torch.randn(b, n, 17)), ValueError, "sum_embeds"),
            ("integer sum_embeds", lambda: model(ids, sum_embeds=torch.ones(b, n, 16, dtype=torch.long)), TypeError, "sum_embeds"),
            ("context of wrong width", lambda: model(ids, context=torch.randn(b, j, 7)), ValueError, "context"),
            ("XL memories", lambda: model(ids, return_mems=True), ValueError, "return_mems"),
            ("the attention z-loss", lambda: model(ids, return_attn_z_loss=True), ValueError, "return_attn_z_loss"),
            ("NaN in sum_embeds at a real position, checked", lambda: model(
                ids, sum_embeds=torch.full((b, n, 16), NAN), check_finite=True), ValueError, "sum_embeds"),
            ("an empty vocabulary dict", lambda: MultiInputTransformerWrapper(num_tokens={}, max_seq_len=8, attn_layers=layers),
             ValueError, "num_tokens"),
            ("a vocabulary of size 0", lambda: MultiInputTransformerWrapper(num_tokens={"a": 0}, max_seq_len=8, attn_layers=layers),
             ValueError, "num_tokens"),
            ("emb_dim != dim", lambda: MultiInputTransformerWrapper(num_tokens=VOCABS, max_seq_len=8, attn_layers=layers, emb_dim=8),
             ValueError, "emb_dim"),
            ("post_emb_norm", lambda: MultiInputTransformerWrapper(num_tokens=VOCABS, max_seq_len=8, attn_layers=layers,
                                                                   post_emb_norm=True), ValueError, "post_emb_norm"),
            ("a sequence longer than max_seq_len", lambda: model({k: t.repeat(1, 8) for k, t in ids.items()}), ValueError, "max_seq_len"),
        ],
    )


def _grads(probe: Probe, seed: int) -> dict[str, Tensor]:
    u = torch.randn(probe.out.shape, generator=torch.Generator().manual_seed(seed))
    names = list(probe.leaves)
    got = torch.autograd.grad((probe.out * u).sum(), [probe.leaves[k] for k in names], allow_unused=True)
    assert all(gr is not None for gr in got), "a leaf got no gradient (a missing gradient is not a zero gradient)"
    return dict(zip(names, got))


@pytest.mark.parametrize("seed", range(4))
def test_contract_s1_s2(seed):
    """S1: NaN planted at every masked position: outputs and gradients finite. S2: outputs at padded
    positions exactly 0, zero gradient into masked inputs."""
    probe = probe_multi_input(seed, NAN)
    hp.assert_finite(probe.out, "output")
    hp.assert_zero(probe.out.detach()[probe.dead], "outputs at padded positions")
    for k, gr in _grads(probe, seed).items():
        hp.assert_finite(gr, f"grad of {k}")
        hp.assert_zero(gr[probe.masked[k]], f"grad of {k} at masked positions")


@pytest.mark.parametrize("value", PLANT_VALUES, ids=["nan", "inf", "-inf", "1e4"])
@pytest.mark.parametrize("seed", range(4))
def test_contract_s3_masked_contents_never_matter(seed, value):
    clean, dirty = probe_multi_input(seed, 0.0), probe_multi_input(seed, value)
    hp.assert_bitwise(dirty.out, clean.out, "output")
    gc, gd = _grads(clean, seed), _grads(dirty, seed)
    for k in gd:
        m = dirty.masked[k]
        hp.assert_bitwise(gd[k][~m], gc[k][~m], f"grad of {k} at real positions")
        hp.assert_zero(gd[k][m], f"grad of {k} at masked positions")


def test_contract_s9_clear_errors():
    hp.assert_clear_errors(probe_multi_input(0, 0.0).bad_calls, "MultiInputTransformerWrapper, ")


# ----------------------------------------------------------------------------------------------------
# x-transformers
# ----------------------------------------------------------------------------------------------------


XT_CONFIGS = {
    "decoder": dict(layers=dict(causal=True), wrapper=dict()),
    "decoder-rotary-gqa-memory": dict(layers=dict(causal=True, rotary_pos_emb=True, attn_kv_heads=1),
                                      wrapper=dict(num_memory_tokens=2, use_abs_pos_emb=False)),
    "encoder-cross": dict(layers=dict(causal=False, cross_attend=True, cross_attn_dim_context=6), wrapper=dict()),
    "decoder-embeddings-only": dict(layers=dict(causal=True, ff_glu=True, use_rmsnorm=True), wrapper=dict(return_only_embed=True)),
}


@pytest.mark.parametrize("name", list(XT_CONFIGS))
def test_x_transformers_parity(name):
    """Converted weights give x-transformers' outputs at real positions (right padding), float32 ~1e-5."""
    xt = pytest.importorskip("x_transformers")
    from x_transformers.multi_input import MultiInputTransformerWrapper as XTMulti

    cfg = XT_CONFIGS[name]
    layer_kw = dict(cfg["layers"])
    causal = layer_kw.pop("causal")
    torch.manual_seed(0)
    layers = (xt.Decoder if causal else xt.Encoder)(dim=16, depth=2, heads=2, attn_dim_head=8, **layer_kw)
    ref = XTMulti(num_tokens=VOCABS, max_seq_len=32, attn_layers=layers, **cfg["wrapper"]).eval()
    model = multi_input_from_x_transformers(ref)
    assert isinstance(model, MultiInputTransformerWrapper) and not model.training
    g = _gen(8)
    b, n = 3, 6
    ids = _ids(g, b, n)
    lengths = torch.tensor([n, 4, 1])
    mask = torch.arange(n)[None] < lengths[:, None]
    kw = {}
    if "cross_attend" in layer_kw:
        kw = dict(context=torch.randn(b, 4, 6, generator=g), context_mask=torch.tensor([[True] * 4, [True, True, False, False],
                                                                                         [True, False, False, False]]))
    with torch.no_grad():
        for m in (None, mask):
            want = ref(ids, mask=m, **kw)
            got = model(ids, mask=m, **kw)
            sel = torch.ones(b, n, dtype=torch.bool) if m is None else m
            if isinstance(want, dict):
                assert set(got) == set(want)
                for k in want:
                    err = (got[k][sel] - want[k][sel]).abs().max().item()
                    assert err < 1e-5, f"{name}, {k}: max error {err}"
                want_h, got_h = ref(ids, mask=m, return_embeddings=True, **kw), model(ids, mask=m, return_embeddings=True, **kw)
            else:
                want_h, got_h = want, got
            err = (got_h[sel] - want_h[sel]).abs().max().item()
            assert err < 1e-5, f"{name}, embeddings: max error {err}"


def test_x_transformers_cache_protocol_parity():
    """x-transformers' cached call (the whole sequence so far and the intermediates) gives its logits."""
    xt = pytest.importorskip("x_transformers")
    from x_transformers.multi_input import MultiInputTransformerWrapper as XTMulti

    torch.manual_seed(0)
    ref = XTMulti(num_tokens=VOCABS, max_seq_len=32, attn_layers=xt.Decoder(dim=16, depth=2, heads=2, rotary_pos_emb=True)).eval()
    model = multi_input_from_x_transformers(ref)
    ids = _ids(_gen(9), 2, 6)
    with torch.no_grad():
        _, want_inter = ref({k: t[:, :5] for k, t in ids.items()}, return_intermediates=True)
        want = ref(ids, cache=want_inter)
        _, inter = model({k: t[:, :5] for k, t in ids.items()}, return_intermediates=True)
        got = model(ids, cache=inter)
    for k in VOCABS:
        assert got[k].shape == want[k].shape == (2, 1, VOCABS[k])
        err = (got[k] - want[k]).abs().max().item()
        assert err < 1e-5, f"{k}: max error {err}"


def test_conversion_refuses_what_it_cannot_represent():
    xt = pytest.importorskip("x_transformers")
    from x_transformers.multi_input import MultiInputTransformerWrapper as XTMulti

    layers = xt.Decoder(dim=16, depth=1, heads=2)
    hp.assert_clear_errors([
        ("emb_dim != dim", lambda: multi_input_from_x_transformers(XTMulti(num_tokens=VOCABS, max_seq_len=8, attn_layers=layers,
                                                                           emb_dim=8)), ValueError, "emb_dim"),
        ("post_emb_norm", lambda: multi_input_from_x_transformers(XTMulti(num_tokens=VOCABS, max_seq_len=8, attn_layers=layers,
                                                                          post_emb_norm=True)), ValueError, "post_emb_norm"),
        ("a TransformerWrapper", lambda: multi_input_from_x_transformers(xt.TransformerWrapper(
            num_tokens=5, max_seq_len=8, attn_layers=layers)), TypeError, "model"),
    ], "multi_input_from_x_transformers, ")
