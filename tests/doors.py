"""The registry of safeformer's public doors (docs/safety.md): every public name, and how to attack it.

A **door** is a public callable that takes tensors, masks, contexts, conditions or caches. Every name in
``PUBLIC`` (``safeformer.__all__``, ``safeformer.testing.__all__`` and a few module-level callables) is
either in ``DOORS`` or in ``NOT_DOORS`` (with the reason it takes none of
those); ``test_doors.py`` fails when a public name is in neither, so a new public callable cannot ship
untested.

Each door says how its clauses are tested:
- ``probe``: a function ``probe(seed, value) -> Probe`` that builds adversarial inputs for the door
  (dead rows and fully masked samples on purpose, ``value`` planted at every masked position) and calls
  it. ``test_doors.py`` runs S1 (finite, no missing gradient), S2 (dead outputs exactly 0), S3
  (masked contents never matter, their gradient exactly 0) and S9 (clear errors) over every probe.
- ``cases``: the names of model-level cases (``helpers.CASES``) through which
  ``test_contract_models.py`` runs every clause S1-S9 against the door (modules and stacks), or of the
  guidance suite (``test_contract_guidance.py``) for the autoregressive wrapper.

Shape legend: b batch, n positions, h heads, i queries, j keys, d head dim, c features, v vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from helpers import INF, NAN
from torch import Tensor

import safeformer as sf
import safeformer.nn.xt_modules as xt_modules

PLANT_VALUES = (NAN, INF, -INF, 1e4)  # the garbage planted at masked positions of every probe


@dataclass
class Probe:
    """One adversarial call of a door.

    Attributes:
        out: the float output (or ``None`` for doors whose output is not a float tensor).
        leaves: float inputs that must receive a gradient (``None`` = missing = a failure).
        masked: ``{leaf name: bool mask of its shape}``: positions the contract says do not matter
            (padding, masked keys, dead queries, ignored targets); ``value`` was planted there.
        dead: bool mask of ``out``'s shape: outputs the contract says are exactly 0 (S2).
        compare: bool mask of ``out``'s shape: outputs that must not change when garbage is planted
            (default: all of them).
        bad_calls: S9: ``(what, call, exception type, text the message must name)``.
        masked_grad_zero: the gradient at masked positions must be exactly 0 (False for position-wise
            doors, whose padded positions hold their own garbage: it must only stay where it is).
    """

    out: Tensor | None
    leaves: dict[str, Tensor] = field(default_factory=dict)
    masked: dict[str, Tensor] = field(default_factory=dict)
    dead: Tensor | None = None
    compare: Tensor | None = None
    bad_calls: list[tuple[str, Callable[[], object], type, str]] = field(default_factory=list)
    masked_grad_zero: bool = True


@dataclass
class Door:
    """A public door: how the contract tests reach it."""

    name: str
    probe: Callable[[int, float], Probe] | None = None
    cases: tuple[str, ...] = ()
    note: str = ""
    has_dead: bool = False  # its probe has outputs the contract calls dead (S2)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _lengths_mask(g: torch.Generator, b: int, n: int, *, left: bool = False, empty: bool = True) -> Tensor:
    """``(b, n)`` padding mask with random lengths; sample 0 fully padded when ``empty``."""
    lengths = torch.randint(0 if empty else 1, n + 1, (b,), generator=g)
    if empty:
        lengths[0] = 0
    lengths[-1] = n  # one full sample
    return sf.padding_mask(lengths, n, left=left)


def _leaf(t: Tensor, where: Tensor | None, value: float) -> Tensor:
    t = t.clone()
    if where is not None:
        t[where.expand_as(t)] = value
    return t.requires_grad_()


# ----------------------------------------------------------------------------------------------------
# probes
# ----------------------------------------------------------------------------------------------------


def probe_attend(seed: int, value: float) -> Probe:
    """``attend`` with a key padding mask, bottom-right causal, GQA and a bias that is ``-inf`` on a whole
    query row (a row masked by the bias alone) and ``-1e9`` (``-inf`` in float16) on another."""
    g = _gen(seed)
    b, hkv, grp, i, j, d = 3, 2, 2, 4, 6, 8
    h = hkv * grp
    key_pad = _lengths_mask(g, b, j, left=bool(seed % 2))
    bias = torch.randn(1, h, i, j, generator=g)
    bias[:, :, 1] = -INF  # query 1 of every sample: dead by the bias alone
    bias[:, :, 2, : j // 2] = -1e30  # finite in float32: not dead, only far
    allowed = (key_pad[:, None, None, :] & sf.causal_mask(i, j) & (bias != -INF))  # (b, h, i, j)
    dead = ~allowed.any(-1)  # (b, h, i)
    masked_keys = ~allowed.any(-2).reshape(b, hkv, grp, j).any(2)  # (b, h_kv, j)
    q = _leaf(torch.randn(b, h, i, d, generator=g), dead[..., None], value)
    k = _leaf(torch.randn(b, hkv, j, d, generator=g), masked_keys[..., None], value)
    v = _leaf(torch.randn(b, hkv, j, d, generator=g), masked_keys[..., None], value)
    bias_in = _leaf(bias.expand(b, h, i, j).clone(), ~key_pad[:, None, None, :].expand(b, h, i, j), value)
    out = sf.attend(q, k, v, mask=key_pad, causal=True, bias=bias_in)
    return Probe(
        out, {"q": q, "k": k, "v": v, "bias": bias_in},
        {"q": dead[..., None].expand_as(q), "k": masked_keys[..., None].expand_as(k),
         "v": masked_keys[..., None].expand_as(v), "bias": ~key_pad[:, None, None, :].expand(b, h, i, j)},
        dead=dead[..., None].expand_as(out),
        bad_calls=[
            ("int mask", lambda: sf.attend(q, k, v, mask=key_pad.long()), TypeError, "mask"),
            ("integer bias", lambda: sf.attend(q, k, v, bias=torch.zeros(b, h, i, j, dtype=torch.long)), TypeError, "bias"),
            ("bias of wrong shape", lambda: sf.attend(q, k, v, bias=torch.zeros(b, h, i, j + 1)), ValueError, "bias"),
            ("mask on another device", lambda: sf.attend(q, k, v, mask=key_pad.to("meta")), ValueError, "mask"),
        ],
    )


def probe_varlen_attention(seed: int, value: float) -> Probe:
    """``varlen_attention`` on packed real tokens with empty segments (fully padded samples) among them,
    causal, GQA. Packed tokens hold no padding: nothing is masked, no row is dead (every token sees
    itself); the contract here is finiteness, real gradients, and clear errors."""
    g = _gen(seed)
    lengths = [0, int(torch.randint(1, 5, (1,), generator=g)), 0, 3]
    T, h, hkv, d = sum(lengths), 4, 2, 8
    q = torch.randn(T, h, d, generator=g).requires_grad_()
    k = torch.randn(T, hkv, d, generator=g).requires_grad_()
    v = torch.randn(T, hkv, d, generator=g).requires_grad_()
    out = sf.testing.varlen_attention(q, k, v, lengths, causal=True)
    return Probe(out, {"q": q, "k": k, "v": v}, bad_calls=[
        ("lengths not summing to T", lambda: sf.testing.varlen_attention(q, k, v, [T + 1], causal=True), ValueError, "lengths"),
        ("float lengths", lambda: sf.testing.varlen_attention(q, k, v, torch.tensor([float(T)]), causal=True), TypeError, "lengths"),
        ("k of another head dim", lambda: sf.testing.varlen_attention(q, k[..., :4], v, lengths, causal=True), ValueError, "k"),
    ])


def probe_prepared_mask(seed: int, value: float) -> Probe:
    """``prepare_mask`` then ``attend``: the stacks' shared mask, used directly."""
    g = _gen(seed)
    b, h, n, d = 3, 2, 5, 8
    pad = _lengths_mask(g, b, n, left=True)
    allowed = pad[:, None, None, :] & sf.causal_mask(n, n)  # (b, 1, n, n)
    dead = ~allowed.any(-1).expand(b, h, n)
    masked = ~allowed.any(-2).expand(b, h, n)
    q = _leaf(torch.randn(b, h, n, d, generator=g), dead[..., None], value)
    k = _leaf(torch.randn(b, h, n, d, generator=g), masked[..., None], value)
    v = _leaf(torch.randn(b, h, n, d, generator=g), masked[..., None], value)
    prepared = sf.testing.prepare_mask(allowed)
    out = sf.attend(q, k, v, mask=prepared)
    return Probe(out, {"q": q, "k": k, "v": v},
                 {"q": dead[..., None].expand_as(q), "k": masked[..., None].expand_as(k), "v": masked[..., None].expand_as(v)},
                 dead=dead[..., None].expand_as(out),
                 bad_calls=[("int mask", lambda: sf.testing.prepare_mask(allowed.int()), TypeError, "mask"),
                            ("causal with a prepared mask", lambda: sf.attend(q, k, v, mask=prepared, causal=True), ValueError, "causal")])


