"""x-transformers' further wrapper options: ``TransformerWrapper(attn_pool=...)``, ``forward(causal=...)``,
``TransformerWrapper(ff_deep_embed=True)``, ``NonAutoregressiveWrapper``'s ``Losses`` return and
``UniversalPretrainWrapper`` (``x_transformers.up_wrapper``).

Each is compared with x-transformers itself on copied weights (float64) where the option converts, or with a
plain reference, and checked for the safety contract: a padded sample equals the sample alone, ids at padded
positions are never read, an all-padding sample stays finite (exact zeros where the option says so).
"""

from __future__ import annotations

import importlib

import helpers as hp
import pytest
import torch
from helpers import perturb_params

import safeformer as sf

xt = pytest.importorskip("x_transformers")
xx = importlib.import_module("x_transformers.x_transformers")

F64 = torch.float64
NAN = float("nan")


def _perturb(module: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Every parameter moved off its init (ones-initialised tables and zero-initialised projections included)."""
    return perturb_params(module, seed, relative=True)


def _convert_with(theirs, base_kwargs: dict, layers, ours_kwargs: dict) -> sf.TransformerWrapper:
    """``theirs`` (an x-transformers ``TransformerWrapper`` with an option ``from_x_transformers`` does not convert)
    as a safeformer model: the rest converted through an x-transformers model without the option (same weights),
    then the option's own parameters copied by name."""
    base = xt.TransformerWrapper(**base_kwargs, attn_layers=layers)
    base.load_state_dict(theirs.state_dict(), strict=False)
    conv = sf.from_x_transformers(base)
    config = conv.get_config()
    ours = type(conv).from_config({**config, **ours_kwargs}) if hasattr(type(conv), "from_config") else None
    missing, unexpected = ours.load_state_dict(conv.state_dict(), strict=False)
    assert not unexpected
    return ours.to(F64)


def _tokens(b: int, n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (b, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------
# attn_pool
# ---------------------------------------------------------------------------------------------------

def _pool_model(depth: int = 1, causal: bool = False, **kw) -> sf.TransformerWrapper:
    layers = (sf.Decoder if causal else sf.Encoder)(dim=16, depth=2, heads=2, dim_head=8)
    return sf.TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=layers, attn_pool=True,
                                 num_pooled_tokens=3, attn_pool_depth=depth, dim_pooled_tokens=12, **kw)


def test_attn_pool_matches_x_transformers():
    torch.manual_seed(0)
    kw = dict(num_tokens=20, max_seq_len=16)
    theirs = _perturb(xt.TransformerWrapper(**kw, attn_pool=True, num_pooled_tokens=2, dim_pooled_tokens=12,
                                            attn_layers=xt.Encoder(dim=16, depth=2, heads=2, attn_dim_head=8))).double()
    ours = _convert_with(theirs, kw, xt.Encoder(dim=16, depth=2, heads=2, attn_dim_head=8),
                         dict(attn_pool=True, num_pooled_tokens=2, dim_pooled_tokens=12))
    ours.attn_pool.load_state_dict(theirs.attn_pool.state_dict())
    x = _tokens(2, 7, 20)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    want, want_inter = theirs(x, mask=mask, return_intermediates=True)
    got, inter = ours(x, mask=mask, return_intermediates=True)
    assert got.shape == (2, 2, 12)
    hp.assert_close(got, want, "pooled tokens", torch.float32)
    hp.assert_close(inter.attn_pooled_tokens, want_inter.attn_pooled_tokens, "intermediates.attn_pooled_tokens",
                    torch.float32)
    # x-transformers puts the logits on the intermediates (its padded rows are not zeroed: compare real rows)
    hp.assert_close(inter.logits[mask], want_inter.logits[mask], "intermediates.logits", torch.float32)


@pytest.mark.parametrize("depth", [1, 3])
def test_attn_pool_padding_never_pooled(depth):
    torch.manual_seed(0)
    model = _perturb(_pool_model(depth)).double()
    x = _tokens(3, 6, 20)
    mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3, [False] * 6])
    dirty = torch.where(mask, x, torch.full_like(x, 10**6))  # ids at padded positions are never read
    out = model(dirty, mask=mask)
    assert out.shape == (3, 3, 12)
    alone = model(x[1:2, :3])
    hp.assert_close(out[1:2], alone, "padded sample vs alone", torch.float32)
    hp.assert_close(out[0:1], model(x[0:1]), "full sample vs alone", torch.float32)
    hp.assert_finite(out, "pooled tokens")
    if depth == 1:  # a single attention over no key: exactly 0
        hp.assert_zero(out[2], "all-padding sample's pooled tokens")
    else:  # the CrossAttender's queries alone (its cross-attention adds 0)
        q = model.attn_pool.queries.to(F64)[None]
        hp.assert_close(out[2:3], model.attn_pool.pooler(q, context=torch.zeros(1, 6, 16, dtype=F64),
                                                         context_mask=torch.zeros(1, 6, dtype=torch.bool)),
                        "all-padding sample pools to its queries' stack output", torch.float32)
    out.sum().backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            hp.assert_finite(p.grad, f"grad of {name}")


