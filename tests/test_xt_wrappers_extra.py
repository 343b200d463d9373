"""x-transformers' ``TransformerWrapper`` / ``AutoregressiveWrapper`` options built by helper F: the looped LM
(``looped``, ``max_looped_steps``, looped inference with early exit, the looped loss, looped generation) and the
wrapper conveniences (see each test's docstring).

The math is checked against x-transformers itself on copied weights (float32, every weight perturbed); safety by
a padded sample equal to the sample alone, NaN planted at padded positions reaching nothing (outputs and
gradients), all-padding samples finite, the KV cache equal to the full forward where the option is per token,
and clear refusals where it is not.

Shape legend: b batch, n positions, c model width, v vocabulary, L loop steps.
"""

from __future__ import annotations

import pytest
import torch
import x_transformers as xt
from helpers import perturb_params

import safeformer as sf
from safeformer.decoding.static import static_reason

DIM, HEADS, DIM_HEAD, VOCAB = 32, 4, 8, 50


pytestmark = pytest.mark.usefixtures("one_thread")
_perturb = perturb_params


def _looped_pair(seed: int = 0, steps: int = 4, **opts):
    """``(ours, peer)``: x-transformers' looped wrapper (weights perturbed) and safeformer's built by the same call,
    x-transformers' state dict loaded strictly."""
    torch.manual_seed(seed)
    common = dict(dim=DIM, depth=2, heads=HEADS, attn_dim_head=DIM_HEAD)
    peer = _perturb(xt.TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, looped=True, max_looped_steps=steps,
                                          attn_layers=xt.Decoder(**common, pre_and_post_norm=True, **opts)), seed).eval()
    ours = sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, looped=True, max_looped_steps=steps,
                                 attn_layers=sf.Decoder(**common, pre_and_post_norm=True, **opts)).eval()
    ours.load_state_dict(peer.state_dict(), strict=True)  # the same keys as x-transformers'
    return ours, peer


def _looped(steps: int = 3, **kw) -> sf.TransformerWrapper:
    torch.manual_seed(0)
    return sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, looped=True, max_looped_steps=steps, **kw,
                                 attn_layers=sf.Decoder(dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD,
                                                        rotary_pos_emb=True, pre_and_post_norm=True)).eval()


# ---------------------------------------------------------------------------------------------------------------
# looped
# ---------------------------------------------------------------------------------------------------------------


def test_looped_forward_matches_x_transformers():
    """Logits, every step's exit logits and logits equal x-transformers' on copied weights; padded queries aside,
    a right-padded batch gives the same real rows."""
    ours, peer = _looped_pair()
    tokens = torch.randint(0, VOCAB, (2, 9))
    mask = torch.tensor([[True] * 9, [True] * 6 + [False] * 3])
    with torch.no_grad():
        for kw in (dict(), dict(mask=mask), dict(looped_steps=2), dict(max_looped_steps=6)):
            got, gi = ours(tokens, return_intermediates=True, looped_pred_all_logits=True, **kw)
            want, wi = peer(tokens, return_intermediates=True, looped_pred_all_logits=True, **kw)
            real = kw.get("mask", torch.ones(2, 9, dtype=torch.bool))
            torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
            assert len(gi.exit_logits) == len(wi.exit_logits) == len(gi.all_pred_logits) == len(wi.all_pred_logits)
            for a, b in zip(gi.exit_logits + gi.all_pred_logits, wi.exit_logits + wi.all_pred_logits):
                torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=1e-5)
            assert gi.exit_indices.tolist() == wi.exit_indices.expand(2, 1).tolist()