def probe_masked_mean(seed: int, value: float) -> Probe:
    g = _gen(seed)
    b, n, c = 4, 7, 3
    mask = _lengths_mask(g, b, n)
    x = _leaf(torch.randn(b, n, c, generator=g), ~mask[..., None], value)
    out = sf.masked_mean(x, mask, dim=1)
    return Probe(out, {"x": x}, {"x": ~mask[..., None].expand_as(x)}, dead=~mask.any(1)[:, None].expand_as(out),
                 bad_calls=[("float mask", lambda: sf.masked_mean(x, mask.float()), TypeError, "mask"),
                            ("mask of wrong shape", lambda: sf.masked_mean(x, mask[:, :-1]), ValueError, "mask"),
                            ("integer x", lambda: sf.masked_mean(torch.ones(b, n, dtype=torch.long), mask), TypeError, "x")])


def probe_safe_cross_entropy(seed: int, value: float) -> Probe:
    g = _gen(seed)
    b, n, v = 3, 5, 6
    target = torch.randint(0, v, (b, n), generator=g)
    ignored = ~_lengths_mask(g, b, n)
    target = target.masked_fill(ignored, -100)
    logits = _leaf(torch.randn(b, n, v, generator=g), ignored[..., None], value)
    out = sf.safe_cross_entropy(logits, target, reduction="none")
    none_counted = sf.safe_cross_entropy(logits, torch.full_like(target, -100))  # mean over no target
    (g,) = torch.autograd.grad(none_counted, logits, allow_unused=True)
    assert g is not None and none_counted.item() == 0.0 and not bool(g.any()), "all-ignored loss is not 0 with zero gradient"
    return Probe(out, {"logits": logits}, {"logits": ignored[..., None].expand_as(logits)}, dead=ignored,
                 bad_calls=[("float target", lambda: sf.safe_cross_entropy(logits, target.float()), TypeError, "target"),
                            ("logits of wrong shape", lambda: sf.safe_cross_entropy(logits[:, :-1], target), ValueError, "logits"),
                            ("unknown reduction", lambda: sf.safe_cross_entropy(logits, target, reduction="avg"), ValueError, "reduction")])


def probe_check_finite(seed: int, value: float) -> Probe:
    """``check_finite``: garbage at masked positions is never reported; at a real position it is."""
    g = _gen(seed)
    b, n, c = 3, 4, 2
    mask = _lengths_mask(g, b, n)
    x = torch.randn(b, n, c, generator=g)
    x[~mask] = value
    sf.check_finite(x, mask, "x")  # must not raise: the garbage is in padding
    bad = x.clone()
    bad[-1, 0, 0] = NAN  # the last sample is full: a real position
    return Probe(None, bad_calls=[
        ("NaN at a real position", lambda: sf.check_finite(bad, mask, "context"), ValueError, "context"),
        ("int mask", lambda: sf.check_finite(x, mask.int(), "x"), TypeError, "mask"),
        ("mask of wrong shape", lambda: sf.check_finite(x, mask[:, :-1], "x"), ValueError, "mask"),
    ])


def probe_guided_logits(seed: int, value: float) -> Probe:
    """``guided_logits`` in float16: a token banned (``-inf``) in either branch stays ``-inf``; the rest
    is finite (float32 arithmetic) even at a scale that overflows float16."""
    g = _gen(seed)
    b, v = 3, 8
    cond = (torch.randn(b, v, generator=g) * 10).half()
    uncond = (torch.randn(b, v, generator=g) * 10).half()
    cond[:, 0] = -INF
    uncond[:, 1] = -INF
    cond[0, 2] = uncond[0, 2] = -INF
    banned = torch.zeros(b, v, dtype=torch.bool)
    banned[:, :2] = True
    banned[0, 2] = True
    out = sf.guided_logits(cond, uncond, 5e4, guidance_rescale=0.5)
    assert out.dtype == torch.float32, f"guided_logits returned {out.dtype}, expected float32"
    assert bool((out[banned] == -INF).all()), "a banned token is no longer -inf"
    return Probe(torch.where(banned, 0.0, out), compare=~banned, bad_calls=[
        ("shapes differ", lambda: sf.guided_logits(cond, uncond[:, :-1], 2.0), ValueError, "shape"),
        ("non-finite scale", lambda: sf.guided_logits(cond, uncond, INF), ValueError, "cond_scale"),
        ("rescale above 1", lambda: sf.guided_logits(cond, uncond, 2.0, 1.5), ValueError, "guidance_rescale"),
        ("integer logits", lambda: sf.guided_logits(cond.long(), uncond.long(), 2.0), TypeError, "logits"),
    ])