def test_attn_pool_prefix_nan_at_masked_rows_reaches_nothing():
    torch.manual_seed(0)
    model = _perturb(_pool_model()).double()
    x = _tokens(2, 5, 20)
    pre = torch.randn(2, 3, 16, dtype=F64)
    pre_mask = torch.tensor([[True, True, False], [False, False, False]])
    clean = model(x, prepend_embeds=pre, prepend_mask=pre_mask)
    dirty = pre.clone()
    dirty[~pre_mask] = NAN
    dirty.requires_grad_()
    out = model(x, prepend_embeds=dirty, prepend_mask=pre_mask)
    hp.assert_bitwise(out, clean, "NaN at masked prefix rows changes nothing")
    out.sum().backward()
    hp.assert_zero(dirty.grad[~pre_mask], "gradient at masked prefix rows")
    hp.assert_close(out[1:2], model(x[1:2]), "an all-masked prefix is no prefix", torch.float32)


def test_attn_pool_decoder_returns_logits_and_pools_for_intermediates():
    torch.manual_seed(0)
    model = _pool_model(causal=True)
    x = _tokens(2, 6, 20)
    logits = model(x)
    assert logits.shape == (2, 6, 20)
    again, inter = model(x, return_intermediates=True)
    hp.assert_close(again, logits, "logits with and without intermediates (explicit attention)", torch.float32)
    assert inter.attn_pooled_tokens.shape == (2, 3, 12)
    # with a KV cache this call's hidden states are the new positions only: nothing pooled (never a partial pool)
    _, cache = model(x[:, :5], return_cache=True)
    _, inter = model(x[:, 5:], cache=cache, return_intermediates=True)
    assert inter.attn_pooled_tokens is None
    enc = _pool_model()
    _, cache_e = enc(x[:1, :2], return_cache=True)
    with pytest.raises(ValueError, match="attn_pool"):
        enc(x[:1, 2:3], cache=cache_e)


def test_attn_pool_options_checked_and_config_round_trip():
    with pytest.raises(ValueError, match="use_cls_token"):
        _pool_model(use_cls_token=True)
    with pytest.raises(ValueError, match="average_pool_embed"):
        _pool_model(average_pool_embed=True)
    with pytest.raises(ValueError, match="num_pooled_tokens"):
        sf.TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=sf.Encoder(dim=16, depth=1),
                              attn_pool=True, num_pooled_tokens=0)
    model = _pool_model(depth=3)
    again = sf.TransformerWrapper.from_config(model.get_config())
    again.load_state_dict(model.state_dict())
    x = _tokens(1, 4, 20)
    hp.assert_bitwise(again(x), model(x), "rebuilt from its config")
    # return_embeddings wins over the pool, as in x-transformers
    assert model(x, return_embeddings=True).shape == (1, 4, 16)


# ---------------------------------------------------------------------------------------------------
# forward(causal=...)
# ---------------------------------------------------------------------------------------------------

def _pair(seed: int = 0, **kw) -> tuple[sf.TransformerWrapper, sf.TransformerWrapper]:
    torch.manual_seed(seed)
    dec = _perturb(sf.TransformerWrapper(num_tokens=20, max_seq_len=16,
                                         attn_layers=sf.Decoder(dim=16, depth=2, heads=2, dim_head=8, **kw))).double()
    enc = sf.TransformerWrapper(num_tokens=20, max_seq_len=16,
                                attn_layers=sf.Encoder(dim=16, depth=2, heads=2, dim_head=8, **kw)).double()
    enc.load_state_dict(dec.state_dict())
    return dec, enc


