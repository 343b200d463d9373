"""The doors of ``XLAutoregressiveWrapper`` (docs/safety.md) beyond tests/test_xl.py: padded memories through
generation (S3, S4: NaN in masked memory slots reaches no token, a padded batch samples what each sample samples
alone), one position and an empty batch (S8: exactly 0 with zero gradients), generation's arguments (S9), test-time
training under ``torch.inference_mode``, options that Transformer-XL memories cannot serve refused by name,
``shift_mem_down`` at depth 3 (the rotation order, by hand and against x-transformers) and left padding over
segments (S4: the loss of a left-padded batch is the samples' losses alone)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_clear_errors, assert_finite, names_argument

import safeformer as sf
from safeformer.decoding.xl import XLAutoregressiveWrapper

V, D = 23, 16
TO_V = "attn_layers.layers.0.1.to_v"


def make_net(seed=0, mem=6, seq=6, depth=2, **kw) -> sf.TransformerWrapper:
    torch.manual_seed(seed)
    return sf.TransformerWrapper(num_tokens=V, max_seq_len=seq, max_mem_len=mem, attn_layers=sf.Decoder(
        dim=D, depth=depth, heads=2, dim_head=8, **kw))


def planted(mems: sf.Mems, keep: torch.Tensor, value: float) -> sf.Mems:
    """``mems`` with ``value`` at every masked slot (``keep`` False), their masks kept."""
    out = sf.Mems(t.masked_fill(~keep[..., None], value) for t in mems)
    out.masks = mems.masks
    return out


# ------------------------------------------------------------------------------------------------------
# padded memories through generation
# ------------------------------------------------------------------------------------------------------


def greedy(xl: XLAutoregressiveWrapper, prompt: torch.Tensor, n: int, mems) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens and the logits each step drew them from, ``(b, n)`` and ``(b, n, v)`` (a callable filter
    applies under greedy decoding: it records them)."""
    seen = []

    def record(logits, **_):
        seen.append(logits.clone())
        return logits

    tokens = xl.generate(prompt, n, mems=mems, temperature=0.0, filter_logits_fn=record)
    return tokens, torch.stack(seen, dim=1)



@pytest.mark.parametrize("plen", [3, 8], ids=["prompt-in-segment", "prompt-past-segment"])
@pytest.mark.parametrize("kw", [dict(rotary_pos_emb=True), dict(alibi_pos_bias=True), dict()],
                         ids=["rotary", "alibi", "abs"])
def test_generate_padded_memories_equal_samples_alone(plen, kw):
    """Memories from a padded forward keep their masks through every generation step (shifted and truncated with
    the memories): NaN, inf or zeros at the padded slots change no token, and each sample's greedy tokens are
    those it generates alone from its unpadded memories, across segment boundaries where the memories are cut to
    ``max_mem_len``."""
    net = make_net(seq=6, mem=6, **kw)
    xl = XLAutoregressiveWrapper(net)
    g = torch.Generator().manual_seed(11)
    x1 = torch.randint(0, V, (4, 6), generator=g)
    keep = torch.ones(4, 6, dtype=torch.bool)
    keep[0, 4:] = False  # right padding
    keep[1, :2] = False  # left padding
    keep[2] = False  # a fully padded segment: no memory
    keep[3, 1:3] = False  # a hole
    prompt = torch.randint(0, V, (4, plen), generator=g)
    with torch.no_grad():
        _, mems = net(x1, mask=keep, return_mems=True)
        alone = []
        for i in range(4):
            real = x1[i][keep[i]][None]
            own = net(real, return_mems=True)[1] if real.shape[1] else None
            alone.append(greedy(xl, prompt[i:i + 1], 13, own))
    tokens, logits = (torch.cat(t) for t in zip(*alone))
    assert torch.equal(mems.masks[0], keep)
    for value in (0.0, float("nan"), float("inf")):
        got, got_logits = greedy(xl, prompt, 13, planted(mems, keep, value))
        assert_finite(got_logits, "logits")
        torch.testing.assert_close(got_logits, logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(got, tokens), f"{value} at padded memory slots changed the tokens"


def test_generate_takes_mem_masks_with_plain_memories():
    """``generate(mems=[...], mem_masks=...)``: a plain list of memories with their masks samples as the same
    memories returned by a padded forward (the masks follow the memories through every step)."""
    net = make_net(seq=6, mem=6, rotary_pos_emb=True)
    xl = XLAutoregressiveWrapper(net)
    g = torch.Generator().manual_seed(12)
    x1, prompt = torch.randint(0, V, (2, 6), generator=g), torch.randint(0, V, (2, 4), generator=g)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, 3:] = False
    with torch.no_grad():
        _, mems = net(x1, mask=keep, return_mems=True)
    want = xl.generate(prompt, 9, mems=mems, temperature=0.0)
    plain = [t.masked_fill(~keep[..., None], float("nan")) for t in mems]
    assert torch.equal(xl.generate(prompt, 9, mems=plain, mem_masks=keep, temperature=0.0), want)
    loss = xl(torch.randint(0, V, (2, 14), generator=g), mems=plain, mem_masks=keep)
    assert_finite(loss, "loss")