@pytest.mark.parametrize("threshold", [0.9, 0.5, 0.2])
def test_looped_inference_matches_x_transformers(threshold):
    """x-transformers' looped inference, prompt then one token at a time with its cache: the same logits and the
    same exit step per call (the prompt's keys/values of each run read by the same run of later tokens)."""
    ours, peer = _looped_pair(seed=1, steps=5)
    with torch.no_grad():  # exit gates of both moved so that different calls stop at different steps
        w = 0.3 * torch.randn(1, DIM)
        ours.exit_gate.weight.copy_(w)
        peer.exit_gate.weight.copy_(w)
    kw = dict(max_looped_steps=5, looped_inference=True, return_intermediates=True, looped_exit_prob_threshold=threshold)
    seq = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        got, gi = ours(seq, **kw)
        want, wi = peer(seq, **kw)
        for _ in range(5):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert gi.exit_indices.tolist() == wi.exit_indices.tolist()
            seq = torch.cat((seq, got[:, -1:].argmax(-1)), dim=1)
            got, gi = ours(seq, cache=gi, **kw)
            want, wi = peer(seq, cache=wi, **kw)
        assert len(gi.looped_prompt_kv_cache) == 5


def test_looped_loss_matches_x_transformers():
    """``AutoregressiveWrapper``'s looped loss (exit-weighted per-step losses plus the exit gate's loss) equals
    x-transformers', ignored targets included; gradients finite."""
    ours, peer = _looped_pair()
    tokens = torch.randint(0, VOCAB, (2, 9))
    tokens[1, 6:] = -100
    a = sf.AutoregressiveWrapper(ours, looped_loss_threshold_exit=0.1, looped_loss_slope=20.0)
    b = xt.AutoregressiveWrapper(peer, looped_loss_threshold_exit=0.1, looped_loss_slope=20)
    loss = a(tokens)
    torch.testing.assert_close(loss, b(tokens), atol=1e-5, rtol=1e-5)
    loss.backward()
    assert ours.exit_gate.weight.grad.abs().sum() > 0
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)


def test_looped_loss_without_counted_targets_is_zero():
    ar = sf.AutoregressiveWrapper(_looped().train())
    tokens = torch.full((2, 6), -100)
    loss = ar(tokens)
    assert loss.item() == 0.0
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in ar.parameters() if p.grad is not None)