@pytest.mark.parametrize("unpadded", ["auto", False])
def test_causal_override_equals_the_other_stack(unpadded):
    dec, enc = _pair(rotary_pos_emb=True, unpadded=unpadded)
    x = _tokens(3, 8, 20)
    mask = torch.tensor([[True] * 8, [True] * 2 + [False] * 6, [False] * 8])
    dirty = torch.where(mask, x, torch.full_like(x, 10**6))
    hp.assert_close(dec(dirty, mask=mask, causal=False), enc(x, mask=mask), "Decoder causal=False vs Encoder",
                    torch.float32)
    hp.assert_close(enc(dirty, mask=mask, causal=True), dec(x, mask=mask), "Encoder causal=True vs Decoder",
                    torch.float32)
    out = dec(dirty, mask=mask, causal=False)
    hp.assert_close(out[1:2, :2], dec(x[1:2, :2], causal=False), "padded sample vs alone", torch.float32)
    hp.assert_zero(out[2], "all-padding sample's logits")
    hp.assert_bitwise(dec(x, causal=True), dec(x), "causal=True on a Decoder is its own causality")


def test_causal_override_matches_x_transformers():
    torch.manual_seed(0)
    theirs = _perturb(xt.TransformerWrapper(num_tokens=20, max_seq_len=16,
                                            attn_layers=xt.Decoder(dim=16, depth=2, heads=2, attn_dim_head=8))).double()
    ours = sf.from_x_transformers(theirs).double()
    x = _tokens(2, 8, 20)
    hp.assert_close(ours(x, causal=False), theirs(x, causal=False), "causal=False", torch.float32)


def test_causal_override_refuses_a_cache_and_carries_none():
    dec, _ = _pair()
    x = _tokens(1, 4, 20)
    _, cache = dec(x[:, :3], return_cache=True)
    with pytest.raises(ValueError, match="causal"):
        dec(x[:, 3:], cache=cache, causal=False)
    with pytest.raises(ValueError, match="causal"):
        dec(x, return_cache=True, causal=False)
    _, inter = dec(x, causal=False, return_intermediates=True)
    assert inter.cache is None  # its keys/values are not what a causal continuation reads
    with pytest.raises(TypeError, match="causal"):
        dec(x, causal="no")


# ---------------------------------------------------------------------------------------------------
# ff_deep_embed
# ---------------------------------------------------------------------------------------------------

def _deep(seed: int = 0, **kw) -> sf.TransformerWrapper:
    torch.manual_seed(seed)
    return _perturb(sf.TransformerWrapper(num_tokens=20, max_seq_len=16, ff_deep_embed=True,
                                          attn_layers=sf.Decoder(dim=16, depth=2, heads=2, dim_head=8), **kw)).double()


def test_ff_deep_embed_matches_x_transformers():
    torch.manual_seed(0)
    kw = dict(num_tokens=20, max_seq_len=16)
    theirs = _perturb(xt.TransformerWrapper(**kw, ff_deep_embed=True, attn_layers=xt.Decoder(
        dim=16, depth=2, heads=2, attn_dim_head=8, rotary_pos_emb=True))).double()
    ours = _convert_with(theirs, kw, xt.Decoder(dim=16, depth=2, heads=2, attn_dim_head=8, rotary_pos_emb=True),
                         dict(ff_deep_embed=True))
    with torch.no_grad():
        ours.ff_deep_embed.copy_(theirs.ff_deep_embed)
    x = _tokens(2, 9, 20)
    hp.assert_close(ours(x), theirs(x), "ff_deep_embed logits", torch.float32)


def test_ff_deep_embed_at_init_is_the_plain_model_and_padding_is_never_read():
    torch.manual_seed(0)
    plain = sf.TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=sf.Decoder(dim=16, depth=2, heads=2,
                                                                                         dim_head=8))
    deep = sf.TransformerWrapper(num_tokens=20, max_seq_len=16, ff_deep_embed=True,
                                 attn_layers=sf.Decoder(dim=16, depth=2, heads=2, dim_head=8))
    deep.load_state_dict(plain.state_dict(), strict=False)
    assert deep.ff_deep_embed.shape == (20, 2, 16)
    x = _tokens(2, 6, 20)
    hp.assert_bitwise(deep(x), plain(x), "a table of ones multiplies by exactly 1")
    model = _deep()
    mask = torch.tensor([[True] * 6, [False, False, True, True, True, False]])
    dirty = torch.where(mask, x, torch.full_like(x, 10**6))
    out = model(dirty, mask=mask)
    hp.assert_close(out[1:2, 2:5], model(x[1:2, 2:5]), "padded sample vs alone", torch.float32)
    out.sum().backward()
    hp.assert_finite(model.ff_deep_embed.grad, "ff_deep_embed's gradient")
    # only the rows of the real tokens are trained
    used = torch.zeros(20, dtype=torch.bool)
    used[x[mask]] = True
    hp.assert_zero(model.ff_deep_embed.grad[~used], "gradient of tokens never seen")