# ------------------------------------------------------------------------------------------------------
# one position, an empty batch, an all-padding batch
# ------------------------------------------------------------------------------------------------------


def _xl(ttt: bool) -> XLAutoregressiveWrapper:
    if ttt:
        return XLAutoregressiveWrapper(make_net(), tbptt_steps=2, ttt_module_paths=(TO_V,), ttt_lr=0.1)
    return XLAutoregressiveWrapper(make_net())


def _assert_zero_with_zero_grads(xl: XLAutoregressiveWrapper, loss: torch.Tensor) -> None:
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0
    assert loss.item() == 0.0, f"loss {loss.item()}"
    assert loss.requires_grad, "the loss has no gradient path"
    xl.zero_grad(set_to_none=True)
    loss.backward()
    missing = [n for n, p in xl.named_parameters() if p.grad is None]
    assert not missing, f"no gradient (a missing gradient is not a zero gradient): {missing}"
    nonzero = [n for n, p in xl.named_parameters() if bool(p.grad.any())]
    assert not nonzero, f"nonzero gradient: {nonzero}"


@pytest.mark.parametrize("ttt", [False, True], ids=["xl", "ttt"])
@pytest.mark.parametrize("shape", [(2, 1), (0, 9), (0, 1), (2, 0)])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_one_position_and_empty_batch_give_zero_with_zero_gradients(ttt, shape, masked):
    """A sequence of one position (no next token) or a batch of no sample: the loss is exactly 0, a graph that
    backward runs through, every parameter's gradient zero (none missing), as ``AutoregressiveWrapper`` (S8)."""
    xl = _xl(ttt)
    x = torch.randint(0, V, shape)
    mask = torch.ones(shape, dtype=torch.bool) if masked else None
    _assert_zero_with_zero_grads(xl, xl(x, mask=mask))


@pytest.mark.parametrize("ttt", [False, True], ids=["xl", "ttt"])
def test_all_padding_batch_gives_zero_with_zero_gradients(ttt):
    """Every position padded, NaN-free garbage ids there: exactly 0 with zero gradients, none missing (S8)."""
    xl = _xl(ttt)
    x = torch.full((2, 15), V + 4)
    _assert_zero_with_zero_grads(xl, xl(x, mask=torch.zeros(2, 15, dtype=torch.bool)))


# ------------------------------------------------------------------------------------------------------
# generation's arguments, and the forward's (S9)
# ------------------------------------------------------------------------------------------------------