def test_looped_padded_equals_alone_and_nan_stays_out():
    """A left-padded sample (and its NaN-planted padded prefix rows) equals the sample alone in every run's
    logits and exit logits; gradients stay finite; an all-padding sample is finite."""
    model = _looped(steps=3).train()
    tokens = torch.randint(0, VOCAB, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, :3] = False
    mask[2] = False
    pre = torch.randn(3, 2, DIM)
    pre_mask = torch.tensor([[True, True], [False, True], [False, False]])
    pre = torch.where(pre_mask[..., None], pre, float("nan")).requires_grad_()
    out, inter = model(tokens, mask=mask, prepend_embeds=pre, prepend_mask=pre_mask, return_intermediates=True)
    assert torch.isfinite(out).all()
    alone, ai = model(tokens[1:2, 3:], prepend_embeds=pre[1:2, 1:].detach(), return_intermediates=True)
    real = torch.cat((pre_mask, mask), 1)[1]
    torch.testing.assert_close(out[1][real], alone[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(inter.exit_logits + inter.all_pred_logits, ai.exit_logits + ai.all_pred_logits):
        torch.testing.assert_close(a[1][real], b[0], atol=1e-5, rtol=1e-5)
        assert torch.isfinite(a).all()
    out.sum().backward()
    assert torch.isfinite(pre.grad).all() and (pre.grad[~pre_mask] == 0).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("memory", [0, 2])
def test_looped_cache_equals_full_forward(memory):
    """Outside looped inference the cache keeps every run's keys/values, so decoding one token at a time equals
    the full forward (left padding and memory tokens included)."""
    model = _looped(steps=3, num_memory_tokens=memory)
    tokens = torch.randint(0, VOCAB, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, :2] = False
    with torch.no_grad():
        full = model(tokens, mask=mask)
        out, cache = model(tokens[:, :4], mask=mask[:, :4], return_cache=True)
        steps = [out[:, -1]]
        for t in range(4, 8):
            out, cache = model(tokens[:, t:t + 1], cache=cache, return_cache=True)
            steps.append(out[:, -1])
    torch.testing.assert_close(torch.stack(steps[:-1], 1), full[:, 3:7], atol=1e-5, rtol=1e-5)
    assert len(cache.looped_prompt_kv) == 3


def test_looped_batched_early_exit_equals_each_sample_alone():
    """safeformer's looped inference runs a batch (x-transformers: one sample): each sample stops at its own step
    and keeps that step's output and cache slot, exactly as when it decodes alone."""
    model = _looped(steps=5)
    with torch.no_grad():
        model.exit_gate.weight.copy_(0.4 * torch.randn(1, DIM))
    tokens = torch.randint(0, VOCAB, (3, 5))
    kw = dict(looped_inference=True, max_looped_steps=5, looped_exit_prob_threshold=0.6)
    with torch.no_grad():
        logits, cache = model(tokens, return_cache=True, **kw)
        alone = [model(tokens[i:i + 1], return_cache=True, **kw) for i in range(3)]
        for _ in range(4):
            nxt = logits[:, -1:].argmax(-1)
            logits, cache = model(nxt, cache=cache, return_cache=True, **kw)
            alone = [model(nxt[i:i + 1], cache=c, return_cache=True, **kw) for i, (_, c) in enumerate(alone)]
            for i, (a, _) in enumerate(alone):
                torch.testing.assert_close(logits[i], a[0], atol=1e-5, rtol=1e-5)
    assert cache.exit_indices.shape == (3, 5)
    assert cache.exit_indices.tolist() == [c.exit_indices[0].tolist() for _, c in alone]
    assert len(set(cache.exit_indices[:, 1:].flatten().tolist())) > 1  # the samples did stop at different steps


def test_looped_generate():
    """Generation with a fixed number of loops (every call stops at its last step) or with early exit, a padded
    batch equal to each prompt alone; the intermediates carry the exit steps."""
    ar = sf.AutoregressiveWrapper(_looped(steps=3))
    prompts = [torch.randint(0, VOCAB, (4,)), torch.randint(0, VOCAB, (6,))]
    out, inter = ar.generate(prompts, 5, temperature=0.0, looped_steps=4, return_intermediates=True)
    assert out.shape == (2, 5) and (inter.exit_indices == 3).all() and inter.exit_indices.shape == (2, 5)
    for i, p in enumerate(prompts):
        assert torch.equal(out[i], ar.generate(p[None], 5, temperature=0.0, looped_steps=4)[0])
    out, inter = ar.generate(prompts, 5, temperature=0.0, max_looped_steps=5, return_intermediates=True)
    assert (inter.exit_indices < 5).all() and inter.looped_prompt_kv_cache is not None
    for i, p in enumerate(prompts):
        assert torch.equal(out[i], ar.generate(p[None], 5, temperature=0.0, max_looped_steps=5)[0])


def test_looped_refusals():
    layers = sf.Decoder(dim=DIM, depth=1, heads=HEADS)
    with pytest.raises(ValueError, match="pre_and_post_norm"):
        sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=8, looped=True, attn_layers=layers)
    with pytest.raises(ValueError, match="max_looped_steps"):
        _looped(steps=0)
    plain = sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=8, attn_layers=layers)
    with pytest.raises(ValueError, match="looped=True"):
        plain(torch.zeros(1, 3, dtype=torch.long), looped_steps=2)
    with pytest.raises(ValueError, match="looped=True"):
        sf.AutoregressiveWrapper(plain).generate(torch.zeros(1, 3, dtype=torch.long), 2, looped_steps=2)
    model = _looped()
    with pytest.raises(ValueError, match="looped_exit_prob_threshold"):
        model(torch.zeros(1, 3, dtype=torch.long), looped_exit_prob_threshold=2.0)
    assert static_reason(model) is None  # a looped net decodes on the static step, each run with its own slots
    _, cache = model(torch.zeros(1, 3, dtype=torch.long), return_cache=True, looped_inference=True)
    with pytest.raises(ValueError, match="one token at a time"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache, looped_inference=True)
    with pytest.raises(ValueError, match="loop steps"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache, looped_inference=True, looped_steps=5)