def probe_sampling(seed: int, value: float) -> Probe:
    """``sample_logits`` and the filters: banned tokens (``-inf``) are never drawn, whatever the filter."""
    g = _gen(seed)
    b, v = 64, 10
    logits = torch.randn(b, v, generator=g)
    logits[:, : v // 2] = -INF
    for fn, kw in ((None, None), ("top_k", {"k": 8}), ("top_p", {"p": 0.99}), ("min_p", {"min_p": 0.0})):
        torch.manual_seed(seed)
        tok = sf.sample_logits(logits, 1.0, fn, kw)
        assert bool((tok >= v // 2).all()), f"a banned token was drawn with filter {fn}"
    for f, kw in ((sf.top_k, {"k": 3}), (sf.top_p, {"p": 0.5}), (sf.min_p, {"min_p": 0.2}), (sf.top_a, {})):
        kept = f(logits, **kw)
        assert bool((kept[:, : v // 2] == -INF).all()), f"{f.__name__} revived a banned token"
        assert bool(torch.isfinite(kept).any(-1).all()), f"{f.__name__} left a row with no token"
    return Probe(None, bad_calls=[
        ("negative temperature", lambda: sf.sample_logits(logits, -1.0), ValueError, "temperature"),
        ("k of 0", lambda: sf.top_k(logits, k=0), ValueError, "k"),
        ("p above 1", lambda: sf.top_p(logits, 1.5), ValueError, "p"),
        ("min_p below 0", lambda: sf.min_p(logits, -0.1), ValueError, "min_p"),
        ("top_a ratio above 1", lambda: sf.top_a(logits, min_p_ratio=1.5), ValueError, "min_p_ratio"),
        ("a 2-D prompt in a list", lambda: sf.left_pad([torch.zeros(2, 2, dtype=torch.long)]), ValueError, "prompts[0]"),
        ("an empty prompt list", lambda: sf.left_pad([]), ValueError, "empty list"),
        ("unknown filter", lambda: sf.sample_logits(logits, 1.0, "top_q"), ValueError, "filter_logits_fn"),
        ("3-D logits", lambda: sf.sample_logits(logits[None]), ValueError, "logits"),
        ("no token at all", lambda: sf.sample_logits(logits[:, :0]), ValueError, "logits"),
        ("integer logits", lambda: sf.sample_logits(logits.long()), TypeError, "logits"),
        ("a row all -inf", lambda: sf.sample_logits(torch.where(torch.arange(b)[:, None] == 3, -INF, logits)),
         ValueError, "logits"),
        ("a NaN, greedy", lambda: sf.sample_logits(torch.where(torch.arange(v) == 7, NAN, logits), 0.0),
         ValueError, "logits"),
        ("a filter banning all", lambda: sf.sample_logits(logits, 1.0, lambda t: torch.full_like(t, -INF)),
         ValueError, "logits"),
        ("bad top_k, greedy", lambda: sf.sample_logits(logits, 0.0, "top_k", {"k": 0}), ValueError, "k"),
    ])


def probe_drop_condition(seed: int, value: float) -> Probe:
    """``drop_condition`` feeding a cross-attending ``Encoder``: dropped samples' contents (planted) and
    masked context positions never matter; a learned null token replaces a dropped condition."""
    g = _gen(seed)
    b, n, j, c = 4, 3, 5, 8
    ctx_mask = _lengths_mask(g, b, j)
    dropped = torch.tensor([True, False, True, False])
    hidden = ~ctx_mask | dropped[:, None]
    context = _leaf(torch.randn(b, j, c, generator=g), hidden[..., None], value)
    null = torch.randn(2, c, generator=g).requires_grad_()
    torch.manual_seed(0)
    enc = sf.Encoder(dim=c, depth=1, heads=2, dim_head=4, cross_attend=True)
    ctx, cm = sf.core.conditions.drop_condition(ctx_mask, context=context, null_context=null, dropped=dropped)
    x = torch.randn(b, n, c, generator=g)
    out = enc(x, context=ctx, context_mask=cm)
    return Probe(out, {"context": context, "null": null}, {"context": hidden[..., None].expand_as(context)},
                 bad_calls=[("float context_mask", lambda: sf.core.conditions.drop_condition(ctx_mask.float(), 0.5), TypeError, "context_mask"),
                            ("p above 1", lambda: sf.core.conditions.drop_condition(ctx_mask, 1.5), ValueError, "p"),
                            ("null of wrong width", lambda: sf.core.conditions.drop_condition(ctx_mask, 0.5, context=context,
                                                                                null_context=torch.zeros(1, c + 1)), ValueError, "null_context")])


def _rowwise_probe(module_fn: Callable[[torch.Generator], tuple[torch.nn.Module, int]]):
    """Position-wise modules: garbage at a padded position reaches no other position."""

    def probe(seed: int, value: float) -> Probe:
        g = _gen(seed)
        module, c = module_fn(g)
        b, n = 3, 4
        mask = _lengths_mask(g, b, n)
        x = _leaf(torch.randn(b, n, c, generator=g), ~mask[..., None], value)
        out = module(x)
        return Probe(out, {"x": x}, {"x": ~mask[..., None].expand_as(x)}, compare=mask[..., None].expand_as(out),
                     masked_grad_zero=False)

    return probe


def _norm(g):
    torch.manual_seed(0)
    return sf.RMSNorm(6), 6


def _ff(g):
    torch.manual_seed(0)
    return sf.FeedForward(6, mult=2, glu=True), 6


def probe_rotary(seed: int, value: float) -> Probe:
    """``RotaryEmbedding`` + ``apply_rotary`` at large positions (angles in float32): per position, so
    garbage at a padded position reaches no other one; positions of padding never matter. Odd seeds use
    x-transformers' call (``freqs, scale = rot(pos)``, ``apply_rotary(x, freqs)``), even seeds ``angles``."""
    g = _gen(seed)
    b, h, n, d = 2, 2, 5, 8
    mask = _lengths_mask(g, b, n, left=True)
    pos = sf.positions_from_mask(mask, n, "cpu") + 4000
    x = _leaf(torch.randn(b, h, n, d, generator=g), ~mask[:, None, :, None], value)
    rot = sf.RotaryEmbedding(d)
    if seed % 2:
        freqs, scale = rot(pos)  # (b, n, d), 1.0
        out = sf.apply_rotary(x, freqs, scale)
    else:
        out = sf.apply_rotary(x, rot.angles(pos))
    return Probe(out, {"x": x}, {"x": ~mask[:, None, :, None].expand_as(x)}, compare=mask[:, None, :, None].expand_as(out),
                 masked_grad_zero=False, bad_calls=[("odd rotary dim", lambda: sf.RotaryEmbedding(3), ValueError, "rotary_emb_dim"),
                                                    ("float positions", lambda: rot(pos.float()), ValueError, "positions"),
                                                    ("an xpos scale given twice", lambda: sf.apply_rotary(
                                                        x, (rot.angles(pos), 2.0), 2.0), ValueError, "scale")])


def _ada_norm(g):
    torch.manual_seed(0)
    norm = sf.AdaptiveRMSNorm(6, dim_condition=4)
    torch.nn.init.normal_(norm.to_gamma.weight)
    cond = torch.randn(3, 4, generator=g)
    return (lambda x: norm(x, condition=cond)), 6


def _stack_probe(make: Callable[[], torch.nn.Module], **call):
    """A layer stack with a padding mask (sample 0 all padding): padded positions are exact zeros at the output
    and garbage there reaches nothing; ``call``: extra keywords of the stack's forward."""

    def probe(seed: int, value: float) -> Probe:
        g = _gen(seed)
        torch.manual_seed(0)
        model = make()
        b, n, c = 3, 5, model.dim
        mask = _lengths_mask(g, b, n, left=bool(seed % 2))
        x = _leaf(torch.randn(b, n, c, generator=g), ~mask[..., None], value)
        out = model(x, mask=mask, **call)
        pad = ~mask[..., None].expand_as(out)
        return Probe(out, {"x": x}, {"x": ~mask[..., None].expand_as(x)}, dead=pad, bad_calls=[
            ("int mask", lambda: model(x, mask=mask.long(), **call), TypeError, "mask"),
            ("x of wrong width", lambda: model(torch.randn(b, n, c + 1), **call), ValueError, "x"),
        ])

    return probe


def probe_prefix_decoder(seed: int, value: float) -> Probe:
    """``PrefixDecoder`` with a per-sample prefix length and padding; its own S9 on ``prefix_attn_len``."""
    p = _stack_probe(lambda: sf.PrefixDecoder(dim=8, depth=1, heads=2, dim_head=4, rotary_pos_emb=True),
                     prefix_attn_len=torch.tensor([0, 2, 5]))(seed, value)
    model_x = torch.randn(3, 5, 8)
    dec = sf.PrefixDecoder(dim=8, depth=1, heads=2, dim_head=4)
    p.bad_calls += [("prefix_attn_len beyond n", lambda: dec(model_x, prefix_attn_len=6), ValueError, "prefix_attn_len"),
                    ("float prefix_attn_len", lambda: dec(model_x, prefix_attn_len=torch.ones(3)), ValueError, "prefix_attn_len")]
    return p


def probe_attention_pool(seed: int, value: float) -> Probe:
    """``AttentionPool`` over a context with a padding mask (sample 0 entirely masked: its pooled rows are
    dead, exactly 0)."""
    g = _gen(seed)
    torch.manual_seed(0)
    pool = sf.AttentionPool(8, num_pooled_tokens=2, dim_context=6, heads=2, dim_head=4)
    b, j = 3, 5
    mask = _lengths_mask(g, b, j)
    ctx = _leaf(torch.randn(b, j, 6, generator=g), ~mask[..., None], value)
    out = pool(ctx, mask=mask)
    dead = (~mask.any(-1))[:, None, None].expand_as(out)
    return Probe(out, {"context": ctx}, {"context": ~mask[..., None].expand_as(ctx)}, dead=dead, bad_calls=[
        ("int mask", lambda: pool(ctx, mask=mask.long()), TypeError, "mask"),
        ("mask of wrong shape", lambda: pool(ctx, mask=mask[:, :-1]), ValueError, "mask"),
        ("context of wrong width", lambda: pool(torch.randn(b, j, 7)), ValueError, "context"),
        ("queries of wrong width", lambda: pool(ctx, queries=torch.randn(b, 2, 9)), ValueError, "queries"),
    ])


def probe_vit(seed: int, value: float) -> Probe:
    """``ViTransformerWrapper``: an image has no padding; finite outputs and gradients, clear errors."""
    g = _gen(seed)
    torch.manual_seed(0)
    vit = sf.ViTransformerWrapper(image_size=8, patch_size=4, num_classes=3, num_register_tokens=seed % 2,
                                  attn_layers=sf.Encoder(dim=8, depth=1, heads=2, dim_head=4))
    img = torch.randn(2, 3, 8, 8, generator=g).mul(100.0).requires_grad_()
    out = vit(img)
    return Probe(out, {"img": img}, bad_calls=[
        ("sides not a multiple of the patch", lambda: vit(torch.randn(1, 3, 6, 6)), ValueError, "patch_size"),
        ("wrong channels", lambda: vit(torch.randn(1, 1, 8, 8)), ValueError, "channels"),
        ("integer image", lambda: vit(torch.zeros(1, 3, 8, 8, dtype=torch.long)), ValueError, "img"),
    ])


def probe_alibi(seed: int, value: float) -> Probe:
    g = _gen(seed)
    b, n = 2, 5
    mask = _lengths_mask(g, b, n, left=True)
    pos = sf.positions_from_mask(mask, n, "cpu") + 10**6  # far positions stay finite
    out = sf.alibi_bias(sf.alibi_slopes(3), pos, pos)
    return Probe(out)


def probe_abs_pos(seed: int, value: float) -> Probe:
    torch.manual_seed(0)
    emb = sf.AbsolutePositionalEmbedding(4, 8)
    pos = torch.tensor([[0, 3, 7, 7]])
    return Probe(emb.embed_positions(pos), {"weight": emb.emb.weight})


def probe_generate_tokens(seed: int, value: float) -> Probe:
    """``generate_tokens`` with left-padded prompts (garbage ids in padding) and a context with planted
    garbage at masked positions (one sample's condition dropped): the tokens are those of clean inputs."""
    g = _gen(seed)
    b, n, j, c, vocab = 3, 4, 3, 8, 11
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=vocab, max_seq_len=16,
                                attn_layers=sf.Decoder(dim=c, depth=1, heads=2, dim_head=4, cross_attend=True))
    mask = _lengths_mask(g, b, n, left=True, empty=False)
    prompts = torch.randint(0, vocab, (b, n), generator=g)
    ctx_mask = _lengths_mask(g, b, j)
    ctx = torch.randn(b, j, c, generator=g)
    dirty_prompts = prompts.masked_fill(~mask, 10**6 if value == value else -7)
    dirty_ctx = ctx.masked_fill(~ctx_mask[..., None], value)
    kw = dict(mask=mask, context_mask=ctx_mask, temperature=0.0, cond_scale=3.0)
    clean = sf.generate_tokens(net, prompts, 4, context=ctx, **kw)
    dirty = sf.generate_tokens(net, dirty_prompts, 4, context=dirty_ctx, **kw)
    assert torch.equal(clean, dirty), "garbage in padding changed the generated tokens"
    return Probe(None, bad_calls=[
        ("a float pad_value", lambda: sf.generate_tokens(net, prompts, 2, pad_value=0.5), TypeError, "pad_value"),
        ("an all-padding prompt", lambda: sf.generate_tokens(net, prompts, 2, mask=torch.zeros(b, n, dtype=torch.bool)), ValueError, "mask"),
        ("context of another dtype", lambda: sf.generate_tokens(net, prompts, 2, context=ctx.double()), TypeError, "context"),
    ])


def probe_positions_from_mask(seed: int, value: float) -> Probe:
    g = _gen(seed)
    mask = _lengths_mask(g, 3, 6, left=True)
    pos = sf.positions_from_mask(mask, 6, "cpu")
    want = torch.stack([torch.cumsum(m.long(), 0) - 1 for m in mask]).clamp(min=0)
    assert torch.equal(pos[mask], want[mask]), "real tokens must be numbered by real tokens only"
    return Probe(None)


def probe_mask_helpers(seed: int, value: float) -> Probe:
    """The mask helpers refuse other conventions (S9) and keep padding masks broadcast."""
    key_pad = torch.tensor([[True, False, True]])
    assert sf.as_attention_mask(key_pad, 1, 2, 4, 3).shape == (1, 1, 1, 3)
    assert sf.dead_rows(torch.zeros(1, 1, 2, 3, dtype=torch.bool)).all()
    assert sf.alive_keys(key_pad[:, None, None, :]).shape == (1, 1, 1, 3)
    assert sf.combine_masks(None, key_pad[:, None, None, :], sf.causal_mask(3, 3)).shape == (1, 1, 3, 3)
    assert sf.alive_rows(key_pad[:, None, None, :]).all()
    return Probe(None, bad_calls=[
        ("int mask", lambda: sf.validate_mask(key_pad.int(), "context_mask"), TypeError, "context_mask"),
        ("float attention mask", lambda: sf.as_attention_mask(key_pad.float(), 1, 1, 1, 3), TypeError, "mask"),
        ("mask of 5 dims", lambda: sf.as_attention_mask(torch.ones(1, 1, 1, 1, 3, dtype=torch.bool), 1, 1, 1, 3), ValueError, "mask"),
        ("(i, j) mask of the wrong size", lambda: sf.as_attention_mask(torch.ones(2, 2, dtype=torch.bool), 1, 1, 4, 3), ValueError, "mask"),
    ])


def _plant_cache(cache, mask: Tensor, ctx_mask: Tensor, value: float) -> None:
    """``value`` into every masked slot of a ``KVCache``: the prompt's padding and the context's masked keys."""
    for k, v in cache.self_kv:
        k.data[~mask[:, None, :, None].expand_as(k)] = value
        v.data[~mask[:, None, :, None].expand_as(v)] = value
    for k, v in cache.cross_kv:
        k.data[~ctx_mask[:, None, :, None].expand_as(k)] = value
        v.data[~ctx_mask[:, None, :, None].expand_as(v)] = value


def probe_cache(seed: int, value: float) -> Probe:
    """A ``KVCache`` is input: NaN planted in its masked slots (left padding of the prompt, padded
    context positions) changes no later output; a cache of another batch or a new context is refused."""
    g = _gen(seed)
    b, n, j, c = 3, 4, 3, 8
    torch.manual_seed(0)
    dec = sf.Decoder(dim=c, depth=2, heads=2, dim_head=4, kv_heads=1, cross_attend=True, rotary_pos_emb=True)
    mask = _lengths_mask(g, b, n, left=True, empty=False)
    ctx_mask = _lengths_mask(g, b, j)
    ctx = torch.randn(b, j, c, generator=g)
    x = torch.randn(b, n, c, generator=g)
    _, cache = dec(x, mask=mask, context=ctx, context_mask=ctx_mask, return_cache=True)
    x_new = torch.randn(b, 1, c, generator=g).requires_grad_()
    clean = dec(x_new, cache=cache)
    _plant_cache(cache, mask, ctx_mask, value)
    dirty = dec(x_new, cache=cache)
    assert torch.equal(clean, dirty), "garbage in a cache's masked slots changed the output"
    other = torch.randn(b, j, c, generator=g)
    return Probe(dirty, {"x": x_new}, bad_calls=[
        ("a cache of another batch size", lambda: dec(x_new[:2], cache=cache), ValueError, "cache"),
        ("another context with a cache", lambda: dec(x_new, cache=cache, context=other, context_mask=ctx_mask), ValueError, "context"),
        ("the cached context without its mask", lambda: dec(x_new, cache=cache, context=ctx), ValueError, "context"),
        ("not a cache", lambda: dec(x_new, cache=(1, 2)), TypeError, "cache"),
        ("positions of one dim too many", lambda: dec(x, positions=torch.zeros(b, n, 1, dtype=torch.long)), ValueError, "positions"),
        ("float positions", lambda: dec(x, positions=torch.zeros(b, n)), TypeError, "positions"),
        ("context of another dtype", lambda: dec(x, context=ctx.double()), TypeError, "context"),
    ])


def probe_static_cache(seed: int, value: float) -> Probe:
    """The decode step on a ``StaticKVCache`` (``net(new, cache=static)``, its stack's ``forward(x, cache=static)``):
    built from a prefill whose masked slots (left padding, padded and dropped contexts) hold ``value``, one step
    equals the dynamic cache's step on the clean cache; anything but the new position is refused by name."""
    from safeformer.decoding.static import build_static_cache

    g = _gen(seed)
    b, n, j, c = 3, 4, 3, 8
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=11, max_seq_len=16, attn_layers=sf.Decoder(
        dim=c, depth=2, heads=2, dim_head=4, kv_heads=1, cross_attend=True, rotary_pos_emb=seed % 2 == 0,
        alibi_pos_bias=seed % 2 == 1))
    mask = _lengths_mask(g, b, n, left=True, empty=False)
    ctx_mask = _lengths_mask(g, b, j)  # sample 0: a dropped context
    ctx = torch.randn(b, j, c, generator=g)
    tokens = torch.randint(0, 11, (b, n), generator=g)
    with torch.no_grad():
        _, cache = net(tokens, mask=mask, context=ctx, context_mask=ctx_mask, return_cache=True)
    x_new = torch.randn(b, 1, c, generator=g)
    clean = net.attn_layers(x_new, cache=cache)
    _plant_cache(cache, mask, ctx_mask, value)
    static = build_static_cache(net, cache, cache.length + 1)
    x_new = x_new.clone().requires_grad_()
    out = net.attn_layers(x_new, cache=static)
    torch.testing.assert_close(out, clean, rtol=1e-5, atol=1e-6)
    return Probe(out, {"x": x_new}, bad_calls=[
        ("a step given a context", lambda: net.attn_layers(x_new, cache=static, context=ctx), ValueError, "context"),
        ("two positions", lambda: net.attn_layers(torch.cat([x_new, x_new], 1), cache=static), ValueError, "shape"),
        ("another batch", lambda: net(tokens[:2, :1], cache=static), ValueError, "shape"),
        ("a full cache", lambda: net(tokens[:, :1], cache=static), ValueError, "full"),
        ("room for fewer slots than the prefill", lambda: build_static_cache(net, cache, 1), ValueError, "capacity"),
        ("a net the step cannot run", lambda: build_static_cache(
            sf.TransformerWrapper(num_tokens=11, max_seq_len=16, attn_layers=sf.Encoder(dim=c, depth=1)), cache, 9),
         ValueError, "causal"),
    ])


def probe_compose_guidance(seed: int, value: float) -> Probe:
    """``compose_guidance`` over three branches in float16: banned tokens stay ``-inf``, the rest is the
    float64 formula; a scale that overflows float16 stays finite."""
    g = _gen(seed)
    b, v = 3, 7
    u, c1, c2 = ((torch.randn(b, v, generator=g) * 5).half() for _ in range(3))
    c1[:, 0] = -INF
    u[1, 1] = -INF
    out = sf.compose_guidance(u, {"context": c1, "condition": c2}, {"context": 3e4, "condition": -2.0})
    banned = torch.zeros(b, v, dtype=torch.bool)
    banned[:, 0] = True
    banned[1, 1] = True
    assert out.dtype == torch.float32 and bool((out[banned] == -INF).all()), "a banned token is no longer -inf"
    u64, a64, b64 = (t.double() for t in (u, c1, c2))
    want = u64 + 3e4 * (a64 - u64) - 2.0 * (b64 - u64)
    assert torch.allclose(out[~banned].double(), want[~banned], rtol=1e-5, atol=1e-3), "not the float64 formula"
    return Probe(torch.where(banned, 0.0, out), compare=~banned, bad_calls=[
        ("a scale for a branch not computed", lambda: sf.compose_guidance(u, {"context": c1}, {"prepend": 2.0}), ValueError, "prepend"),
        ("unknown space", lambda: sf.compose_guidance(u, {"context": c1}, {"context": 2.0}, space="probs"), ValueError, "space"),
        ("NaN logits", lambda: sf.compose_guidance(u.float().fill_(NAN), {"context": c1}, {"context": 2.0}), ValueError, "NaN"),
    ])


def probe_drop_conditions(seed: int, value: float) -> Probe:
    """``drop_conditions`` on all three kinds feeding a decoder: dropped samples' conditions and masked
    positions (garbage planted) never matter."""
    g = _gen(seed)
    b, n, j, m, c, k = 6, 3, 4, 2, 8, 3
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=5, max_seq_len=16, attn_layers=sf.Decoder(
        dim=c, depth=1, heads=2, dim_head=4, cross_attend=True, use_adaptive_layernorm=True, dim_condition=k))
    ctx_mask = _lengths_mask(g, b, j)
    pre_mask = _lengths_mask(g, b, m)
    gen = torch.Generator().manual_seed(seed)
    probe_conds = sf.Conditions(torch.zeros(b, j, c), ctx_mask, torch.zeros(b, m, c), pre_mask, torch.zeros(b, k))
    _, dropped = sf.drop_conditions(probe_conds, {"context": 0.5, "prepend": 0.5, "condition": 0.5}, all_prob=0.2, generator=gen)
    hidden_ctx = ~ctx_mask | dropped["context"][:, None]
    hidden_pre = ~pre_mask | dropped["prepend"][:, None]
    hidden_cond = dropped["condition"][:, None]
    ctx = _leaf(torch.randn(b, j, c, generator=g), hidden_ctx[..., None], value)
    pre = _leaf(torch.randn(b, m, c, generator=g), hidden_pre[..., None], value)
    cond = _leaf(torch.randn(b, k, generator=g), hidden_cond, value)
    conds, _ = sf.drop_conditions(sf.Conditions(ctx, ctx_mask, pre, pre_mask, cond),
                                  {"context": 0.5, "prepend": 0.5, "condition": 0.5}, all_prob=0.2,
                                  generator=torch.Generator().manual_seed(seed))
    out = net(torch.randint(0, 5, (b, n), generator=g), **conds.kwargs())
    return Probe(out, {"context": ctx, "prefix": pre, "condition": cond},
                 {"context": hidden_ctx[..., None].expand_as(ctx), "prefix": hidden_pre[..., None].expand_as(pre),
                  "condition": hidden_cond.expand_as(cond)},
                 bad_calls=[("unknown kind", lambda: sf.AutoregressiveWrapper(net, cond_drop_prob={"text": 0.1}), ValueError, "text"),
                            ("probability above 1", lambda: sf.AutoregressiveWrapper(net, cond_drop_all_prob=1.5), ValueError, "cond_drop_all_prob"),
                            ("unknown kind in probs", lambda: sf.drop_conditions(probe_conds, {"text": 0.1}), ValueError, "text"),
                            ("float context_mask", lambda: sf.drop_conditions(
                                sf.Conditions(torch.zeros(b, j, c), ctx_mask.float()), 0.5), TypeError, "context_mask"),
                            ("(b, 1) condition_mask", lambda: sf.drop_conditions(sf.Conditions(
                                condition=torch.zeros(b, k), condition_mask=torch.ones(b, 1, dtype=torch.bool)), 0.5),
                             ValueError, "condition_mask"),
                            ("kinds of different batches", lambda: sf.drop_conditions(
                                sf.Conditions(torch.zeros(b, j, c), condition=torch.zeros(b + 1, k)), 0.5), ValueError, "condition")])


def _cond_kinds_probe(g: torch.Generator, b: int, j: int, m: int, c: int, k: int, seed: int, probs: dict, all_prob: float):
    """Masks for the three kinds of condition and which samples ``drop_conditions`` drops with ``seed``
    (the wrappers draw the same with ``generator=torch.Generator().manual_seed(seed)``)."""
    ctx_mask = _lengths_mask(g, b, j)
    pre_mask = _lengths_mask(g, b, m)
    cond_mask = torch.ones(b, dtype=torch.bool)
    cond_mask[1] = False
    shape = sf.Conditions(torch.zeros(b, j, c), ctx_mask, torch.zeros(b, m, c), pre_mask, torch.zeros(b, k), cond_mask)
    _, dropped = sf.drop_conditions(shape, probs, all_prob=all_prob, generator=torch.Generator().manual_seed(seed))
    return ctx_mask, pre_mask, cond_mask, dropped


def probe_continuous_autoregressive(seed: int, value: float) -> Probe:
    """``ContinuousAutoregressiveWrapper`` (MSE or Gaussian NLL by seed) in training mode with every kind
    of condition dropped per sample: garbage at padded steps of ``x`` (inputs and targets, left or right
    padding, one sample all padding), at masked context and prefix positions and in every dropped
    condition. Per-target losses of targets that do not count are exactly 0. Also: an all-padding batch
    is a loss of exactly 0 with zero gradients, and guided generation from left-padded starts holding
    garbage equals that from clean ones, cached and not."""
    g = _gen(seed)
    b, n, j, m, c, k, d = 4, 5, 3, 2, 8, 3, 2
    probabilistic = bool(seed % 2)
    probs, all_prob = {"context": 0.5, "prepend": 0.5, "condition": 0.5}, 0.2
    torch.manual_seed(0)
    net = sf.ContinuousTransformerWrapper(dim_in=d, dim_out=2 * d if probabilistic else d, max_seq_len=16, attn_layers=sf.Decoder(
        dim=c, depth=1, heads=2, dim_head=4, cross_attend=True, use_adaptive_layernorm=True, dim_condition=k))
    model = sf.ContinuousAutoregressiveWrapper(net, probabilistic=probabilistic, cond_drop_prob=probs,
                                               cond_drop_all_prob=all_prob).train()
    mask = _lengths_mask(g, b, n, left=seed % 4 < 2)
    ctx_mask, pre_mask, cond_mask, dropped = _cond_kinds_probe(g, b, j, m, c, k, seed, probs, all_prob)
    hidden_ctx = ~ctx_mask | dropped["context"][:, None]
    hidden_pre = ~pre_mask | dropped["prepend"][:, None]
    hidden_cond = (~cond_mask | dropped["condition"])[:, None]
    x = _leaf(torch.randn(b, n, d, generator=g), ~mask[..., None], value)
    ctx = _leaf(torch.randn(b, j, c, generator=g), hidden_ctx[..., None], value)
    pre = _leaf(torch.randn(b, m, c, generator=g), hidden_pre[..., None], value)
    cond = _leaf(torch.randn(b, k, generator=g), hidden_cond, value)
    kw = dict(context=ctx, context_mask=ctx_mask, prepend_embeds=pre, prepend_mask=pre_mask, condition=cond,
              condition_mask=cond_mask)
    out = model(x, mask=mask, reduction="none", generator=torch.Generator().manual_seed(seed), **kw)  # (b, n - 1)
    counted = mask[:, 1:] & mask[:, :-1]

    none = torch.zeros(b, n, dtype=torch.bool)
    loss = model(x, mask=none, generator=torch.Generator().manual_seed(seed), **kw)
    grads = torch.autograd.grad(loss, [x, *net.parameters()], allow_unused=True)
    assert loss.item() == 0.0 and all(gr is not None and not bool(gr.any()) for gr in grads[:2]), \
        "an all-padding batch is not a loss of 0 with zero gradients"

    model.eval()
    start = torch.randn(b, 3, d, generator=g)
    start_mask = _lengths_mask(g, b, 3, left=True, empty=False)
    gen_kw = dict(mask=start_mask, context_mask=ctx_mask, prepend_mask=pre_mask, condition_mask=cond_mask,
                  cond_scale={"joint": 1.5, "context": 2.0, "condition": -0.5}, temperature=0.0)
    with torch.no_grad():  # fresh conditions: at sampling time only the masks hide anything
        clean_kw = dict(context=torch.randn(b, j, c, generator=g), prepend_embeds=torch.randn(b, m, c, generator=g),
                        condition=torch.randn(b, k, generator=g))
        dirty_kw = dict(context=clean_kw["context"].masked_fill(~ctx_mask[..., None], value),
                        prepend_embeds=clean_kw["prepend_embeds"].masked_fill(~pre_mask[..., None], value),
                        condition=clean_kw["condition"].masked_fill(~cond_mask[:, None], value))
        want = model.generate(start, 3, **gen_kw, **clean_kw)
        for cache_kv in (True, False):
            got = model.generate(start.masked_fill(~start_mask[..., None], value), 3, cache_kv=cache_kv, **gen_kw, **dirty_kw)
            assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-5, rtol=1e-5), \
                f"garbage in padding changed guided generation (cache_kv={cache_kv})"
    model.train()
    return Probe(out, {"x": x, "context": ctx, "prefix": pre, "condition": cond},
                 {"x": ~mask[..., None].expand_as(x), "context": hidden_ctx[..., None].expand_as(ctx),
                  "prefix": hidden_pre[..., None].expand_as(pre), "condition": hidden_cond.expand_as(cond)},
                 dead=~counted,
                 bad_calls=[
                     ("x of wrong width", lambda: model(torch.randn(b, n, d + 1)), ValueError, "x"),
                     ("int mask", lambda: model(x, mask=mask.int()), TypeError, "mask"),
                     ("unknown reduction", lambda: model(x, reduction="avg"), ValueError, "reduction"),
                     ("context of wrong width", lambda: model(x, context=torch.randn(b, j, c + 1)), ValueError, "context"),
                     ("dim_out that is not 2 * dim_in", lambda: sf.ContinuousAutoregressiveWrapper(net, probabilistic=not probabilistic),
                      ValueError, "dim_out"),
                     ("a non-causal net", lambda: sf.ContinuousAutoregressiveWrapper(sf.ContinuousTransformerWrapper(
                         dim_in=d, dim_out=d, max_seq_len=8, attn_layers=sf.Encoder(dim=c, depth=1))), ValueError, "causal"),
                     ("an all-padding start", lambda: model.generate(start, 2, mask=torch.zeros(b, 3, dtype=torch.bool)), ValueError, "mask"),
                     ("a scale for a condition not given", lambda: model.generate(start, 2, cond_scale={"prepend": 2.0}), ValueError, "prepend"),
                     ("negative seq_len", lambda: model.generate(start, -1), ValueError, "seq_len"),
                     ("negative temperature", lambda: model.generate(start, 1, temperature=-1.0), ValueError, "temperature"),
                     ("negative_context_mask alone", lambda: model.generate(start, 1, negative_context_mask=ctx_mask), ValueError,
                      "negative_context"),
                     ("start too long for max_seq_len", lambda: model.generate(start, 20), ValueError, "max_seq_len"),
                 ])


def probe_non_autoregressive(seed: int, value: float) -> Probe:
    """``NonAutoregressiveWrapper`` in training mode with every kind of condition dropped per sample:
    garbage ids at padded positions, garbage at masked context and prefix positions and in every dropped
    condition. Per-position losses at positions not hidden (padding included) are exactly 0. Also: an
    all-padding batch is a loss of exactly 0 with zero gradients, and guided decoding with garbage in
    masked conditions equals that with clean ones, with no ``mask_id`` left."""
    g = _gen(seed)
    b, n, j, m, c, k, vocab = 4, 6, 3, 2, 8, 3, 7
    mask_id = vocab - 1
    probs, all_prob = {"context": 0.5, "prepend": 0.5, "condition": 0.5}, 0.2
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=vocab, logits_dim=vocab - 1, max_seq_len=16, attn_layers=sf.Encoder(
        dim=c, depth=1, heads=2, dim_head=4, cross_attend=True, use_adaptive_layernorm=True, dim_condition=k))
    model = sf.NonAutoregressiveWrapper(net, mask_id=mask_id, steps=3, cond_drop_prob=probs, cond_drop_all_prob=all_prob).train()
    mask = _lengths_mask(g, b, n, left=seed % 4 < 2)
    ctx_mask, pre_mask, cond_mask, dropped = _cond_kinds_probe(g, b, j, m, c, k, seed, probs, all_prob)
    hidden_ctx = ~ctx_mask | dropped["context"][:, None]
    hidden_pre = ~pre_mask | dropped["prepend"][:, None]
    hidden_cond = (~cond_mask | dropped["condition"])[:, None]
    tokens = torch.randint(0, vocab - 1, (b, n), generator=g)
    garbage = 0 if value == 0 else (10**6 if value == value else -7)
    x = tokens.masked_fill(~mask, garbage)
    ctx = _leaf(torch.randn(b, j, c, generator=g), hidden_ctx[..., None], value)
    pre = _leaf(torch.randn(b, m, c, generator=g), hidden_pre[..., None], value)
    cond = _leaf(torch.randn(b, k, generator=g), hidden_cond, value)
    kw = dict(context=ctx, context_mask=ctx_mask, prepend_embeds=pre, prepend_mask=pre_mask, condition=cond,
              condition_mask=cond_mask)
    replay = torch.Generator().manual_seed(seed)  # what forward draws: the drops, then the hidden tokens
    sf.drop_conditions(sf.Conditions(ctx, ctx_mask, pre, pre_mask, cond, cond_mask), probs, all_prob=all_prob, generator=replay)
    _, hidden = model.hide_tokens(tokens, mask, generator=replay)
    out = model(x, mask=mask, reduction="none", generator=torch.Generator().manual_seed(seed), **kw).loss  # (b, n)

    none = torch.zeros(b, n, dtype=torch.bool)
    loss = model(x, mask=none, generator=torch.Generator().manual_seed(seed), **kw).loss
    grads = torch.autograd.grad(loss, [ctx, *net.parameters()], allow_unused=True)
    assert loss.item() == 0.0 and all(gr is not None and not bool(gr.any()) for gr in grads[:2]), \
        "an all-padding batch is not a loss of 0 with zero gradients"

    model.eval()
    gen_kw = dict(mask=mask, context_mask=ctx_mask, prepend_mask=pre_mask, condition_mask=cond_mask, temperature=0.0)
    with torch.no_grad():  # fresh conditions: at sampling time only the masks hide anything
        clean_kw = dict(context=torch.randn(b, j, c, generator=g), prepend_embeds=torch.randn(b, m, c, generator=g),
                        condition=torch.randn(b, k, generator=g))
        dirty_kw = dict(context=clean_kw["context"].masked_fill(~ctx_mask[..., None], value),
                        prepend_embeds=clean_kw["prepend_embeds"].masked_fill(~pre_mask[..., None], value),
                        condition=clean_kw["condition"].masked_fill(~cond_mask[:, None], value))
        for scale in (3.0, {"context": 2.0, "prepend": 1.5, "condition": -0.5}):
            want = model.generate(seq_len=n, cond_scale=scale, **gen_kw, **clean_kw)
            got = model.generate(seq_len=n, cond_scale=scale, **gen_kw, **dirty_kw)
            assert torch.equal(got, want), "garbage in masked conditions changed the decoded tokens"
            assert not bool((got == mask_id).any()), "mask_id left in a decoded sample"
    model.train()
    bad_x = tokens.clone()
    bad_x[-1, 0] = mask_id  # the last sample is all real
    return Probe(out, {"context": ctx, "prefix": pre, "condition": cond},
                 {"context": hidden_ctx[..., None].expand_as(ctx), "prefix": hidden_pre[..., None].expand_as(pre),
                  "condition": hidden_cond.expand_as(cond)},
                 dead=~hidden,
                 bad_calls=[
                     ("mask_id outside the vocabulary", lambda: sf.NonAutoregressiveWrapper(net, mask_id=vocab), ValueError, "mask_id"),
                     ("steps of 0", lambda: sf.NonAutoregressiveWrapper(net, mask_id=mask_id, steps=0), ValueError, "steps"),
                     ("unknown schedule", lambda: sf.NonAutoregressiveWrapper(net, mask_id=mask_id, schedule="cubic"), ValueError, "schedule"),
                     ("a causal net", lambda: sf.NonAutoregressiveWrapper(sf.TransformerWrapper(
                         num_tokens=vocab, max_seq_len=8, attn_layers=sf.Decoder(dim=c, depth=1)), mask_id=mask_id), ValueError, "Encoder"),
                     ("mask_id at a real position", lambda: model(bad_x), ValueError, "mask_id"),
                     ("float mask", lambda: model(x, mask=mask.float()), TypeError, "mask"),
                     ("float ids", lambda: model(x.float()), TypeError, "x"),
                     ("batch_size against the conditions", lambda: model.generate(b + 1, n, context=ctx), ValueError, "batch_size"),
                     ("no batch size at all", lambda: model.generate(seq_len=n), ValueError, "batch_size"),
                     ("steps of 0 at generation", lambda: model.generate(b, n, steps=0), ValueError, "steps"),
                     ("a scale for a condition not given", lambda: model.generate(b, n, context=ctx, cond_scale={"condition": 2.0}),
                      ValueError, "condition"),
                     ("seq_len beyond max_seq_len", lambda: model.generate(b, 17), ValueError, "max_seq_len"),
                 ])


# ----------------------------------------------------------------------------------------------------
# the registry
# ----------------------------------------------------------------------------------------------------

def _probe(module: str, name: str, *args) -> Probe:
    """A probe defined beside its wrapper's own tests (imported when called: those files import this one)."""
    import importlib

    return getattr(importlib.import_module(module), name)(*args)


DOORS: dict[str, Door] = {d.name: d for d in [
    Door("attend", has_dead=True, probe=probe_attend, note="hypothesis suite per clause: test_attend.py"),
    Door("prepare_mask", has_dead=True, probe=probe_prepared_mask),
    Door("varlen_attention", probe=probe_varlen_attention, note="float64 references per segment: test_varlen.py"),
    Door("PreparedMask", has_dead=True, probe=probe_prepared_mask, note="made by prepare_mask, passed to attend as mask"),
    Door("masked_mean", has_dead=True, probe=probe_masked_mean),
    Door("safe_cross_entropy", has_dead=True, probe=probe_safe_cross_entropy),
    Door("check_finite", probe_check_finite),
    Door("guided_logits", probe_guided_logits),
    Door("sample_logits", probe_sampling),
    Door("top_k", probe_sampling),
    Door("top_p", probe_sampling),
    Door("min_p", probe_sampling),
    Door("top_a", probe_sampling),
    Door("left_pad", probe=probe_generate_tokens, note="the list-of-prompts path of generate"),
    Door("drop_condition", probe_drop_condition),
    Door("drop_conditions", probe=probe_drop_conditions),
    Door("compose_guidance", probe=probe_compose_guidance),
    Door("generate_tokens", probe_generate_tokens),
    Door("RMSNorm", _rowwise_probe(_norm)),
    Door("AdaptiveRMSNorm", _rowwise_probe(_ada_norm)),
    Door("PrefixDecoder", has_dead=True, probe=probe_prefix_decoder,
         note="x-transformers' results on the same weights: test_xt_names.py"),
    Door("TransformerBlock", has_dead=True, probe=_stack_probe(lambda: sf.TransformerBlock(8, heads=2, dim_head=4)),
         note="x-transformers' results on the same weights: test_xt_names.py"),
    Door("AttentionPool", has_dead=True, probe=probe_attention_pool),
    Door("ViTransformerWrapper", probe=probe_vit),
    Door("DPO", has_dead=True, probe=lambda seed, value: _probe("test_dpo", "probe_dpo", seed, value),
         note="named tests (float64 reference, x-transformers parity): test_dpo.py"),
    Door("XValTransformerWrapper", probe=lambda seed, value: _probe("test_xval", "probe_xval_wrapper", seed, value),
         note="named tests (float64 references, x-transformers parity): test_xval.py"),
    Door("XValAutoregressiveWrapper", has_dead=True,
         probe=lambda seed, value: _probe("test_xval", "probe_xval_autoregressive", seed, value),
         note="named tests (losses by hand, guidance from separate passes, cached = uncached): test_xval.py"),
    Door("Attend", has_dead=True, probe=lambda seed, value: _probe("test_xt_attend", "probe_attend_module", seed, value),
         note="x-transformers' Attend module: float64 references and x-transformers parity in test_xt_attend.py"),
    Door("NeoMLP", probe=lambda seed, value: _probe("test_neo_mlp", "probe_neo_mlp", seed, value),
         note="named tests (missing features = removed nodes in float64, x-transformers parity): test_neo_mlp.py"),
    Door("UniversalPretrainWrapper",
         probe=lambda seed, value: _probe("test_xt_wrappers_more", "probe_universal_pretrain", seed, value),
         note="no masked input; buffer enrichment and loss by hand, generator parity: test_xt_wrappers_more.py"),
    Door("MultiInputTransformerWrapper", has_dead=True,
         probe=lambda seed, value: _probe("test_multi_input", "probe_multi_input", seed, value),
         note="float64 reference, both caches, x-transformers parity on converted weights: test_multi_input.py"),
    Door("ContinuousTransformerAutoencoder", has_dead=True,
         probe=lambda seed, value: _probe("test_continuous_autoencoder", "probe_continuous_autoencoder", seed, value),
         note="named tests (float64 reference, x-transformers parity): test_continuous_autoencoder.py"),
    Door("GPTVAE", probe=lambda seed, value: _probe("test_gpt_vae", "probe_gpt_vae", seed, value),
         note="named tests (float64 reference, guidance, x-transformers parity): test_gpt_vae.py"),
    Door("FreeTransformer", probe=lambda seed, value: _probe("test_free_transformer", "probe_free_transformer", seed, value),
         note="x-transformers parity on converted weights (losses, gradients, sampling), float64 BinaryMapper, padded = "
              "alone: test_free_transformer.py"),
    Door("BeliefStateWrapper", has_dead=True,
         probe=lambda seed, value: _probe("test_belief_state", "probe_belief_state", seed, value),
         note="float64 reference (each prefix and reversed suffix alone), guidance from separate passes, "
              "x-transformers parity: test_belief_state.py"),
    Door("NextLatentWrapper", probe=lambda seed, value: _probe("test_next_latent", "probe_next_latent", seed, value),
         note="float64 references per term, x-transformers parity on converted weights: test_next_latent.py"),
    Door("ResidualDynamics", probe=lambda seed, value: _probe("test_next_latent", "probe_next_latent", seed, value),
         note="NextLatentWrapper's dynamics (no masks of its own): test_next_latent.py"),
    Door("RolloutGRU", note="NextLatentWrapper's GRU dynamics (no masks of its own): test_next_latent.py"),
    Door("MSECosineSimLoss", note="NextLatentWrapper's loss (position-wise, selected by the wrapper): test_next_latent.py"),
    Door("EntropyBasedTokenizer", has_dead=True,
         probe=lambda seed, value: _probe("test_entropy_tokenizer", "probe_entropy_tokenizer", seed, value),
         note="float64 references, padding never moves a boundary, x-transformers parity: test_entropy_tokenizer.py"),
    Door("FeedForward", _rowwise_probe(_ff)),
    Door("RotaryEmbedding", probe_rotary),
    Door("apply_rotary", probe_rotary),
    Door("alibi_bias", probe_alibi),
    Door("AbsolutePositionalEmbedding", probe_abs_pos),
    Door("positions_from_mask", probe_positions_from_mask),
    Door("validate_mask", probe_mask_helpers),
    Door("as_attention_mask", probe_mask_helpers),
    Door("combine_masks", probe_mask_helpers),
    Door("dead_rows", probe_mask_helpers),
    Door("alive_rows", probe_mask_helpers),
    Door("alive_keys", probe_mask_helpers),
    Door("causal_mask", probe_mask_helpers),
    Door("padding_mask", probe_positions_from_mask),
    Door("StaticKVCache", probe_static_cache, note="the decode step: tests/test_static_cache.py"),
    Door("build_static_cache", probe_static_cache, note="the decode step: tests/test_static_cache.py"),
    Door("KVCache", probe_cache, cases=("Decoder", "CrossAttender", "TransformerWrapper", "XTransformer")),
    Door("Attention", cases=("Attention-self", "Attention-self-padding", "Attention-cross", "Attention-past-kv",
                              "Attention-memkv-sink")),
    Door("AttentionLayers", cases=("Encoder", "Decoder", "CrossAttender")),
    Door("Encoder", cases=("Encoder",)),
    Door("Decoder", cases=("Decoder", "Decoder-adaptive", "Decoder-memkv-sink", "Decoder-sink-bias", "Decoder-gated")),
    Door("CrossAttender", cases=("CrossAttender",)),
    Door("TransformerWrapper", cases=("TransformerWrapper", "TransformerWrapper-prefix", "TransformerWrapper-memory",
                                       "TransformerWrapper-softclamp-l2norm")),
    Door("ContinuousTransformerWrapper", cases=("ContinuousTransformerWrapper",)),
    Door("XTransformer", cases=("XTransformer",)),
    Door("AutoregressiveWrapper", cases=("guidance",), note="every clause: test_contract_guidance.py"),
    Door("ContinuousAutoregressiveWrapper", has_dead=True, probe=probe_continuous_autoregressive,
         note="named tests (losses by hand, guidance from separate passes, cached = uncached): test_continuous.py"),
    Door("NonAutoregressiveWrapper", has_dead=True, probe=probe_non_autoregressive,
         note="named tests (losses by hand, schedule, guidance from separate passes): test_nonautoregressive.py"),
    Door("find_nonfinite", note="diagnostics: tests/test_debug.py (S9, the loss blamed first)"),
    Door("mask_report", note="diagnostics: tests/test_debug.py"),
    Door("plot_mask", note="diagnostics: tests/test_debug.py"),
    Door("from_x_transformers", note="conversion: tests/test_interop.py (S9 on unsupported options)"),
    Door("load_pretrained", note="hostile checkpoints (S9): tests/test_pretrained.py"),
    Door("save_pretrained", note="checkpoints: tests/test_pretrained.py"),
    Door("XLAutoregressiveWrapper", probe=lambda seed, value: _probe("test_xl", "probe_xl", seed, value),
         note="x-transformers parity (loss, gradients, sampling, test-time training), padded = samples alone by "
              "hand: test_xl.py"),
    Door("TTTModuleWrapper", note="runs the wrapped module per sample (position-wise inside attention): test_xl.py"),
    Door("LowRankLinear", note="a position-wise linear layer (x-transformers parity of its use): test_xl.py"),
    Door("TTTNextLatentPredictionLoss", note="position-wise, masked positions selected to 0 (parity): test_xl.py"),
    *(Door(name, probe=lambda seed, value, name=name: _probe("test_xt_modules_parts", "probe_part", name, seed, value),
           note="x-transformers' part (safeformer.x_transformers): init, strict state_dict both ways, outputs and "
                "gradients on the same weights, clear errors: test_xt_modules_parts.py") for name in xt_modules.__all__),
    Door("TTTMetaLearningTargetKLLoss", note="an Encoder (a door) under the given mask, position-wise heads: "
                                            "test_xl.py"),
]}

NOT_DOORS: dict[str, str] = {
    "Mems": "a list of memories returned by TransformerWrapper(return_mems=True) (its door is the wrapper)",
    "EpisodicMemories": "learned key/value slots; takes no tensor (its door is XLAutoregressiveWrapper)",
    "BACKENDS": "a tuple of backend names",
    "Conditions": "a plain record of condition tensors (its doors are drop_conditions and the wrappers)",
    "FILTERS": "a dict of the filter functions (each is a door: top_k, top_p, min_p)",
    "AttentionPlan": "a plain record of a planning decision",
    "plan_attention": "plans from shapes, dtype and device names; takes no tensor",
    "Configurable": "a mixin (save/load are the doors save_pretrained / load_pretrained)",
    "DeadRowReport": "a result record of mask_report",
    "MaskReport": "a result record of mask_report",
    "NonFiniteReport": "a result record of find_nonfinite",
    "NonFiniteTensor": "a result record of find_nonfinite",
    "substitute_kernel": "a testing hook that swaps the SDPA kernel",
    "alibi_slopes": "takes a head count; its output feeds the door alibi_bias",
    "VarlenPlan": "a plain record of a planning decision",
    "VarlenLayout": "a plain record of segment lengths and offsets (made by varlen_layout)",
    "plan_varlen": "plans from shapes, dtype and device names; takes no tensor",
    "varlen_layout": "turns per-sample counts into offsets; no attention (its output feeds varlen_attention)",
    "varlen_kernel_available": "asks the machine; takes no tensor",
    "substitute_varlen_kernel": "a testing hook that swaps the varlen kernel",
    "LayerIntermediates": "a result record of return_intermediates (its door is the wrapper)",
    "AttnIntermediate": "a result record of return_intermediates (its door is the wrapper)",
    "eval_decorator": "a decorator: takes a method, no tensors",
    "LinearNoBias": "builds a torch.nn.Linear without bias (x-transformers' alias); takes no tensor",
    "RelativeProjPositionalBias": "a bias whose row i reads x[i] alone and takes no mask (its door is "
                                  "Attention(use_rel_proj_pos_bias=True), which selects padded rows first)",
    "log_prob_from_hard_attend": "reads a result record of return_intermediates (its door is the Attention)",
    "layer_schedule": "builds a tuple of per-layer numbers from numbers; takes no tensor",
    "RelativePositionBias": "a bias from integer positions, no mask and no float input (its door is the stack with "
                            "rel_pos_bias=True: test_xt_relpos.py, contract case Decoder-t5-relpos)",
}

# the public names the registry covers: the user's API (``safeformer.__all__``), the testing module's
# (test hooks and planning internals) and the public callables that live in their module only
PUBLIC: dict[str, object] = {
    **{name: getattr(sf, name) for name in sf.__all__},
    **{name: getattr(sf.testing, name) for name in sf.testing.__all__},
    "drop_condition": sf.core.conditions.drop_condition,
    # the decode step's cache (safeformer.decoding.static): generate builds it, users may too
    "StaticKVCache": sf.decoding.static.StaticKVCache,
    "build_static_cache": sf.decoding.static.build_static_cache,
    # x-transformers' small parts, importable from safeformer.x_transformers (safeformer/xt_modules.py)
    **{name: getattr(xt_modules, name) for name in xt_modules.__all__},
}

PROBE_DOORS = [d for d in DOORS.values() if d.probe is not None]