def test_generate_refuses_bad_arguments_by_name():
    """Each bad argument of ``generate`` is a ValueError or TypeError naming it, before any step (the checks of
    ``AutoregressiveWrapper.generate``), never an error from inside torch or an empty result."""
    xl = XLAutoregressiveWrapper(make_net())
    p = torch.randint(0, V, (2, 3))
    gen = xl.generate

    def nothing_left(logits, **_):
        return torch.full_like(logits, float("-inf"))

    assert_clear_errors([
        ("empty prompt", lambda: gen(torch.zeros(2, 0, dtype=torch.long), 3), ValueError, "start_tokens"),
        ("empty 1-d prompt", lambda: gen(torch.zeros(0, dtype=torch.long), 3), ValueError, "start_tokens"),
        ("float prompt", lambda: gen(p.float(), 3), TypeError, "start_tokens"),
        ("3-d prompt", lambda: gen(p[None], 3), ValueError, "start_tokens"),
        ("list prompt", lambda: gen(p.tolist(), 3), ValueError, "start_tokens"),
        ("negative temperature", lambda: gen(p, 3, temperature=-1.0), ValueError, "temperature"),
        ("NaN temperature", lambda: gen(p, 3, temperature=float("nan")), ValueError, "temperature"),
        ("inf temperature", lambda: gen(p, 3, temperature=float("inf")), ValueError, "temperature"),
        ("eos outside the vocabulary", lambda: gen(p, 3, eos_token=V + 3), ValueError, "eos_token"),
        ("negative eos", lambda: gen(p, 3, eos_token=-1), ValueError, "eos_token"),
        ("float eos", lambda: gen(p, 3, eos_token=1.0), TypeError, "eos_token"),
        ("negative seq_len", lambda: gen(p, -2), ValueError, "seq_len"),
        ("float seq_len", lambda: gen(p, 2.0), ValueError, "seq_len"),
        ("bool seq_len", lambda: gen(p, True), ValueError, "seq_len"),
        ("filter_kwargs without a filter", lambda: gen(p, 3, filter_logits_fn=None, filter_kwargs={"k": 2}),
         ValueError, "filter_kwargs"),
        ("a filter leaving nothing", lambda: gen(p, 3, filter_logits_fn=nothing_left), ValueError, "logits"),
        ("greedy, a filter leaving nothing", lambda: gen(p, 3, temperature=0.0, filter_logits_fn=nothing_left),
         ValueError, "logits"),
        ("mem_masks without mems", lambda: gen(p, 3, mem_masks=torch.ones(2, 3, dtype=torch.bool)), ValueError,
         "mem_masks"),
        ("mems of another batch", lambda: gen(p, 3, mems=[torch.randn(3, 4, D)] * 2), ValueError, "mems"),
    ], where="XLAutoregressiveWrapper.generate: ")


def test_forward_refuses_bad_arguments_by_name():
    """The forward's inputs: a TypeError or ValueError naming ``x``, ``mask``, ``mems`` or ``mem_masks``."""
    xl = XLAutoregressiveWrapper(make_net())
    x = torch.randint(0, V, (2, 9))
    ones = torch.ones(2, 9, dtype=torch.bool)
    assert_clear_errors([
        ("float ids", lambda: xl(x.float()), TypeError, "x"),
        ("1-d ids", lambda: xl(x[0]), ValueError, "x"),
        ("int mask", lambda: xl(x, mask=ones.int()), TypeError, "mask"),
        ("mask of another shape", lambda: xl(x, mask=ones[:, 1:]), ValueError, "mask"),
        ("mem_masks without mems", lambda: xl(x, mem_masks=ones), ValueError, "mem_masks"),
        ("mem_masks of another shape", lambda: xl(x, mems=[torch.randn(2, 4, D)] * 2, mem_masks=ones),
         ValueError, "mem_masks"),
        ("dropout_mems not a bool", lambda: xl(x, dropout_mems=1), TypeError, "dropout_mems"),
    ], where="XLAutoregressiveWrapper.forward: ")
    with pytest.raises(TypeError, match="pad_value"):
        XLAutoregressiveWrapper(make_net(), pad_value=0.5)
    with pytest.raises(TypeError, match="ignore_index"):
        XLAutoregressiveWrapper(make_net(), ignore_index=None)


def test_generate_with_an_empty_batch_or_no_tokens_is_empty():
    """Empty in, empty out: a batch of no sample, or ``seq_len=0``, returns an empty result."""
    xl = XLAutoregressiveWrapper(make_net())
    assert xl.generate(torch.zeros(0, 3, dtype=torch.long), 4).shape == (0, 4)
    assert xl.generate(torch.randint(0, V, (2, 3)), 0).shape == (2, 0)
    assert xl.generate(torch.randint(0, V, (3,)), 0).shape == (0,)