# ---------------------------------------------------------------------------------------------------------------
# wrapper conveniences
# ---------------------------------------------------------------------------------------------------------------


def _pair(seed: int = 0, encoder: bool = False, cross: bool = False, layer_opts: dict | None = None, **wopts):
    """``(ours, peer)``: x-transformers' wrapper with the wrapper options ``wopts`` (weights perturbed) and
    safeformer's with the same options on the same weights (the stack through ``from_x_transformers``)."""
    torch.manual_seed(seed)
    cls = xt.Encoder if encoder else xt.Decoder
    common = dict(dim=DIM, depth=2, heads=HEADS, attn_dim_head=DIM_HEAD)
    if cross:
        common.update(cross_attend=True)
    common.update(layer_opts or {})
    peer = _perturb(xt.TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, **wopts, attn_layers=cls(**common)), seed).eval()
    twin = xt.TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, attn_layers=cls(**common)).eval()
    theirs = peer.state_dict()
    twin.load_state_dict({k: v for k, v in theirs.items() if k.startswith("attn_layers.")}, strict=False)
    base = sf.from_x_transformers(twin).eval()
    ours = sf.TransformerWrapper(**{**base._sf_config, **wopts}).eval()
    ours.load_state_dict({k: v for k, v in base.state_dict().items() if k.startswith("attn_layers.")}, strict=False)
    with torch.no_grad():
        for key, value in ours.state_dict().items():
            if not key.startswith("attn_layers."):
                value.copy_(theirs["token_emb.emb.weight" if key == "token_emb.weight" else key])
    return ours, peer


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


TOKENS_MASK = torch.tensor([[True] * 9, [True] * 6 + [False] * 3])


