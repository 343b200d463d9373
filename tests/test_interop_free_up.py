"""``from_x_transformers`` on x-transformers' ``FreeTransformer`` and ``UniversalPretrainWrapper``: equal losses and
logits on the same (perturbed) weights and the same random draws, in float32; options carried into a config that
rebuilds; refusals of what has no exact counterpart."""

from __future__ import annotations

import pytest
import torch

import safeformer as sf

pytest.importorskip("x_transformers")
xt_free = pytest.importorskip("x_transformers.free_transformer")
xt_up = pytest.importorskip("x_transformers.up_wrapper")
import x_transformers as xt  # noqa: E402
from test_free_transformer import assert_losses_match  # noqa: E402

from safeformer.research.free_transformer import FreeTransformer, free_transformer_from_x_transformers  # noqa: E402
from safeformer.research.universal_pretrain import SyntheticDataGenerator, UniversalPretrainWrapper  # noqa: E402

V, C, H, DH, BITS = 13, 32, 4, 8, 3
ATOL = 1e-5


def perturb(model: torch.nn.Module, seed: int = 5) -> None:
    """Every weight moved off its initial value (norm gains included), the bit logits far from 0 (a KL above 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
        if hasattr(model, "to_latent_bit_logits"):
            model.to_latent_bit_logits.weight.mul_(30)


def unembed_logits(model) -> tuple[list, object]:
    store = []
    return store, model.token_unembed.register_forward_hook(lambda m, i, o: store.append(o))


# ----------------------------------------------------------------------------------------------------
# FreeTransformer
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head,per,kw", [
    (2, True, dict(ff_glu=True, enc_kwargs=dict(attn_kv_heads=2))),
    (0, False, dict(dec_kwargs=dict(ff_mult=2), kl_loss_weight=0.5)),
])
def test_free_transformer_converts_with_equal_losses_and_logits(head, per, kw):
    torch.manual_seed(0)
    theirs = xt_free.FreeTransformer(num_tokens=V, dim=C, heads=H, attn_dim_head=DH, dec_head_depth=head,
                                     dec_tail_depth=2, enc_depth=1, max_seq_len=32, latent_bits=BITS,
                                     per_token_latents=per, pad_id=V, **kw)
    perturb(theirs)
    ours = sf.from_x_transformers(theirs)
    assert isinstance(ours, FreeTransformer) and ours.training
    cfg = ours.get_config()  # x-transformers' RMS norms divide by max(|x|, 1e-12); the stacks' options carried
    assert cfg["enc_kwargs"]["norm_eps"] == cfg["dec_kwargs"]["norm_eps"] == 1e-12
    assert cfg["enc_kwargs"].get("kv_heads") == kw.get("enc_kwargs", {}).get("attn_kv_heads")
    assert ours.pad_id == V and ours.per_token_latents == per and ours.kl_loss_weight == theirs.kl_loss_weight
    seq, lat = torch.randint(0, V, (2, 9)), torch.randint(0, V, (2, 5))
    want_logits, h1 = unembed_logits(theirs)
    got_logits, h2 = unembed_logits(ours)
    assert_losses_match(theirs, ours, seq, lat, ATOL,
                        each=lambda: torch.testing.assert_close(got_logits[-1], want_logits[-1], atol=ATOL, rtol=ATOL))
    h1.remove(), h2.remove()
    # the options are in the config: a rebuilt model with the weights gives the same loss
    rebuilt = FreeTransformer.from_config(ours.get_config())
    rebuilt.load_state_dict(ours.state_dict())
    torch.manual_seed(1)
    again = rebuilt(seq)
    torch.manual_seed(1)
    assert torch.allclose(again, ours(seq), atol=1e-6)
    # sampling: the same draws, the same tokens
    theirs.eval(), ours.eval()
    prompt = torch.randint(0, V, (2, 3))
    torch.manual_seed(2)
    want = theirs.generate(prompt, 8, latents=torch.tensor([1, 6]))
    torch.manual_seed(2)
    assert torch.equal(ours.generate(prompt, 8, latents=torch.tensor([1, 6])), want)


def test_free_transformer_refusals():
    torch.manual_seed(0)
    base = dict(num_tokens=V, dim=C, heads=H, attn_dim_head=DH, dec_head_depth=1, dec_tail_depth=1, max_seq_len=16,
                latent_bits=BITS)
    # hyper-connections in a stack: from_x_transformers' refusal, named with the stack
    theirs = xt_free.FreeTransformer(**base, dec_kwargs=dict(num_residual_streams=2))
    with pytest.raises(ValueError, match=r"FreeTransformer\.decoder_tail") as err:
        sf.from_x_transformers(theirs)
    assert "num_residual_streams=2" in str(err.value)
    # a training-only option: refused unless drop_training_only=True (passed on to the stacks)
    theirs = xt_free.FreeTransformer(**base, layer_dropout=0.1)
    with pytest.raises(ValueError, match="layer_dropout"):
        sf.from_x_transformers(theirs)
    assert isinstance(sf.from_x_transformers(theirs, drop_training_only=True), FreeTransformer)
    # a replaced module with no counterpart
    theirs = xt_free.FreeTransformer(**base)
    theirs.token_unembed = torch.nn.Linear(C, V, bias=True)
    with pytest.raises(ValueError, match="token_unembed"):
        free_transformer_from_x_transformers(theirs)


# ----------------------------------------------------------------------------------------------------
# UniversalPretrainWrapper
# ----------------------------------------------------------------------------------------------------

N = 6


class _Identity(torch.nn.Module):
    """A generator that returns its condition: the buffer stays as it is in both libraries."""

    def generate(self, length, seed=None, condition=None):
        return condition.clone()


def _xt_lm():
    return xt.TransformerWrapper(num_tokens=V, max_seq_len=16,
                                 attn_layers=xt.Decoder(dim=16, depth=1, heads=2, attn_dim_head=8, rotary_pos_emb=True))


def test_universal_pretrain_converts_with_equal_losses():
    torch.manual_seed(0)
    lm = _xt_lm()
    perturb(lm)
    gen = _Identity()
    theirs = xt_up.UniversalPretrainWrapper(lm, data_generator=gen, buffer_size=10, num_reset=0, batch_size=4,
                                            seq_len=N, seed_length=2)
    theirs.step.fill_(3)
    ours = sf.from_x_transformers(theirs)
    assert isinstance(ours, UniversalPretrainWrapper) and ours.data_generator is gen and int(ours.step) == 3
    assert torch.equal(ours.synth_data_buffer, theirs.synth_data_buffer)
    for _ in range(2):
        torch.manual_seed(7)
        want = theirs()
        torch.manual_seed(7)
        got = ours()
        assert torch.allclose(want, got, atol=ATOL, rtol=ATOL), (want.item(), got.item())
    assert int(ours.step) == int(theirs.step) == 5
    x = torch.randint(0, V, (2, N))
    assert torch.allclose(ours.model(x), theirs.model(x), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("use_gru,on_cpu", [(False, False), (True, True)])
def test_universal_pretrain_default_generator_and_buffer(use_gru, on_cpu):
    torch.manual_seed(0)
    lm = _xt_lm()
    theirs = xt_up.UniversalPretrainWrapper(lm, buffer_size=12, num_reset=4, batch_size=3, seq_len=N, seed_length=2,
                                            reset_turing_machine_every=5, keep_buffer_on_cpu=on_cpu)
    if use_gru:
        theirs.data_generator = xt_up.SyntheticDataGenerator(dim=16, num_tokens=V, max_seq_len=N, use_gru=True)
    perturb(theirs.data_generator)
    ours = sf.from_x_transformers(theirs)
    gen = ours.data_generator
    assert isinstance(gen, SyntheticDataGenerator) and isinstance(gen.net, torch.nn.GRU if use_gru else torch.nn.LSTM)
    assert ("synth_data_buffer" in ours.state_dict()) != on_cpu
    assert torch.equal(ours.synth_data_buffer, theirs.synth_data_buffer)
    assert (ours.buffer_size, ours.num_reset, ours.batch_size, ours.seq_len, ours.seed_length,
            ours.reset_turing_machine_every) == (12, 4, 3, N, 2, 5)
    x = torch.randint(0, V, (2, 5))
    assert torch.allclose(gen(x)[0], theirs.data_generator(x)[0], atol=ATOL, rtol=ATOL)
    assert torch.isfinite(ours()).all()


def test_universal_pretrain_refusals():
    torch.manual_seed(0)
    # an odd buffer_size: x-transformers' buffer holds one row less than the indices it draws
    theirs = xt_up.UniversalPretrainWrapper(_xt_lm(), data_generator=_Identity(), buffer_size=9, num_reset=0,
                                            batch_size=4, seq_len=N, seed_length=2)
    with pytest.raises(ValueError, match="buffer_size"):
        sf.from_x_transformers(theirs)
    # hyper-connections in the language model: from_x_transformers' own refusal
    lm = xt.TransformerWrapper(num_tokens=V, max_seq_len=16, attn_layers=xt.Decoder(
        dim=16, depth=1, heads=2, attn_dim_head=8, num_residual_streams=2))
    theirs = xt_up.UniversalPretrainWrapper(lm, data_generator=_Identity(), buffer_size=10, num_reset=0, batch_size=4,
                                            seq_len=N, seed_length=2)
    with pytest.raises(ValueError, match="num_residual_streams"):
        sf.from_x_transformers(theirs)