# ------------------------------------------------------------------------------------------------------
# test-time training under inference_mode
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [
    dict(ttt_module_paths=(TO_V,), ttt_lr=0.3),
    dict(ttt_module_paths=(TO_V, "episodic_mems"), episodic_mem_len=3, ttt_lr=0.3),
    dict(ttt_module_paths=(TO_V,), ttt_next_latent_loss=True, ttt_use_muon=True),
], ids=["ttt", "episodic", "latent-muon"])
def test_ttt_under_inference_mode_equals_no_grad(kw):
    """Test-time training takes its gradient steps under ``torch.inference_mode`` too (inputs made there
    included): the loss and the sampled tokens equal those under ``torch.no_grad``."""
    xl = XLAutoregressiveWrapper(make_net(rotary_pos_emb=True), tbptt_steps=2, **kw)
    g = torch.Generator().manual_seed(13)
    x = torch.randint(0, V, (2, 17), generator=g)
    mask = torch.ones(2, 17, dtype=torch.bool)
    mask[1, :4] = False
    keep = torch.rand(2, 5, generator=g) < 0.6
    raw = [torch.randn(2, 5, D, generator=g) for _ in range(2)]
    mems = sf.Mems(raw)
    mems.masks = [keep, keep]
    with torch.no_grad():
        want_loss = xl(x, mask=mask, mems=mems)
        want_tokens = xl.generate(x[:, :8], 9, temperature=0.0, mems=mems)
    with torch.inference_mode():
        x_i, mask_i, keep_i = x.clone(), mask.clone(), keep.clone()
        mems_i = sf.Mems(t.clone() for t in raw)
        mems_i.masks = [keep_i, keep_i]
        got_loss = xl(x_i, mask=mask_i, mems=mems_i)
        got_tokens = xl.generate(x_i[:, :8], 9, temperature=0.0, mems=mems_i)
    assert torch.equal(got_loss, want_loss.detach())
    assert torch.equal(got_tokens, want_tokens)


# ------------------------------------------------------------------------------------------------------
# options memories cannot serve
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["attn_data_dependent_alibi", "attn_orthog_projected_values"])
def test_options_over_the_whole_sequence_are_refused_with_memories_by_name(option):
    """Forget gates and projected values are defined over the whole sequence, so no memory can continue them:
    the wrapper (which runs every segment with ``mems`` / ``return_mems``) refuses them when built, naming
    ``mems`` and the option, instead of running the first segment and failing at the second."""
    with pytest.raises(ValueError) as info:
        XLAutoregressiveWrapper(make_net(**{option: True}))
    msg = str(info.value)
    assert names_argument(msg, "mems") and names_argument(msg, option), msg


# ------------------------------------------------------------------------------------------------------
# shift_mem_down at depth 3
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shift", [1, 2])
def test_shift_mem_down_rotates_left_by_hand(shift):
    """``shift_mem_down=k`` at depth 3: the memories ``[a, b, c]`` are read as ``[a, b, c][k:] + [a, b, c][:k]``
    (x-transformers' rotation), the output and the new memories those of a net without the shift given the
    rotated list."""
    net = make_net(depth=3, rotary_pos_emb=True).eval()
    g = torch.Generator().manual_seed(14)
    x = torch.randint(0, V, (2, 5), generator=g)
    mems = [torch.randn(2, 4, D, generator=g) for _ in range(3)]
    rotated = [*mems[shift:], *mems[:shift]]
    with torch.no_grad():
        net.shift_mem_down = shift
        out, new = net(x, mems=mems, return_mems=True)
        net.shift_mem_down = 0
        want, want_new = net(x, mems=rotated, return_mems=True)
        wrong = net(x, mems=[*mems[-shift:], *mems[:-shift]])
    assert torch.equal(out, want)
    assert all(torch.equal(a, b) for a, b in zip(new, want_new))
    assert not torch.allclose(out, wrong)  # the other direction is another model