@pytest.mark.parametrize("wopts", [dict(emb_dim=16), dict(emb_dim=48, num_memory_tokens=2), dict(num_output_heads=3),
                                   dict(sigsoftmax_logits=True), dict(embed_num_tokens=dict(kind=3, part=5)),
                                   dict(emb_dim=16, embed_num_tokens=dict(kind=3), num_output_heads=2),
                                   dict(emb_dim=16, sigsoftmax_logits=True)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_options_match_x_transformers(wopts):
    """``emb_dim`` (embeddings of another width, projected), ``num_output_heads`` (a tuple of logits),
    ``sigsoftmax_logits``, ``embed_num_tokens`` with ``embed_ids``, and ``sum_embeds``: the same logits as
    x-transformers on copied weights, unpadded and right-padded (real rows)."""
    ours, peer = _pair(**wopts)
    tokens = torch.randint(0, VOCAB, (2, 9))
    kw = {}
    if "embed_num_tokens" in wopts:
        kw["embed_ids"] = {name: torch.randint(0, n, (2, 9)) for name, n in wopts["embed_num_tokens"].items()}
    kw["sum_embeds"] = torch.randn(2, 9, wopts.get("emb_dim", DIM))
    with torch.no_grad():
        for mask in (None, TOKENS_MASK):
            got, want = ours(tokens, mask=mask, **kw), peer(tokens, mask=mask, **kw)
            real = torch.ones(2, 9, dtype=torch.bool) if mask is None else mask
            got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
            assert len(got) == len(want) == wopts.get("num_output_heads", 1)
            for a, b in zip(got, want):
                _close(a[real], b[real])


def test_return_variants_match_x_transformers():
    """``return_logits_and_embeddings``, ``return_embeddings_and_intermediates`` and ``return_logit_entropies``
    return what x-transformers returns."""
    ours, peer = _pair()
    tokens = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        (la, ea), (lb, eb) = ours(tokens, return_logits_and_embeddings=True), peer(tokens, return_logits_and_embeddings=True)
        _close(la, lb)
        _close(ea, eb)
        (ea, ia), (eb, ib) = (ours(tokens, return_embeddings_and_intermediates=True),
                              peer(tokens, return_embeddings_and_intermediates=True))
        _close(ea, eb)
        assert isinstance(ia, sf.LayerIntermediates)
        (la, ia), (lb, ib) = ours(tokens, return_logit_entropies=True), peer(tokens, return_logit_entropies=True)
        _close(la, lb)
        _close(ia.logit_entropies, ib.logit_entropies)
        (_, ia), (_, ib) = ours(tokens, return_intermediates=True), peer(tokens, return_intermediates=True)
        _close(ia.last_layer_hiddens, ib.last_layer_hiddens)
        _close(ia.initial_embeds, ib.initial_embeds)


def test_attn_z_loss_matches_x_transformers():
    """``return_attn_z_loss``: x-transformers' z-loss of the attention logits (self and cross blocks), weight
    from the call or from the constructor; an ``AutoregressiveWrapper(add_attn_z_loss=True)`` adds it."""
    ours, peer = _pair(cross=True)
    tokens = torch.randint(0, VOCAB, (2, 9))
    ctx = torch.randn(2, 5, DIM)
    with torch.no_grad():
        for kw in (dict(), dict(attn_z_loss_weight=0.5)):
            (la, ia), (lb, ib) = (ours(tokens, context=ctx, return_attn_z_loss=True, **kw),
                                  peer(tokens, context=ctx, return_attn_z_loss=True, **kw))
            _close(la, lb)
            _close(ia.attn_z_loss, ib.attn_z_loss)
    # the wrapper's loss reads n - 1 positions (x-transformers' reads all n, whose last one predicts nothing): the
    # z-loss of those positions is added
    ours2, peer2 = _pair()
    a, b = sf.AutoregressiveWrapper(ours2, add_attn_z_loss=True), xt.AutoregressiveWrapper(peer2)
    z = peer2(tokens[:, :-1], return_attn_z_loss=True)[1].attn_z_loss
    _close(a(tokens), b(tokens) + z)


def test_attn_z_loss_padding_and_dead_rows():
    """Padded query rows and dead rows (a dropped context, an all-padding sample) add nothing to the z-loss and
    make no NaN, forward or backward: a left-padded sample scores what it scores alone; NaN planted at padded
    positions of the context stays out."""
    torch.manual_seed(0)
    model = sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, attn_layers=sf.Decoder(
        dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, cross_attend=True, rotary_pos_emb=True))
    tokens = torch.randint(0, VOCAB, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[0, :3] = False
    mask[2] = False
    ctx = torch.randn(3, 4, DIM)
    ctx_mask = torch.tensor([[True, True, False, False], [False] * 4, [False] * 4])
    ctx = torch.where(ctx_mask[..., None], ctx, float("nan")).requires_grad_()
    _, inter = model(tokens, mask=mask, context=ctx, context_mask=ctx_mask, return_attn_z_loss=True)
    assert torch.isfinite(inter.attn_z_loss)
    inter.attn_z_loss.backward()
    assert torch.isfinite(ctx.grad).all() and (ctx.grad[~ctx_mask] == 0).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        _, padded = model(tokens[:1], mask=mask[:1], context=ctx[:1], context_mask=ctx_mask[:1], return_attn_z_loss=True)
        _, alone = model(tokens[:1, 3:], context=ctx[:1, :2], return_attn_z_loss=True)
        _, empty = model(tokens[2:], mask=mask[2:], context=ctx[2:], context_mask=ctx_mask[2:], return_attn_z_loss=True)
    _close(padded.attn_z_loss, alone.attn_z_loss)
    assert empty.attn_z_loss.item() == 0.0


def test_embeddings_padded_equals_alone_and_nan_stays_out():
    """``sum_embeds`` with NaN at padded positions and ``embed_ids`` with garbage ids there (and ``emb_dim``): a
    left-padded sample equals the sample alone; gradients finite, zero at padded positions; an all-padding sample
    is finite; logit entropies of padded positions are 0."""
    torch.manual_seed(0)
    model = sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, emb_dim=16, embed_num_tokens=dict(kind=3),
                                  num_output_heads=2, sigsoftmax_logits=True,
                                  attn_layers=sf.Decoder(dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD))
    tokens = torch.randint(0, VOCAB, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[0, :2] = False
    mask[2] = False
    kinds = torch.where(mask, torch.randint(0, 3, (3, 6)), 99)
    extra = torch.where(mask[..., None], torch.randn(3, 6, 16), float("nan")).requires_grad_()
    (h1, h2), inter = model(tokens, mask=mask, embed_ids=dict(kind=kinds), sum_embeds=extra, return_logit_entropies=True)
    assert torch.isfinite(h1).all() and torch.isfinite(h2).all()
    assert (inter.logit_entropies[0][~mask] == 0).all() and (h1[~mask] == 0).all()
    (h1.sum() + h2.sum()).backward()
    assert torch.isfinite(extra.grad).all() and (extra.grad[~mask] == 0).all()
    with torch.no_grad():
        a1, a2 = model(tokens[:1, 2:], embed_ids=dict(kind=kinds[:1, 2:]), sum_embeds=extra[:1, 2:])
    _close(h1[0, 2:].detach(), a1[0])
    _close(h2[0, 2:].detach(), a2[0])


def test_conveniences_refusals():
    layers = lambda: sf.Decoder(dim=DIM, depth=1, heads=HEADS)  # noqa: E731
    with pytest.raises(ValueError, match="emb_dim"):
        sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=8, emb_dim=16, tie_embedding=True, attn_layers=layers())
    with pytest.raises(ValueError, match="num_output_heads"):
        sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=8, num_output_heads=0, attn_layers=layers())
    with pytest.raises(ValueError, match="num_output_heads"):
        sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=8, num_output_heads=2, mixture_of_softmax=True,
                              attn_layers=layers())
    model = sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=8, embed_num_tokens=dict(kind=3), attn_layers=layers())
    x = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="embed_ids"):
        model(x)
    with pytest.raises(ValueError, match="outside"):
        model(x, embed_ids=dict(kind=torch.full((1, 3), 3)))
    with pytest.raises(ValueError, match="sum_embeds"):
        model(x, embed_ids=dict(kind=x), sum_embeds=torch.zeros(1, 3, 5))
    with pytest.raises(ValueError, match="return_logits_and_embeddings"):
        model(x, embed_ids=dict(kind=x), return_logits_and_embeddings=True, return_embeddings=True)
    for opts in (dict(emb_dim=16), dict(num_output_heads=2), dict(sigsoftmax_logits=True)):  # each on the step
        assert static_reason(sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=8, attn_layers=layers(), **opts)) is None
    with pytest.raises(ValueError, match="prepend_embeds"):
        sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=8, emb_dim=16, attn_layers=layers())(
            x, prepend_embeds=torch.zeros(1, 2, DIM))