def test_ff_deep_embed_with_memory_tokens_prefix_and_cache():
    model = _deep(num_memory_tokens=2)
    x = _tokens(2, 7, 20)
    pre = torch.randn(2, 2, 16, dtype=F64)
    pre_mask = torch.tensor([[True, False], [True, True]])
    out = model(x, prepend_embeds=pre, prepend_mask=pre_mask)
    kept = torch.cat((out[:1, :1], out[:1, 2:]), dim=1)  # the masked prefix row (exactly 0) left out
    hp.assert_close(kept, model(x[:1], prepend_embeds=pre[:1, :1]), "masked prefix row", torch.float32)
    hp.assert_zero(out[0, 1], "masked prefix row's logits")
    # the KV cache (x-transformers' protocol and safeformer's) equals the full forward
    full = model(x)
    _, cache = model(x[:, :5], return_cache=True)
    step, _ = model(x[:, 5:], cache=cache, return_cache=True)
    hp.assert_close(step, full[:, 5:], "KV cache", torch.float32)
    _, inter = model(x[:, :6], return_intermediates=True)
    last = model(x, cache=inter)
    hp.assert_close(last, full[:, 6:], "LayerIntermediates cache", torch.float32)


def test_ff_deep_embed_generation_runs_the_static_step():
    from safeformer.decoding.static import static_reason

    model = _deep().float().eval()
    assert static_reason(model) is None  # the step scales each feed-forward by the new token's rows
    ar = sf.AutoregressiveWrapper(model)
    prompt = _tokens(2, 3, 20)
    a = ar.generate(prompt, 5, temperature=0.0)
    b = ar.generate(prompt, 5, temperature=0.0, cache_kv=False)
    assert torch.equal(a, b)


def test_stack_takes_deep_embeds_in_both_forms():
    torch.manual_seed(0)
    stack = sf.Encoder(dim=16, depth=2, heads=2, dim_head=8).double()
    table = torch.rand(5, 2, 16, dtype=F64) + 0.5
    ids = torch.randint(0, 5, (2, 4))
    h = torch.randn(2, 4, 16, dtype=F64)
    a = stack(h, ff_deep_embeds=table[ids])
    b = stack(h, deep_embeds_and_ids=(table, ids))
    hp.assert_bitwise(a, b, "deep_embeds_and_ids vs ff_deep_embeds")
    with pytest.raises(ValueError, match="ff_deep_embeds"):
        stack(h, ff_deep_embeds=table[ids][:, :, :1])
    # NaN multipliers at padded rows are read as 1: nothing reaches a real row
    mask = torch.tensor([[True, True, False, False], [True] * 4])
    deep = table[ids].clone()
    deep[~mask] = NAN
    out = stack(h, mask=mask, ff_deep_embeds=deep)
    hp.assert_finite(out, "output")
    hp.assert_close(out[:1, :2], stack(h[:1, :2], ff_deep_embeds=table[ids][:1, :2]), "padded vs alone", torch.float32)


# ---------------------------------------------------------------------------------------------------
# NonAutoregressiveWrapper returns x-transformers' Losses
# ---------------------------------------------------------------------------------------------------

def test_non_autoregressive_forward_returns_losses():
    from safeformer.nonautoregressive_wrapper import Losses

    theirs = importlib.import_module("x_transformers.nonautoregressive_wrapper").Losses
    assert Losses._fields == theirs._fields
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=9, max_seq_len=8, attn_layers=sf.Encoder(dim=16, depth=1, heads=2, dim_head=8))
    for weight in (False, True):
        nar = sf.NonAutoregressiveWrapper(net, mask_id=8, use_simple_mdlm_loss_weight=weight)
        out = nar(_tokens(2, 8, 8), mask=torch.tensor([[True] * 8, [False] * 8]))
        assert isinstance(out, Losses) and out.generator_loss is out.loss and out.critic_loss is None
        out.loss.backward()
        hp.assert_finite(out.loss, "loss")