@pytest.mark.parametrize("shift", [1, 2])
def test_shift_mem_down_at_depth_3_matches_x_transformers(shift):
    """At depth 3 (where rotating left and right differ) the XL loss and greedy sampling across segment boundaries
    (the memories rotated at every step) equal x-transformers' on the same weights."""
    xt = pytest.importorskip("x_transformers")
    from x_transformers.xl_autoregressive_wrapper import XLAutoregressiveWrapper as XtXL

    from safeformer.interop import from_x_transformers

    torch.manual_seed(0)
    m = xt.TransformerWrapper(num_tokens=V, max_seq_len=6, attn_layers=xt.Decoder(
        dim=D, depth=3, heads=2, attn_dim_head=8, rotary_pos_emb=True))
    s = from_x_transformers(m)
    m.max_mem_len = s.max_mem_len = 6
    m.shift_mem_down = s.shift_mem_down = shift
    xw, sw = XtXL(m).eval(), XLAutoregressiveWrapper(s).eval()
    x = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        torch.testing.assert_close(sw(x), xw(x), atol=1e-5, rtol=1e-5)
        for plen in (3, 5, 8, 13):
            assert torch.equal(sw.generate(x[:, :plen], 12, temperature=0.0),
                               xw.generate(x[:, :plen], 12, temperature=0.0)), plen


# ------------------------------------------------------------------------------------------------------
# left padding over segments
# ------------------------------------------------------------------------------------------------------


def _alone_loss(wrapper: XLAutoregressiveWrapper, tokens: torch.Tensor, start: int, seg: int) -> torch.Tensor:
    """One sample's XL loss computed alone, by hand: its real tokens ``tokens[start:]`` over the batch's segments
    (inputs ``0 .. n - 2`` in pieces of ``seg``), each segment's real part run with the memories of the earlier
    real parts, its mean cross-entropy weighted by the segment's share of the batch's positions, the fast weights
    stepped after every segment but the last that held a real label."""
    net, n = wrapper.net, tokens.shape[0] - 1
    if wrapper.has_ttt:
        wrapper.init_ttt(1)
    starts = list(range(0, n, seg))
    mems, total = None, torch.zeros(())
    for k, s in enumerate(starts):
        stop, lo = min(s + seg, n), max(s, start)
        if lo < stop:
            chunk, labels = tokens[None, lo:stop], tokens[None, lo + 1:stop + 1]
            logits, inter = net(chunk, mems=mems, return_mems=True, return_intermediates=True)
            total = total + F.cross_entropy(logits[0], labels[0]) * (stop - s) / n
            mems = inter.mems
            if wrapper.has_ttt and k < len(starts) - 1:
                wrapper.update_ttt(logits, labels)
    return total


@pytest.mark.parametrize("ttt", [False, True], ids=["xl", "ttt"])
def test_left_padded_loss_equals_samples_alone(ttt):
    """Left padding over segments (within the first segment, past it, none): no label is predicted from a padded
    position, a fully padded segment steps no fast weight, and the batch's loss is the mean of each sample's loss
    alone (S4), with garbage ids at the padding."""
    kw = dict(tbptt_steps=2, ttt_module_paths=(TO_V,), ttt_lr=0.3, ttt_wd=0.5) if ttt else {}
    wrapper = XLAutoregressiveWrapper(make_net(seq=6, mem=6, rotary_pos_emb=True), **kw).eval()
    g = torch.Generator().manual_seed(16)
    x = torch.randint(0, V, (3, 17), generator=g)
    starts = (4, 8, 0)
    mask = torch.arange(17)[None] >= torch.tensor(starts)[:, None]
    got = wrapper(torch.where(mask, x, V + 5), mask=mask)
    want = torch.stack([_alone_loss(wrapper, x[i], s, 6) for i, s in enumerate(starts)]).mean()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("option", ["attn_orthog_projected_values", "attn_data_dependent_alibi"])
def test_bare_wrapper_refuses_return_mems_with_sequence_wide_options(option):
    """``TransformerWrapper(max_mem_len=...)`` with an option computed over the whole sequence refuses
    ``return_mems=True`` up front, naming the memories and the option (not a KV-cache error one segment later)."""
    net = sf.TransformerWrapper(num_tokens=10, max_seq_len=8, max_mem_len=4,
                                attn_layers=sf.Decoder(dim=16, depth=1, heads=2, **{option: True}))
    with pytest.raises(ValueError, match=rf"mems.*{option}"):
        net(torch.randint(0, 10, (1, 4)), return_mems=True)