@pytest.mark.parametrize("rotary", [False, True])
def test_interspersed_memory_matches_x_transformers(rotary):
    """``memory_tokens_interspersed_every``: memory rows before every segment of tokens; the same logits and memory
    outputs as x-transformers (lengths a multiple of the segment or not)."""
    ours, peer = _pair(num_memory_tokens=2, memory_tokens_interspersed_every=3,
                       layer_opts=dict(rotary_pos_emb=True) if rotary else None)
    for n in (9, 8, 2):
        tokens = torch.randint(0, VOCAB, (2, n))
        with torch.no_grad():
            (a, ia), (b, ib) = ours(tokens, return_intermediates=True), peer(tokens, return_intermediates=True)
        _close(a, b)
        _close(ia.memory_tokens, ib.memory_tokens)


def test_interspersed_memory_padded_equals_alone():
    """Segments count each sample's real tokens: a left- or inner-padded sample equals the sample alone (memory
    rows included), NaN planted at masked context positions reaches nothing, gradients finite, an all-padding
    sample finite (it has no memory row at all); generation (re-encoding, no KV cache) of a padded batch equals
    each prompt alone."""
    torch.manual_seed(0)
    model = sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, num_memory_tokens=2,
                                  memory_tokens_interspersed_every=3, attn_layers=sf.Decoder(
                                      dim=DIM, depth=2, heads=HEADS, dim_head=DIM_HEAD, cross_attend=True,
                                      rotary_pos_emb=True))
    tokens = torch.randint(0, VOCAB, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[0, :2] = False
    mask[0, 5] = False
    mask[2] = False
    ctx_mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    ctx = torch.where(ctx_mask[..., None], torch.randn(3, 3, DIM), float("nan")).requires_grad_()
    out, inter = model(tokens, mask=mask, context=ctx, context_mask=ctx_mask, return_intermediates=True)
    assert torch.isfinite(out).all() and (out[~mask] == 0).all()
    out.sum().backward()
    assert torch.isfinite(ctx.grad).all() and (ctx.grad[~ctx_mask] == 0).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        alone, ai = model(tokens[:1, mask[0]], context=ctx[:1, :2], return_intermediates=True)
    _close(out[0, mask[0]].detach(), alone[0])
    blocks = ai.memory_tokens.shape[0]  # the sample alone has ceil(7 / 3) = 3 blocks, the padded batch 3 per sample
    _close(inter.memory_tokens[:blocks].detach(), ai.memory_tokens)
    ar = sf.AutoregressiveWrapper(model.eval())
    prompts = [torch.randint(0, VOCAB, (2,)), torch.randint(0, VOCAB, (5,))]
    got = ar.generate(prompts, 4, temperature=0.0)
    for i, p in enumerate(prompts):
        assert torch.equal(got[i], ar.generate(p[None], 4, temperature=0.0)[0])


def test_interspersed_memory_refusals():
    model = sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, num_memory_tokens=2,
                                  memory_tokens_interspersed_every=3,
                                  attn_layers=sf.Decoder(dim=DIM, depth=1, heads=HEADS, dim_head=DIM_HEAD))
    x = torch.zeros(1, 4, dtype=torch.long)
    assert not model.can_cache_kv and static_reason(model)
    with pytest.raises(ValueError, match="KV cache"):
        model(x, return_cache=True)
    with pytest.raises(ValueError, match="prepend_embeds"):
        model(x, prepend_embeds=torch.zeros(1, 2, DIM))
    with pytest.raises(ValueError, match="Decoder"):
        sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=8, num_memory_tokens=2, memory_tokens_interspersed_every=3,
                              attn_layers=sf.Encoder(dim=DIM, depth=1, heads=HEADS))
    with pytest.raises(ValueError, match="num_memory_tokens"):
        sf.TransformerWrapper(num_tokens=VOCAB, max_seq_len=8, memory_tokens_interspersed_every=3,
                              attn_layers=sf.Decoder(dim=DIM, depth=1, heads=HEADS))