# ---------------------------------------------------------------------------------------------------
# UniversalPretrainWrapper (x_transformers.up_wrapper)
# ---------------------------------------------------------------------------------------------------

V_UP, N_UP = 11, 6


def _up_model(**kw) -> sf.TransformerWrapper:
    return sf.TransformerWrapper(num_tokens=V_UP, max_seq_len=16, attn_layers=sf.Decoder(dim=16, depth=1, heads=2,
                                                                                         dim_head=8), **kw)


class _ShiftGenerator(torch.nn.Module):
    """A stand-in generator: the condition shifted by one token id; records what it was given."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.resets = 0

    def generate(self, length, seed=None, condition=None):
        self.calls.append((length, seed.clone(), condition.clone()))
        return (condition + 1) % V_UP

    def reset_(self):
        self.resets += 1


def test_universal_pretrain_writes_the_enriched_sequences_back_and_trains_on_the_buffer():
    torch.manual_seed(0)
    model = _up_model()
    gen = _ShiftGenerator()
    up = sf.UniversalPretrainWrapper(model, data_generator=gen, buffer_size=10, num_reset=0, batch_size=4,
                                     seq_len=N_UP, seed_length=2, reset_turing_machine_every=2)
    drawn = []
    original = up.get_rand_sequences_from_buffer
    up.get_rand_sequences_from_buffer = lambda size=None: drawn.append(original(size)) or drawn[-1]
    before = up.synth_data_buffer.clone()
    loss = up()
    (length, seed, cond) = gen.calls[0]
    assert length == N_UP and seed.shape == (4, 2) and cond.shape == (4, N_UP)
    # each seed is a contiguous crop of a buffer sequence
    assert all(any(bool((row.unfold(0, 2, 1) == s).all(1).any()) for row in before) for s in seed)
    # the conditions' rows now hold their continuations; every other row is unchanged
    changed = (up.synth_data_buffer != before).any(1)
    assert int(changed.sum()) <= 4
    for c in cond:
        rows = (before == c).all(1).nonzero()[:, 0]
        assert any(bool((up.synth_data_buffer[r] == (c + 1) % V_UP).all()) for r in rows)
    # the loss is the autoregressive loss of the sequences drawn last
    hp.assert_close(loss, sf.AutoregressiveWrapper(model)(drawn[-1]), "loss", torch.float32)
    loss.backward()
    assert int(up.step) == 1 and gen.resets == 0
    up()
    assert int(up.step) == 2 and gen.resets == 1


def test_universal_pretrain_default_generator_resets_and_buffer_placement():
    torch.manual_seed(0)
    up = sf.UniversalPretrainWrapper(_up_model(), buffer_size=12, num_reset=4, batch_size=3, seq_len=N_UP, seed_length=2)
    assert "synth_data_buffer" in up.state_dict()
    loss = up()
    hp.assert_finite(loss, "loss")
    buf = up.synth_data_buffer
    assert buf.shape == (12, N_UP) and bool(((buf >= 0) & (buf < V_UP)).all())
    on_cpu = sf.UniversalPretrainWrapper(_up_model(), buffer_size=12, num_reset=4, batch_size=3, seq_len=N_UP,
                                         seed_length=2, keep_buffer_on_cpu=True)
    assert "synth_data_buffer" not in on_cpu.state_dict()
    on_cpu().backward()


def test_synthetic_data_generator_matches_x_transformers_and_decodes_greedily():
    up_xt = importlib.import_module("x_transformers.up_wrapper")
    from safeformer.up_wrapper import SyntheticDataGenerator

    torch.manual_seed(0)
    theirs = up_xt.SyntheticDataGenerator(dim=8, num_tokens=V_UP, max_seq_len=7)
    ours = SyntheticDataGenerator(dim=8, num_tokens=V_UP, max_seq_len=7)
    ours.load_state_dict(theirs.state_dict())
    x = _tokens(2, 5, V_UP)
    hp.assert_close(ours(x)[0], theirs(x)[0], "logits", torch.float32)
    seed, cond = _tokens(2, 2, V_UP, 1), _tokens(2, 3, V_UP, 2)
    out = ours.generate(4, seed=seed, condition=cond, temperature=0.0)
    assert out.shape == (2, 7)
    # greedy: each sampled token is the argmax of the full sequence's logits at the position before it
    full = torch.cat((seed, cond, out[:, -4:]), dim=1)
    logits = ours(full[:, :-1])[0]
    assert torch.equal(logits[:, -4:].argmax(-1), out[:, -4:])
    with torch.no_grad():
        ours.to_logits.weight.mul_(1e4)  # near-greedy temperature on huge logits: still a valid id
    out = ours.generate(3, seed=seed, temperature=1e-4)
    assert bool(((out >= 0) & (out < V_UP)).all())
    with pytest.raises(ValueError, match="temperature"):
        ours.generate(2, seed=seed, temperature=-1.0)


def probe_universal_pretrain(seed: int, value: float):
    """``UniversalPretrainWrapper`` has no masked input: its loss is finite and reproducible from the seed, and
    bad arguments (and a generator that returns ids outside the vocabulary) are clear errors."""
    import random

    from doors import Probe

    state = random.getstate()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        random.seed(seed)
        model = _up_model()
        up = sf.UniversalPretrainWrapper(model, buffer_size=8, num_reset=2, batch_size=3, seq_len=N_UP, seed_length=2)
        loss = up()
        random.setstate(state)

    class _Bad(_ShiftGenerator):
        def generate(self, length, seed=None, condition=None):
            return condition + V_UP

    bad = sf.UniversalPretrainWrapper(model, data_generator=_Bad(), buffer_size=8, num_reset=2, batch_size=3,
                                      seq_len=N_UP, seed_length=2)
    kw = dict(seq_len=N_UP, seed_length=2)
    return Probe(loss, {"token_emb": model.token_emb.weight}, bad_calls=[
        ("an encoder", lambda: sf.UniversalPretrainWrapper(sf.TransformerWrapper(
            num_tokens=V_UP, max_seq_len=8, attn_layers=sf.Encoder(dim=8, depth=1)), **kw), ValueError, "causal"),
        ("buffer_size not above batch_size", lambda: sf.UniversalPretrainWrapper(model, buffer_size=3, batch_size=3, **kw),
         ValueError, "buffer_size"),
        ("odd num_reset", lambda: sf.UniversalPretrainWrapper(model, num_reset=3, **kw), ValueError, "num_reset"),
        ("seed_length not below seq_len", lambda: sf.UniversalPretrainWrapper(model, seq_len=4, seed_length=4),
         ValueError, "seed_length"),
        ("seq_len past max_seq_len", lambda: sf.UniversalPretrainWrapper(model, seq_len=40), ValueError, "seq_len"),
        ("a generator's ids outside the vocabulary", lambda: bad(), ValueError, "data_generator"),
        ("not a TransformerWrapper", lambda: sf.UniversalPretrainWrapper(torch.nn.Linear(2, 2)), TypeError, "model"),
    ])


def test_universal_pretrain_door_probe():
    from test_dpo import check_probe

    check_probe(probe_universal_pretrain, has_dead=False)


def test_continuous_wrapper_takes_causal_too():
    torch.manual_seed(0)
    dec = sf.ContinuousTransformerWrapper(dim_in=3, dim_out=3, max_seq_len=8,
                                          attn_layers=sf.Decoder(dim=16, depth=1, heads=2, dim_head=8)).double()
    enc = sf.ContinuousTransformerWrapper(dim_in=3, dim_out=3, max_seq_len=8,
                                          attn_layers=sf.Encoder(dim=16, depth=1, heads=2, dim_head=8)).double()
    enc.load_state_dict(dec.state_dict())
    x = torch.randn(2, 5, 3, dtype=F64)
    mask = torch.tensor([[True] * 5, [True, True, False, False, False]])
    hp.assert_close(dec(x, mask=mask, causal=False), enc(x, mask=mask), "causal=False", torch.float32)


def test_up_wrapper_alias_module_gives_the_same_objects():
    up = importlib.import_module("safeformer.up_wrapper")
    theirs = importlib.import_module("x_transformers.up_wrapper")
    for name in ("UniversalPretrainWrapper", "SyntheticDataGenerator", "random_sequences"):
        assert hasattr(theirs, name)
    assert up.UniversalPretrainWrapper is sf.UniversalPretrainWrapper
    seqs = up.random_sequences(7, 5, 3, 2)
    assert seqs.shape == (5, 5) and bool(((seqs >= 0) & (seqs < 7)).all())
    assert int((seqs == seqs[:, :1]).all(1).sum()) >= 2  # the constant sequences