def test_embeddings_with_the_x_transformers_cache_protocol():
    """With a ``LayerIntermediates`` cache and the whole sequence as input, whole-sequence ``sum_embeds`` and
    ``embed_ids`` are cut to the new positions like the tokens: the same logits as x-transformers and as the full
    forward (``emb_dim`` projected)."""
    ours, peer = _pair(emb_dim=16, embed_num_tokens=dict(kind=3), layer_opts=dict(rotary_pos_emb=True))
    tokens = torch.randint(0, VOCAB, (2, 7))
    kinds = torch.randint(0, 3, (2, 7))
    extra = torch.randn(2, 7, 16)
    with torch.no_grad():
        full = ours(tokens, embed_ids=dict(kind=kinds), sum_embeds=extra)
        _, gi = ours(tokens[:, :5], embed_ids=dict(kind=kinds[:, :5]), sum_embeds=extra[:, :5], return_intermediates=True)
        _, wi = peer(tokens[:, :5], embed_ids=dict(kind=kinds[:, :5]), sum_embeds=extra[:, :5], return_intermediates=True)
        for t in (5, 6):
            kw = dict(embed_ids=dict(kind=kinds[:, :t + 1]), sum_embeds=extra[:, :t + 1], return_intermediates=True)
            got, gi = ours(tokens[:, :t + 1], cache=gi, **kw)
            want, wi = peer(tokens[:, :t + 1], cache=wi, **kw)
            _close(got[:, -1], want[:, -1])
            _close(got[:, -1], full[:, t])
