"""x-transformers' README examples, run with the import changed to safeformer.

Source: the README of the installed x-transformers 2.31.10 (its PyPI long description, in
``x_transformers-2.31.10.dist-info/METADATA``; the same 58 python blocks as
github.com/lucidrains/x-transformers ``README.md``). Each ``test_<example>`` is one README example that
uses only features safeformer supports: the example's code with ``from x_transformers import ...``
changed to ``from safeformer import ...`` and x-transformers' argument values kept, except

- sizes too slow for a 2-core CPU, shrunk and marked ``# README: <value>`` where they are (model width
  512 -> 64, depth 6 / 12 -> 2, except where an argument needs the depth (``sandwich_coef = 6``, a
  12-entry ``shift_tokens``); the GPT-3 block's 12288 / 96 / 96 -> 64 / 2 / 4; the XL wrapper's 4096
  tokens -> 1024 and its 4096 generated -> 16);
- ``.cuda()`` dropped;
- a forward pass added where the README only builds the model (marked ``# added``), so that there is
  an output to check.

Each test asserts the shape the README's comment shows (or the natural one where it shows none) and
that every output is finite.

``test_<example>_parity``: the same example built with x-transformers (same arguments), with every
weight moved off its initial value, converted with ``safeformer.from_x_transformers``, both in eval
mode, float32, the same inputs for both (the README's call, on ``N_PARITY`` positions instead of its
1024; for an encoder a right-padded batch too, compared at the real positions): the outputs agree to
rtol = atol = 1e-5. A bare layer stack (``Encoder``, ``CrossAttender``), a
``ContinuousTransformerWrapper`` or a ``ViTransformerWrapper`` is converted through a token-model shell
(``_convert_layers``), the rest copied by hand (``_convert_vit``). Deviations, each said in its test:
``test_alibi_num_heads_parity`` builds x-transformers' model with ``use_abs_pos_emb=False`` (safeformer
drops the absolute position embedding under ALiBi, and ``from_x_transformers`` refuses the README's
model); ``test_transformer_xl_recurrence_parity`` feeds both models x-transformers' memories and compares the
memories each returns. No twin for
``XLAutoregressiveWrapper`` (``from_x_transformers`` takes none: "TypeError: model must be an
x_transformers.TransformerWrapper, AutoregressiveWrapper, XTransformer, ContinuousTransformerWrapper,
ContinuousAutoregressiveWrapper or a layer stack, got XLAutoregressiveWrapper")
nor for ``AutoregressiveWrapper(mask_prob=)`` (refused: the hidden keys are drawn at random, differently).

README example NOT covered: ``resi_dual`` (+ ``resi_dual_scale``), which x-transformers 2.31.10 itself refuses
("AssertionError: unrecognized kwargs passed in dict_keys(['resi_dual'])"); safeformer: "unexpected keyword
argument".
"""

# the README's import lines are kept as written (unsorted)
# ruff: noqa: I001

from __future__ import annotations

import logging

import pytest
import torch

xt = pytest.importorskip("x_transformers")

import safeformer  # noqa: E402

logging.getLogger("x_transformers").setLevel(logging.ERROR)
try:  # x-transformers logs through loguru
    from loguru import logger as _loguru

    _loguru.disable("x_transformers")
except ImportError:  # pragma: no cover
    pass


# the parity tests run the README's calls on shorter sequences than its 1024 (x-transformers' forward at
# 1024 positions and 20000 logits costs ~1 s a call on one CPU thread); max_seq_len stays the README's
N_PARITY = 256


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------


def _finite(*tensors) -> None:
    for t in tensors:
        assert torch.isfinite(t).all(), "non-finite output"


def _grads_finite(model) -> None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads, "no parameter received a gradient"
    assert all(torch.isfinite(g).all() for g in grads), "non-finite gradient"


@torch.no_grad()
def _perturb(xt_model) -> None:
    """Move every x-transformers weight off its init (norm gains 0, biases 0 would hide mistakes)."""
    g = torch.Generator().manual_seed(1)
    for p in xt_model.parameters():
        p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _convert(xt_model, what: str | None = None, **kwargs):
    """``from_x_transformers`` in eval mode; with ``what``, a conversion still being added: skip if it raises."""
    _perturb(xt_model)
    xt_model.eval()
    if what is None:
        return safeformer.from_x_transformers(xt_model, **kwargs).eval()
    try:
        return safeformer.from_x_transformers(xt_model, **kwargs).eval()
    except (TypeError, ValueError, NotImplementedError) as err:
        pytest.skip(f"from_x_transformers cannot convert {what} yet: {type(err).__name__}: {err}")


def _convert_layers(xt_layers):
    """A bare x-transformers ``Encoder`` / ``Decoder`` / ``CrossAttender`` converted: through a
    ``TransformerWrapper`` shell without positions (``max_seq_len=0``), keeping its ``attn_layers``."""
    shell = xt.TransformerWrapper(num_tokens=2, max_seq_len=0, attn_layers=xt_layers)
    return _convert(shell).attn_layers


def _convert_vit(xt_vit):
    """An x-transformers ``ViTransformerWrapper`` by hand (``from_x_transformers`` takes token models): its
    ``Encoder`` through ``_convert_layers`` (moved off its init there), the rest moved off its init and
    copied; x-transformers' bias-free ``LayerNorm`` gains become safeformer's weights, biases 0."""
    sf_layers = _convert_layers(xt_vit.attn_layers)
    rest = [m for name, m in xt_vit.named_children() if name != "attn_layers"]
    for m in rest:
        _perturb(m)
    with torch.no_grad():
        xt_vit.pos_embedding.add_(torch.randn(xt_vit.pos_embedding.shape, generator=torch.Generator().manual_seed(2)) * 0.05)
    xt_vit.eval()
    image_size = int(xt_vit.pos_embedding.shape[1] ** 0.5) * xt_vit.patch_size
    num_classes = xt_vit.mlp_head.out_features if isinstance(xt_vit.mlp_head, torch.nn.Linear) else None
    sf_vit = safeformer.ViTransformerWrapper(
        image_size=image_size, patch_size=xt_vit.patch_size, attn_layers=sf_layers, num_classes=num_classes
    ).eval()
    with torch.no_grad():
        sf_vit.pos_embedding.copy_(xt_vit.pos_embedding)
        for i in (0, 2):
            sf_vit.patch_to_embedding[i].gamma.copy_(xt_vit.patch_to_embedding[i].gamma)  # x-transformers' LayerNorm
        sf_vit.patch_to_embedding[1].load_state_dict(xt_vit.patch_to_embedding[1].state_dict())
        if num_classes is not None:
            sf_vit.mlp_head.load_state_dict(xt_vit.mlp_head.state_dict())
    return sf_vit


def _token_parity(name: str, xt_model, padded: bool = False, **convert_kwargs) -> None:
    """A README token model (``TransformerWrapper``): converted, run on ``N_PARITY`` tokens; with
    ``padded`` (encoders) also on a right-padded batch of two, compared at the real positions."""
    sf_model = _convert(xt_model, **convert_kwargs)
    num_tokens = xt_model.num_tokens
    x = torch.randint(0, num_tokens, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity(name, xt_model(x), sf_model(x))
        if padded:
            x2 = torch.randint(0, num_tokens, (2, N_PARITY))
            mask2 = torch.ones_like(x2).bool()
            mask2[1, N_PARITY // 2:] = False
            real = mask2[..., None].expand(-1, -1, num_tokens)
            _assert_parity(f"{name}, right padding", xt_model(x2, mask=mask2)[real], sf_model(x2, mask=mask2)[real])


def _assert_parity(name: str, expected, actual) -> None:
    diff = (expected - actual).abs().max().item()
    print(f"parity {name}: max abs diff {diff:.3g}")
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# Usage
# ----------------------------------------------------------------------------------------------------


def test_full_encoder_decoder():
    """README "Usage": Full encoder / decoder."""
    import torch
    from safeformer import XTransformer

    model = XTransformer(
        dim = 64,               # README: 512
        enc_num_tokens = 256,
        enc_depth = 2,          # README: 6
        enc_heads = 8,
        enc_max_seq_len = 1024,
        dec_num_tokens = 256,
        dec_depth = 2,          # README: 6
        dec_heads = 8,
        dec_max_seq_len = 1024,
        tie_token_emb = True      # tie embeddings of encoder and decoder
    )

    src = torch.randint(0, 256, (1, 1024))
    src_mask = torch.ones_like(src).bool()
    tgt = torch.randint(0, 256, (1, 1024))

    loss = model(src, tgt, mask = src_mask) # (1, 1024, 512)
    loss.backward()

    assert loss.shape == ()  # the README's "(1, 1024, 512)" comment is wrong in x-transformers too: a scalar loss
    _finite(loss)
    _grads_finite(model)


def test_full_encoder_decoder_parity():
    xt_model = xt.XTransformer(
        dim=64, enc_num_tokens=256, enc_depth=2, enc_heads=8, enc_max_seq_len=1024,
        dec_num_tokens=256, dec_depth=2, dec_heads=8, dec_max_seq_len=1024, tie_token_emb=True,
    )
    sf_model = _convert(xt_model, "an x_transformers.XTransformer")
    src = torch.randint(0, 256, (1, N_PARITY))
    src_mask = torch.ones_like(src).bool()
    tgt = torch.randint(0, 256, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("full encoder / decoder (loss)", xt_model(src, tgt, mask=src_mask), sf_model(src, tgt, mask=src_mask))
        # a scalar can hide differences: the encoder's output and the decoder's logits too
        xt_enc = xt_model.encoder(src, mask=src_mask, return_embeddings=True)
        _assert_parity("full encoder / decoder (encoder output)", xt_enc, sf_model.encode(src, src_mask))
        _assert_parity(
            "full encoder / decoder (decoder logits)",
            xt_model.decoder.net(tgt, context=xt_enc, context_mask=src_mask),
            sf_model.decoder.net(tgt, context=xt_enc, context_mask=src_mask),
        )


def test_decoder_only_gpt_like():
    """README "Usage": Decoder-only (GPT-like)."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 12
            heads = 8
        )
    )                       # README: .cuda()

    x = torch.randint(0, 256, (1, 1024))

    out = model(x) # (1, 1024, 20000)

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_decoder_only_gpt_like_parity():
    xt_model = xt.TransformerWrapper(num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8))
    sf_model = _convert(xt_model)
    x = torch.randint(0, 256, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("decoder-only (GPT-like)", xt_model(x), sf_model(x))


def test_gpt3():
    """README "Usage": GPT3 would be approximately the following (every size shrunk; attn_dim_head kept)."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    gpt3 = TransformerWrapper(
        num_tokens = 50000,
        max_seq_len = 2048,
        attn_layers = Decoder(
            dim = 64,           # README: 12288
            depth = 2,          # README: 96
            heads = 4,          # README: 96
            attn_dim_head = 128
        )
    )                           # README: .cuda()

    x = torch.randint(0, 50000, (1, 256))   # added
    out = gpt3(x)                           # added

    assert out.shape == (1, 256, 50000)
    _finite(out)


def test_gpt3_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=50000, max_seq_len=2048, attn_layers=xt.Decoder(dim=64, depth=2, heads=4, attn_dim_head=128)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 50000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("GPT3 (attn_dim_head=128)", xt_model(x), sf_model(x))


def test_encoder_only_bert_like():
    """README "Usage": Encoder-only (BERT-like)."""
    import torch
    from safeformer import TransformerWrapper, Encoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Encoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 12
            heads = 8
        )
    )                       # README: .cuda()

    x = torch.randint(0, 256, (1, 1024))
    mask = torch.ones_like(x).bool()

    out = model(x, mask = mask) # (1, 1024, 20000)

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_encoder_only_bert_like_parity():
    xt_model = xt.TransformerWrapper(num_tokens=20000, max_seq_len=1024, attn_layers=xt.Encoder(dim=64, depth=2, heads=8))
    sf_model = _convert(xt_model)
    x = torch.randint(0, 256, (1, N_PARITY))
    mask = torch.ones_like(x).bool()
    with torch.no_grad():
        _assert_parity("encoder-only (BERT-like)", xt_model(x, mask=mask), sf_model(x, mask=mask))
        # and a right-padded batch: equal at every real position
        x2 = torch.randint(0, 256, (2, N_PARITY))
        mask2 = torch.ones_like(x2).bool()
        mask2[1, N_PARITY // 2:] = False
        real = mask2[..., None].expand(-1, -1, 20000)
        _assert_parity("encoder-only (BERT-like), right padding",
                       xt_model(x2, mask=mask2)[real], sf_model(x2, mask=mask2)[real])


def test_simple_vit():
    """README "Usage": SimpleViT (an image classifier)."""
    import torch
    from safeformer import ViTransformerWrapper, Encoder

    model = ViTransformerWrapper(
        image_size = 256,
        patch_size = 32,
        num_classes = 1000,
        attn_layers = Encoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
        )
    )

    img = torch.randn(1, 3, 256, 256)
    out = model(img) # (1, 1000)

    assert out.shape == (1, 1000)
    _finite(out)


def test_simple_vit_parity():
    xt_model = xt.ViTransformerWrapper(
        image_size=256, patch_size=32, num_classes=1000, attn_layers=xt.Encoder(dim=64, depth=2, heads=8)
    )
    sf_model = _convert_vit(xt_model)
    img = torch.randn(2, 3, 256, 256)
    with torch.no_grad():
        _assert_parity("SimpleViT (logits)", xt_model(img), sf_model(img))
        _assert_parity("SimpleViT (embeddings)", xt_model(img, return_embeddings=True), sf_model(img, return_embeddings=True))


def test_image_to_caption():
    """README "Usage": Image -> caption."""
    import torch
    from safeformer import ViTransformerWrapper, TransformerWrapper, Encoder, Decoder

    encoder = ViTransformerWrapper(
        image_size = 256,
        patch_size = 32,
        attn_layers = Encoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8
        )
    )

    decoder = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            cross_attend = True
        )
    )

    img = torch.randn(1, 3, 256, 256)
    caption = torch.randint(0, 20000, (1, 1024))

    encoded = encoder(img, return_embeddings = True)
    out = decoder(caption, context = encoded) # (1, 1024, 20000)

    assert encoded.shape == (1, 64, 64)
    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_image_to_caption_parity():
    xt_encoder = xt.ViTransformerWrapper(image_size=256, patch_size=32, attn_layers=xt.Encoder(dim=64, depth=2, heads=8))
    xt_decoder = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, cross_attend=True)
    )
    sf_encoder, sf_decoder = _convert_vit(xt_encoder), _convert(xt_decoder)
    img = torch.randn(1, 3, 256, 256)
    caption = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        xt_encoded = xt_encoder(img, return_embeddings=True)
        _assert_parity("image -> caption encoder", xt_encoded, sf_encoder(img, return_embeddings=True))
        _assert_parity("image -> caption decoder", xt_decoder(caption, context=xt_encoded), sf_decoder(caption, context=xt_encoded))


def test_pali():
    """README "Usage": PaLI (a ViT's embeddings prepended to an XTransformer's encoder)."""
    import torch
    from safeformer import ViTransformerWrapper, XTransformer, Encoder

    # PaLI composes of
    # 1. vision transformer (ViTransformerWrapper) +
    # 2. encoder-decoder transformer (XTransformer)

    vit = ViTransformerWrapper(
        image_size = 256,
        patch_size = 32,
        attn_layers = Encoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8
        )
    )

    pali = XTransformer(
        dim = 64,               # README: 512
        enc_num_tokens = 256,
        enc_depth = 2,          # README: 6
        enc_heads = 8,
        enc_max_seq_len = 1024,
        dec_num_tokens = 256,
        dec_depth = 2,          # README: 6
        dec_heads = 8,
        dec_max_seq_len = 1024
    )

    # training data

    img = torch.randn(1, 3, 256, 256)               # images
    prompt = torch.randint(0, 256, (1, 1024))       # prompt
    prompt_mask = torch.ones(1, 1024).bool()        # prompt text mask
    output_text = torch.randint(0, 256, (1, 1024))  # target output text

    # train

    img_embeds = vit(
        img,
        return_embeddings = True
    )

    loss = pali(
        prompt,
        output_text,
        mask = prompt_mask,
        src_prepend_embeds = img_embeds             # will preprend image embeddings to encoder text embeddings before attention
    )

    loss.backward()

    assert loss.shape == ()
    _finite(loss)
    _grads_finite(pali)
    _grads_finite(vit)


def test_pali_parity():
    xt_vit = xt.ViTransformerWrapper(image_size=256, patch_size=32, attn_layers=xt.Encoder(dim=64, depth=2, heads=8))
    xt_pali = xt.XTransformer(
        dim=64, enc_num_tokens=256, enc_depth=2, enc_heads=8, enc_max_seq_len=1024,
        dec_num_tokens=256, dec_depth=2, dec_heads=8, dec_max_seq_len=1024,
    )
    sf_vit, sf_pali = _convert_vit(xt_vit), _convert(xt_pali, "an x_transformers.XTransformer")
    img = torch.randn(1, 3, 256, 256)
    prompt = torch.randint(0, 256, (1, N_PARITY))
    prompt_mask = torch.ones(1, N_PARITY).bool()
    output_text = torch.randint(0, 256, (1, N_PARITY))
    with torch.no_grad():
        img_embeds = xt_vit(img, return_embeddings=True)
        _assert_parity("PaLI ViT", img_embeds, sf_vit(img, return_embeddings=True))
        _assert_parity(
            "PaLI loss",
            xt_pali(prompt, output_text, mask=prompt_mask, src_prepend_embeds=img_embeds),
            sf_pali(prompt, output_text, mask=prompt_mask, src_prepend_embeds=img_embeds),
        )


# ----------------------------------------------------------------------------------------------------
# Dropouts
# ----------------------------------------------------------------------------------------------------


def test_dropouts():
    """README "Dropouts"."""
    import torch
    from safeformer import TransformerWrapper, Decoder, Encoder  # noqa: F401

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        emb_dropout = 0.1,         # dropout after embedding
        attn_layers = Decoder(
            dim = 64,              # README: 512
            depth = 2,             # README: 6
            heads = 8,
            layer_dropout = 0.1,   # stochastic depth - dropout entire layer
            attn_dropout = 0.1,    # dropout post-attention
            ff_dropout = 0.1       # feedforward dropout
        )
    )

    x = torch.randint(0, 20000, (1, 1024))
    out = model(x)

    assert model.training
    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_dropouts_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, emb_dropout=0.1,
        attn_layers=xt.Decoder(dim=64, depth=2, heads=8, layer_dropout=0.1, attn_dropout=0.1, ff_dropout=0.1),
    )
    # layer_dropout acts in training only: dropped on conversion; eval outputs are the same
    sf_model = _convert(xt_model, drop_training_only=True)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("dropouts (eval)", xt_model(x), sf_model(x))


# ----------------------------------------------------------------------------------------------------
# Features
# ----------------------------------------------------------------------------------------------------


def test_flash_attention():
    """README "Flash Attention"."""
    import torch
    from safeformer import TransformerWrapper, Decoder, Encoder  # noqa: F401

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            attn_flash = True # just set this to True if you have pytorch 2.0 installed
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_flash_attention_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, attn_flash=True)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("flash attention", xt_model(x), sf_model(x))


def test_persistent_memory():
    """README "Augmenting Self-attention with Persistent Memory"."""
    from safeformer import Decoder, Encoder  # noqa: F401

    enc = Encoder(
        dim = 64,       # README: 512
        depth = 2,      # README: 6
        heads = 8,
        attn_num_mem_kv = 16 # 16 memory key / values
    )

    x = torch.randn(1, 1024, 64)            # added
    mask = torch.ones(1, 1024).bool()       # added
    out = enc(x, mask = mask)               # added

    assert out.shape == (1, 1024, 64)
    _finite(out)


def test_persistent_memory_parity():
    xt_enc = xt.Encoder(dim=64, depth=2, heads=8, attn_num_mem_kv=16)
    sf_enc = _convert_layers(xt_enc)
    x = torch.randn(1, N_PARITY, 64)
    mask = torch.ones(1, N_PARITY).bool()
    with torch.no_grad():
        _assert_parity("persistent memory (attn_num_mem_kv)", xt_enc(x, mask=mask), sf_enc(x, mask=mask))


def test_memory_transformers():
    """README "Memory Transformers"."""
    import torch
    from safeformer import TransformerWrapper, Decoder, Encoder  # noqa: F401

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        num_memory_tokens = 20, # 20 memory tokens
        attn_layers = Encoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)  # the memory tokens are cut from the output
    _finite(out)


def test_memory_transformers_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, num_memory_tokens=20, attn_layers=xt.Encoder(dim=64, depth=2, heads=8)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("memory tokens", xt_model(x), sf_model(x))


def test_l2norm_embed():
    """README "Transformers Without Tears": l2 normalized embeddings."""
    import torch
    from safeformer import TransformerWrapper, Decoder, Encoder  # noqa: F401

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        l2norm_embed = True,    # set this to True for l2 normalized embedding + small init
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_l2norm_embed_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, l2norm_embed=True, attn_layers=xt.Decoder(dim=64, depth=2, heads=8)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("l2norm_embed", xt_model(x), sf_model(x))


def test_rmsnorm():
    """README "Root Mean Square Layer Normalization"."""
    import torch
    from safeformer import TransformerWrapper, Decoder, Encoder  # noqa: F401

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            use_rmsnorm = True # set to true to use for all layers
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_rmsnorm_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, use_rmsnorm=True)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("use_rmsnorm", xt_model(x), sf_model(x))


def test_ff_glu():
    """README "GLU Variants Improve Transformer": ff_glu."""
    import torch
    from safeformer import TransformerWrapper, Decoder, Encoder  # noqa: F401

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            ff_glu = True # set to true to use for all feedforwards
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_ff_glu_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, ff_glu=True)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("ff_glu", xt_model(x), sf_model(x))


def test_ff_swish_glu():
    """README "GLU Variants Improve Transformer": the PaLM Swish GLU variant."""
    import torch
    from safeformer import TransformerWrapper, Decoder, Encoder  # noqa: F401

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            ff_swish = True, # set this to True
            ff_glu = True    # set to true to use for all feedforwards
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_ff_swish_glu_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, ff_swish=True, ff_glu=True)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("ff_swish + ff_glu", xt_model(x), sf_model(x))


def test_one_kv_head():
    """README "One Write-Head Is All You Need": attn_one_kv_head."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            attn_one_kv_head = True
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_one_kv_head_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, attn_one_kv_head=True)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("attn_one_kv_head", xt_model(x), sf_model(x))


def test_grouped_kv_heads():
    """README "One Write-Head Is All You Need": attn_kv_heads (grouped-query attention)."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 12
            heads = 8,
            attn_kv_heads = 2 # say you want 4 query heads to attend to 1 key / value head
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_grouped_kv_heads_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, attn_kv_heads=2)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("attn_kv_heads=2", xt_model(x), sf_model(x))


def test_attn_gate_values():
    """README "Intra-attention Gating on Values": attn_gate_values."""
    import torch
    from safeformer import TransformerWrapper, Encoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Encoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            attn_gate_values = True  # gate aggregated values with the input
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    mask = torch.ones_like(x).bool()        # added
    out = model(x, mask = mask)             # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_attn_gate_values_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Encoder(dim=64, depth=2, heads=8, attn_gate_values=True)
    )
    _token_parity("attn_gate_values", xt_model, padded=True)


def test_sandwich_coef():
    """README "Improving Transformer Models by Reordering their Sublayers": sandwich_coef (depth 6 kept:
    the coefficient must not exceed the depth)."""
    import torch
    from safeformer import TransformerWrapper, Encoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Encoder(
            dim = 64,       # README: 512
            depth = 6,
            heads = 8,
            sandwich_coef = 6  # interleave attention and feedforwards with sandwich coefficient of 6
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    mask = torch.ones_like(x).bool()        # added
    out = model(x, mask = mask)             # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_sandwich_coef_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Encoder(dim=64, depth=6, heads=8, sandwich_coef=6)
    )
    _token_parity("sandwich_coef=6", xt_model, padded=True)


def test_weight_tie_layers():
    """README "Weight-tied Layers": weight_tie_layers."""
    import torch
    from safeformer import TransformerWrapper, Encoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Encoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 12
            weight_tie_layers = True   # set this to True to weight tie all the layers
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    mask = torch.ones_like(x).bool()        # added
    out = model(x, mask = mask)             # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_weight_tie_layers_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Encoder(dim=64, depth=2, weight_tie_layers=True)
    )
    _token_parity("weight_tie_layers", xt_model, padded=True)


def test_custom_layers_execute_order():
    """README "Weight-tied Layers": custom_layers + layers_execute_order (each attention / feedforward
    pair run 4 times)."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            custom_layers = (
                'a', 'f',        # 3 sets of attention and feedforward
                'a', 'f',
                'a', 'f'
            ),
            layers_execute_order = (
                *((0, 1) * 4),   # each done 4 times before sequentially passed forward, but you can probably imagine some more interesting configurations...
                *((2, 3) * 4),
                *((4, 5) * 4),
            )
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_custom_layers_execute_order_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024,
        attn_layers=xt.Decoder(
            dim=64, custom_layers=("a", "f", "a", "f", "a", "f"),
            layers_execute_order=(*((0, 1) * 4), *((2, 3) * 4), *((4, 5) * 4)),
        ),
    )
    _token_parity("custom_layers + layers_execute_order", xt_model)


def test_macaron():
    """README "Understanding and Improving Transformer From a Multi-Particle Dynamic System Point of View":
    macaron."""
    import torch
    from safeformer import TransformerWrapper, Encoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Encoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            macaron = True  # use macaron configuration
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    mask = torch.ones_like(x).bool()        # added
    out = model(x, mask = mask)             # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_macaron_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Encoder(dim=64, depth=2, heads=8, macaron=True)
    )
    _token_parity("macaron", xt_model, padded=True)


def test_rel_pos_bias():
    """README "T5's Simplified Relative Positional Encoding": rel_pos_bias."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            rel_pos_bias = True  # adds relative positional bias to all attention layers, a la T5
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_rel_pos_bias_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, rel_pos_bias=True)
    )
    _token_parity("rel_pos_bias", xt_model)


def test_residual_attn_post_norm():
    """README "Residual Attention": pre_norm=False + residual_attn."""
    import torch
    from safeformer import TransformerWrapper, Encoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Encoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            pre_norm = False,       # in the paper, residual attention had best results with post-layernorm
            residual_attn = True    # add residual attention
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    mask = torch.ones_like(x).bool()        # added
    out = model(x, mask = mask)             # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_residual_attn_post_norm_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024,
        attn_layers=xt.Encoder(dim=64, depth=2, heads=8, pre_norm=False, residual_attn=True),
    )
    _token_parity("pre_norm=False + residual_attn", xt_model, padded=True)


def test_dec_cross_residual_attn():
    """README "Residual Attention": dec_cross_residual_attn (an XTransformer)."""
    import torch
    from safeformer import XTransformer

    model = XTransformer(
        dim = 64,               # README: 512
        enc_num_tokens = 256,
        enc_depth = 2,          # README: 6
        enc_heads = 8,
        enc_max_seq_len = 1024,
        dec_num_tokens = 256,
        dec_depth = 2,          # README: 6
        dec_heads = 8,
        dec_max_seq_len = 1024,
        dec_cross_residual_attn = True     # residualize cross attention
    )

    src = torch.randint(0, 256, (1, 1024))      # added
    src_mask = torch.ones_like(src).bool()      # added
    tgt = torch.randint(0, 256, (1, 1024))      # added
    loss = model(src, tgt, mask = src_mask)     # added
    loss.backward()                             # added

    assert loss.shape == ()
    _finite(loss)
    _grads_finite(model)


def test_dec_cross_residual_attn_parity():
    xt_model = xt.XTransformer(
        dim=64, enc_num_tokens=256, enc_depth=2, enc_heads=8, enc_max_seq_len=1024,
        dec_num_tokens=256, dec_depth=2, dec_heads=8, dec_max_seq_len=1024, dec_cross_residual_attn=True,
    )
    sf_model = _convert(xt_model, "an x_transformers.XTransformer")
    src = torch.randint(0, 256, (2, N_PARITY))
    src_mask = torch.ones_like(src).bool()
    src_mask[1, N_PARITY // 2:] = False
    tgt = torch.randint(0, 256, (2, N_PARITY))
    with torch.no_grad():
        _assert_parity("dec_cross_residual_attn (loss)", xt_model(src, tgt, mask=src_mask), sf_model(src, tgt, mask=src_mask))
        xt_enc = xt_model.encoder(src, mask=src_mask, return_embeddings=True)
        _assert_parity(
            "dec_cross_residual_attn (decoder logits)",
            xt_model.decoder.net(tgt, context=xt_enc, context_mask=src_mask),
            sf_model.decoder.net(tgt, context=xt_enc, context_mask=src_mask),
        )


def test_transformer_xl_recurrence():
    """README "Transformer-XL recurrence": max_mem_len, return_mems / mems (three segments)."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model_xl = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 512,
        max_mem_len = 2048,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            rel_pos_bias = True
        )
    )

    seg1 = torch.randint(0, 20000, (1, 512))
    seg2 = torch.randint(0, 20000, (1, 512))
    seg3 = torch.randint(0, 20000, (1, 512))

    logits1, mems1  = model_xl(seg1, return_mems = True)
    logits2, mems2  = model_xl(seg2, mems = mems1, return_mems = True)
    logits3, mems3  = model_xl(seg3, mems = mems2, return_mems = True)

    for logits in (logits1, logits2, logits3):
        assert logits.shape == (1, 512, 20000)
    assert len(mems3) == 2  # one memory per attention layer
    assert all(m.shape == (1, 1536, 64) for m in mems3)  # all three segments: within max_mem_len
    _finite(logits1, logits2, logits3, *mems3)


def test_transformer_xl_recurrence_parity():
    """Both models read x-transformers' memories, so each segment's logits check the attention over
    them; the memories each returns are compared too (the conversion keeps ``max_mem_len``)."""
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=512, max_mem_len=2048,
        attn_layers=xt.Decoder(dim=64, depth=2, heads=8, rel_pos_bias=True),
    )
    sf_model = _convert(xt_model, "Transformer-XL memories (max_mem_len)")
    segs = torch.randint(0, 20000, (3, 1, N_PARITY // 2))
    mems = None
    with torch.no_grad():
        for i, seg in enumerate(segs):
            xt_logits, new_mems = xt_model(seg, mems=mems, return_mems=True)
            sf_logits, sf_mems = sf_model(seg, mems=mems, return_mems=True)
            _assert_parity(f"Transformer-XL segment {i + 1} (logits)", xt_logits, sf_logits)
            assert sf_model.max_mem_len == xt_model.max_mem_len
            for xt_m, sf_m in zip(new_mems, sf_mems, strict=True):
                _assert_parity(f"Transformer-XL segment {i + 1} (mems)", xt_m, sf_m)
            mems = new_mems


def test_xl_autoregressive_wrapper():
    """README "Transformer-XL recurrence": XLAutoregressiveWrapper over the section's ``model_xl``
    (rebuilt here; x-transformers exports the wrapper from the package and from its
    ``xl_autoregressive_wrapper`` module: the module is imported).

    No ``_parity`` twin: ``from_x_transformers`` takes no ``XLAutoregressiveWrapper``."""
    import torch
    from safeformer import TransformerWrapper, Decoder
    from safeformer.decoding.xl import XLAutoregressiveWrapper

    model_xl = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 512,
        max_mem_len = 2048,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            rel_pos_bias = True
        )
    )

    # pass in the above model_xl

    xl_wrapper = XLAutoregressiveWrapper(model_xl)

    seg = torch.randint(0, 20000, (1, 1024))  # README: (1, 4096) and .cuda(); sequence exceeding max length, automatically segmented and memory managed

    loss = xl_wrapper(seg)
    loss.backward()

    assert loss.shape == ()
    _finite(loss)
    _grads_finite(xl_wrapper)

    # then, after much training

    prime = seg[:, :1024]   # if prime exceeds max length, memory will be caught up before generating

    generated = xl_wrapper.generate(prime, 16)  # README: 4096; (1, 4096)

    assert generated.shape == (1, 16)
    assert ((generated >= 0) & (generated < 20000)).all()


def test_gate_residual():
    """README "Gated residual": gate_residual (on a TransformerWrapper with max_mem_len)."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        max_mem_len = 2048,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 16,
            gate_residual = True
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_gate_residual_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, max_mem_len=2048,
        attn_layers=xt.Decoder(dim=64, depth=2, heads=16, gate_residual=True),
    )
    _token_parity("gate_residual", xt_model)


def test_rotary_pos_emb():
    """README "Rotary Positional Embeddings"."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            rotary_pos_emb = True  # turns on rotary positional embeddings
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_rotary_pos_emb_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, rotary_pos_emb=True)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("rotary_pos_emb", xt_model(x), sf_model(x))


def test_rotary_xpos():
    """README "Rotary Positional Embeddings": rotary_xpos (length-extrapolatable rotary)."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            rotary_xpos = True   # modified rotary to extrapolate well beyond length at which it was trained
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_rotary_xpos_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, rotary_xpos=True)
    )
    _token_parity("rotary_xpos", xt_model)


def test_alibi_num_heads():
    """README "ALiBi Positional Embedding": alibi_pos_bias on 4 of the 8 heads."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            alibi_pos_bias = True, # turns on ALiBi positional embedding
            alibi_num_heads = 4    # only use ALiBi for 4 out of the 8 heads, so other 4 heads can still attend far distances
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_alibi_num_heads_parity():
    """README's ALiBi on half the heads, with and without the absolute position embedding x-transformers keeps next
    to ALiBi by default (safeformer keeps it too)."""
    for use_abs in (False, True):
        xt_model = xt.TransformerWrapper(
            num_tokens=20000, max_seq_len=1024, use_abs_pos_emb=use_abs,
            attn_layers=xt.Decoder(dim=64, depth=2, heads=8, alibi_pos_bias=True, alibi_num_heads=4),
        )
        _token_parity(f"alibi_pos_bias + alibi_num_heads=4 (absolute embedding: {use_abs})", xt_model)


def test_shift_tokens():
    """README "Shifted Tokens": shift_tokens = 1."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            shift_tokens = 1
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_shift_tokens_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, shift_tokens=1)
    )
    _token_parity("shift_tokens=1", xt_model)


def test_shift_tokens_per_layer():
    """README "Shifted Tokens": one shift per layer (depth 6 kept: the tuple names 12 layers)."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 6,
            heads = 8,
            shift_tokens = (1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0) # 12 blocks, attention and feedforward alternating, with progressively less shifting
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_shift_tokens_per_layer_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024,
        attn_layers=xt.Decoder(dim=64, depth=6, heads=8, shift_tokens=(1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0)),
    )
    _token_parity("shift_tokens per layer", xt_model)


def test_sandwich_norm():
    """README "Sandwich Norm": sandwich_norm."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            sandwich_norm = True # set this to True
        )
    )

    x = torch.randint(0, 20000, (1, 1024))
    out = model(x)

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_sandwich_norm_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, sandwich_norm=True)
    )
    _token_parity("sandwich_norm", xt_model)


def test_scale_residual():
    """README "Normformer": scale_residual."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            scale_residual = True # set this to True
        )
    )

    x = torch.randint(0, 20000, (1, 1024))
    out = model(x)

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_scale_residual_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, scale_residual=True)
    )
    _token_parity("scale_residual", xt_model)


def test_attn_qk_norm_dim_scale():
    """README "QK RMSNorm": attn_qk_norm + attn_qk_norm_dim_scale."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 12
            heads = 8,
            attn_qk_norm = True,
            attn_qk_norm_dim_scale = True # set this to True, in addition to `attn_qk_norm = True`
        )
    )

    x = torch.randint(0, 256, (1, 1024))
    out = model(x)

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_attn_qk_norm_dim_scale_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024,
        attn_layers=xt.Decoder(dim=64, depth=2, heads=8, attn_qk_norm=True, attn_qk_norm_dim_scale=True),
    )
    _token_parity("attn_qk_norm + attn_qk_norm_dim_scale", xt_model)


def test_no_abs_pos_emb():
    """README "Turning off absolute positional embedding"."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        use_abs_pos_emb = False,   # set this to False
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
        )
    )

    x = torch.randint(0, 20000, (1, 1024))
    out = model(x)

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_no_abs_pos_emb_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, use_abs_pos_emb=False, attn_layers=xt.Decoder(dim=64, depth=2, heads=8)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("use_abs_pos_emb=False", xt_model(x), sf_model(x))



def test_forgetful_causal_mask():
    """README "Forgetful Causal Mask": AutoregressiveWrapper(mask_prob = 0.15).

    No ``_parity`` twin: ``from_x_transformers`` refuses ``mask_prob`` (x-transformers applies it in
    evaluation mode too), and the two libraries draw the hidden keys differently (x-transformers over all
    n inputs, safeformer over the n - 1 that are read), so the losses differ for the same seed."""
    import torch
    from safeformer import TransformerWrapper, Decoder, AutoregressiveWrapper

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 12
            heads = 8
        )
    )

    model = AutoregressiveWrapper(
        model,
        mask_prob = 0.15  # in paper, they use 15%, same as BERT
    )                     # README: .cuda()

    # mock data

    x = torch.randint(0, 20000, (1, 1024))

    # derive cross entropy loss, masking all taken care of

    loss = model(x)
    loss.backward()

    assert loss.shape == ()
    _finite(loss)
    _grads_finite(model)


# ----------------------------------------------------------------------------------------------------
# Miscellaneous
# ----------------------------------------------------------------------------------------------------


def test_cross_attention():
    """README "Cross Attention"."""
    import torch
    from safeformer import Encoder, CrossAttender

    enc = Encoder(dim = 64, depth = 2)            # README: dim = 512, depth = 6
    model = CrossAttender(dim = 64, depth = 2)    # README: dim = 512, depth = 6

    nodes = torch.randn(1, 1, 64)                 # README: 512
    node_masks = torch.ones(1, 1).bool()

    neighbors = torch.randn(1, 5, 64)             # README: 512
    neighbor_masks = torch.ones(1, 5).bool()

    encoded_neighbors = enc(neighbors, mask = neighbor_masks)
    out = model(nodes, context = encoded_neighbors, mask = node_masks, context_mask = neighbor_masks) # (1, 1, 512)

    assert encoded_neighbors.shape == (1, 5, 64)
    assert out.shape == (1, 1, 64)
    _finite(encoded_neighbors, out)


def test_cross_attention_parity():
    xt_enc, xt_model = xt.Encoder(dim=64, depth=2), xt.CrossAttender(dim=64, depth=2)
    sf_enc, sf_model = _convert_layers(xt_enc), _convert_layers(xt_model)
    nodes = torch.randn(1, 1, 64)
    node_masks = torch.ones(1, 1).bool()
    neighbors = torch.randn(1, 5, 64)
    neighbor_masks = torch.ones(1, 5).bool()
    with torch.no_grad():
        xt_encoded = xt_enc(neighbors, mask=neighbor_masks)
        sf_encoded = sf_enc(neighbors, mask=neighbor_masks)
        _assert_parity("cross attention: Encoder", xt_encoded, sf_encoded)
        _assert_parity(
            "cross attention: CrossAttender",
            xt_model(nodes, context=xt_encoded, mask=node_masks, context_mask=neighbor_masks),
            sf_model(nodes, context=xt_encoded, mask=node_masks, context_mask=neighbor_masks),
        )


def test_continuous_embeddings():
    """README "Continuous Embeddings": ContinuousTransformerWrapper."""
    import torch
    from safeformer import ContinuousTransformerWrapper, Decoder

    model = ContinuousTransformerWrapper(
        dim_in = 32,
        dim_out = 100,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 12
            heads = 8
        )
    )

    x = torch.randn((1, 1024, 32))
    mask = torch.ones(1, 1024).bool()

    out = model(x, mask = mask) # (1, 1024, 100)

    assert out.shape == (1, 1024, 100)
    _finite(out)


def test_continuous_embeddings_parity():
    """``from_x_transformers`` takes token models: the layer stack is converted through it and the
    projections (bias-free in x-transformers) and the absolute position embedding are copied."""
    xt_model = xt.ContinuousTransformerWrapper(
        dim_in=32, dim_out=100, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8)
    )
    sf_layers = _convert_layers(xt_model.attn_layers)  # moves the layers' weights off their init too
    _perturb(xt_model.project_in)
    _perturb(xt_model.project_out)
    _perturb(xt_model.pos_emb)
    xt_model.eval()
    sf_model = safeformer.ContinuousTransformerWrapper(dim_in=32, dim_out=100, max_seq_len=1024, attn_layers=sf_layers).eval()
    assert xt_model.pos_emb.scale == 64**-0.5
    with torch.no_grad():
        sf_model.project_in.weight.copy_(xt_model.project_in.weight)  # bias-free in both
        sf_model.project_out.weight.copy_(xt_model.project_out.weight)
        sf_model.pos_emb.emb.weight.copy_(xt_model.pos_emb.emb.weight)
        x = torch.randn((1, N_PARITY, 32))
        mask = torch.ones(1, N_PARITY).bool()
        _assert_parity("continuous embeddings", xt_model(x, mask=mask), sf_model(x, mask=mask))


def _continuous_autoregressive_example(batched_start: bool):
    """README "Continuous Embeddings": ContinuousAutoregressiveWrapper (training, then generation)."""
    import torch
    from safeformer import ContinuousTransformerWrapper, Decoder
    from safeformer import ContinuousAutoregressiveWrapper

    model = ContinuousTransformerWrapper(
        dim_in = 777,
        dim_out = 777,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 12
            heads = 8
        )
    )

    # wrap it with the continuous autoregressive wrapper

    model = ContinuousAutoregressiveWrapper(model)

    # mock data

    x = torch.randn((1, 1024, 777))
    mask = torch.ones(1, 1024).bool()

    # train on a lot of data above

    loss = model(x, mask = mask)
    loss.backward()                 # README: `loss.backward` (the call is missing there)

    assert loss.shape == ()
    _finite(loss)
    _grads_finite(model)

    # then generate

    start_emb = torch.randn(1, 777)
    if batched_start:
        start_emb = start_emb[None]                 # (1, 1, 777): a batch of one one-step start
    generated = model.generate(start_emb, 17) # (17, 777)
    return generated


def test_continuous_autoregressive():
    generated = _continuous_autoregressive_example(batched_start=False)
    assert generated.shape == (17, 777)
    _finite(generated)


def test_continuous_autoregressive_batched_start():
    """The same example with its one change: the start given as a batch of one, ``(1, 1, 777)``."""
    generated = _continuous_autoregressive_example(batched_start=True)
    assert generated.shape == (1, 17, 777)  # x-transformers returns the same shape for a batched start
    _finite(generated)


def test_xval():
    """README "xVal - Continuous and Discrete": XValTransformerWrapper + XValAutoregressiveWrapper
    (training, then generation)."""
    import torch

    from safeformer import (
        Decoder,
        XValTransformerWrapper,
        XValAutoregressiveWrapper
    )

    model = XValTransformerWrapper(
        num_tokens = 4,
        numerical_token_id = 3,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 12
            heads = 8
        )
    )

    # wrap it with the xval autoregressive wrapper

    model = XValAutoregressiveWrapper(model)

    # mock data

    ids = torch.randint(0, 4, (1, 777))
    nums = torch.randn(1, 777)

    # train on a lot of data above

    loss = model(ids, nums)
    loss.backward()

    assert loss.shape == ()
    _finite(loss)
    _grads_finite(model)

    # then generate

    start_ids = torch.randint(0, 4, (1, 1))
    start_nums = torch.randn(1, 1)

    ids_out, num_out, is_number_mask = model.generate(start_ids, start_nums, 17)

    # (1, 17), (1, 17), (1, 17)

    # discrete, continuous, mask for discrete / continuous

    assert ids_out.shape == num_out.shape == is_number_mask.shape == (1, 17)
    assert is_number_mask.dtype == torch.bool
    assert torch.equal(is_number_mask, ids_out == 3)
    _finite(num_out[is_number_mask])


def test_xval_parity():
    xt_model = xt.XValAutoregressiveWrapper(xt.XValTransformerWrapper(
        num_tokens=4, numerical_token_id=3, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8)
    ))
    sf_model = _convert(xt_model)
    ids = torch.randint(0, 4, (1, N_PARITY))
    nums = torch.randn(1, N_PARITY)
    with torch.no_grad():
        _assert_parity("xVal loss", xt_model(ids, nums), sf_model(ids, nums))
        xt_logits, xt_nums = xt_model.net(ids, nums)
        sf_logits, sf_nums = sf_model.net(ids, nums)
        _assert_parity("xVal logits", xt_logits, sf_logits)
        _assert_parity("xVal numbers", xt_nums, sf_nums)


def test_scalenorm():
    """README Transformers without Tears": use_scalenorm."""
    import torch
    from safeformer import TransformerWrapper, Decoder, Encoder  # noqa: F401

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            use_scalenorm = True # set to True to use for all layers
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_scalenorm_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, use_scalenorm=True)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("use_scalenorm", xt_model(x), sf_model(x))


def test_simple_rmsnorm():
    """README "Root Mean Square Layer Normalization": use_simple_rmsnorm."""
    import torch
    from safeformer import TransformerWrapper, Decoder, Encoder  # noqa: F401

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            use_simple_rmsnorm = True # set to true to use for all layers
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_simple_rmsnorm_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, use_simple_rmsnorm=True)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("use_simple_rmsnorm", xt_model(x), sf_model(x))


def test_ff_no_bias():
    """README "No Bias in Feedforward": ff_no_bias."""
    import torch
    from safeformer import TransformerWrapper, Decoder, Encoder  # noqa: F401

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            ff_no_bias = True  # set this to True
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_ff_no_bias_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, ff_no_bias=True)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("ff_no_bias", xt_model(x), sf_model(x))


def test_ff_relu_squared():
    """README "ReLU Squared": ff_relu_squared."""
    import torch
    from safeformer import TransformerWrapper, Decoder, Encoder  # noqa: F401

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            ff_relu_squared = True
        )
    )

    x = torch.randint(0, 20000, (1, 1024))  # added
    out = model(x)                          # added

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_ff_relu_squared_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, ff_relu_squared=True)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("ff_relu_squared", xt_model(x), sf_model(x))


def test_ff_post_act_ln():
    """README "Normformer"-style ff_post_act_ln."""
    import torch
    from safeformer import TransformerWrapper, Decoder, Encoder  # noqa: F401

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            ff_post_act_ln = True # set this to True
        )
    )

    x = torch.randint(0, 20000, (1, 1024))
    out = model(x)

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_ff_post_act_ln_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, ff_post_act_ln=True)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("ff_post_act_ln", xt_model(x), sf_model(x))


def test_sparse_topk():
    """README "Explicit Sparse Transformer": attn_sparse_topk with the straight-through gradient."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            attn_sparse_topk = 8,                       # keep only the top 8 values before attention (softmax)
            attn_sparse_topk_straight_through = True    # straight through the original gradients
        )
    )

    x = torch.randint(0, 20000, (1, 256))  # added (README: 1024, shortened: the explicit path)
    out = model(x)                          # added

    assert out.shape == (1, 256, 20000)
    _finite(out)


def test_sparse_topk_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024,
        attn_layers=xt.Decoder(dim=64, depth=2, heads=8, attn_sparse_topk=8, attn_sparse_topk_straight_through=True)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("attn_sparse_topk", xt_model(x), sf_model(x))


def test_attn_head_scale():
    """README "Normformer": attn_head_scale."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            attn_head_scale = True  # set this to True
        )
    )

    x = torch.randint(0, 20000, (1, 1024))
    out = model(x)

    assert out.shape == (1, 1024, 20000)
    _finite(out)


def test_attn_head_scale_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, attn_head_scale=True)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("attn_head_scale", xt_model(x), sf_model(x))


def test_attn_hard():
    """README "Selective Attention" neighbour: attn_hard (the argmax's value only, softmax gradient)."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            attn_hard = True  # will only propagate the single value of the argmax of qk logit. offered in the case it addresses https://arxiv.org/abs/2410.01104
        )
    )

    x = torch.randint(0, 20000, (1, 256))  # added (the explicit path: 256 positions)
    out = model(x)                          # added

    assert out.shape == (1, 256, 20000)
    _finite(out)


def test_attn_hard_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, attn_hard=True)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("attn_hard", xt_model(x), sf_model(x))


def test_talking_heads():
    """README "Talking-Heads Attention": attn_pre_talking_heads, attn_post_talking_heads."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            attn_pre_talking_heads = True,  # linear combination across pre-softmax attn logits across heads
            attn_post_talking_heads = True  # linear combination across post-softmax attn across heads
        )
    )

    x = torch.randint(0, 20000, (1, 256))  # added (the explicit path: 256 positions)
    out = model(x)                          # added

    assert out.shape == (1, 256, 20000)
    _finite(out)


def test_talking_heads_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=1024,
        attn_layers=xt.Decoder(dim=64, depth=2, heads=8, attn_pre_talking_heads=True, attn_post_talking_heads=True)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("talking heads", xt_model(x), sf_model(x))


def test_dynamic_pos_bias():
    """README "Dynamic Positional Bias": dynamic_pos_bias."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 256,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            dynamic_pos_bias = True,                # set this to True
            dynamic_pos_bias_log_distance = False   # whether to use log distance, as in SwinV2
        )
    )

    x = torch.randint(0, 256, (1, 1024))  # added
    out = model(x)                        # added

    assert out.shape == (1, 1024, 256)
    _finite(out)


def test_dynamic_pos_bias_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=256, max_seq_len=1024, attn_layers=xt.Decoder(dim=64, depth=2, heads=8, dynamic_pos_bias=True)
    )
    sf_model = _convert(xt_model)
    x = torch.randint(0, 256, (1, N_PARITY))
    with torch.no_grad():
        _assert_parity("dynamic_pos_bias", xt_model(x), sf_model(x))


def test_shift_mem_down_rotate_num_heads():
    """README "Transformer-XL recurrence", the shift_mem_down example, with rotate_num_heads."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model_xl = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 512,
        max_mem_len = 2048,
        shift_mem_down = 1,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            rotary_pos_emb = True,
            rotate_num_heads = 4   # only rotate 4 out of the 8 attention heads
        )
    )

    seg1 = torch.randint(0, 20000, (1, 512))
    seg2 = torch.randint(0, 20000, (1, 512))
    seg3 = torch.randint(0, 20000, (1, 512))  # noqa: F841  (as the README writes it)

    logits1, mems1  = model_xl(seg1, return_mems = True)
    logits2, mems2  = model_xl(seg2, mems = mems1, return_mems = True) # mems1 of layer N are automatically routed to the layer N-1

    assert logits1.shape == logits2.shape == (1, 512, 20000)
    _finite(logits1, logits2)
    assert all(blk.mixer.rotate_num_heads == 4 for blk in model_xl.attn_layers.layers if blk.kind == "self")


def test_shift_mem_down_rotate_num_heads_parity():
    xt_model = xt.TransformerWrapper(
        num_tokens=20000, max_seq_len=512, max_mem_len=2048, shift_mem_down=1,
        attn_layers=xt.Decoder(dim=64, depth=2, heads=8, rotary_pos_emb=True, rotate_num_heads=4),
    )
    sf_model = _convert(xt_model, "Transformer-XL memories (max_mem_len)")
    segs = torch.randint(0, 20000, (2, 1, N_PARITY // 2))
    mems = None
    with torch.no_grad():
        for i, seg in enumerate(segs):
            xt_logits, new_mems = xt_model(seg, mems=mems, return_mems=True)
            sf_logits, _ = sf_model(seg, mems=mems, return_mems=True)
            _assert_parity(f"shift_mem_down + rotate_num_heads segment {i + 1}", xt_logits, sf_logits)
            mems = new_mems


def test_post_emb_norm():
    """README "post_emb_norm" (layernorm of the summed token and position embeddings)."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        post_emb_norm = True,    # set this to True to layernorm summed token + pos embeddings
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8
        )
    )

    x = torch.randint(0, 20000, (1, 256))  # added
    out = model(x)  # added
    assert out.shape == (1, 256, 20000)
    _finite(out)


def test_post_emb_norm_parity():
    xt_model = xt.TransformerWrapper(num_tokens=20000, max_seq_len=1024, post_emb_norm=True,
                                     attn_layers=xt.Decoder(dim=64, depth=2, heads=8))
    _token_parity("post_emb_norm", xt_model)


def test_attn_on_attn():
    """README "Attention on Attention"."""
    import torch
    from safeformer import TransformerWrapper, Encoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Encoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            attn_on_attn = True  # gate output of attention layer, by queries
        )
    )

    x = torch.randint(0, 20000, (1, 256))  # added
    out = model(x)  # added
    assert out.shape == (1, 256, 20000)
    _finite(out)


def test_attn_on_attn_parity():
    xt_model = xt.TransformerWrapper(num_tokens=20000, max_seq_len=1024,
                                     attn_layers=xt.Encoder(dim=64, depth=2, heads=8, attn_on_attn=True))
    _token_parity("attn_on_attn", xt_model)


@pytest.mark.parametrize("option", [dict(attn_qk_norm_groups=8), dict(attn_qk_norm_scale=10)])
def test_attn_qk_norm_groups_and_scale(option):
    """README "Query-Key Normalization" (groups of the feature dimension; a fixed scale with groups of 1)."""
    import torch
    from safeformer import TransformerWrapper, Decoder

    model = TransformerWrapper(
        num_tokens = 20000,
        max_seq_len = 1024,
        attn_layers = Decoder(
            dim = 64,       # README: 512
            depth = 2,      # README: 6
            heads = 8,
            attn_qk_norm = True,       # set this to True
            **option
        )
    )

    x = torch.randint(0, 20000, (1, 256))  # README: 1024
    out = model(x)
    assert out.shape == (1, 256, 20000)
    _finite(out)
    xt_model = xt.TransformerWrapper(num_tokens=20000, max_seq_len=1024,
                                     attn_layers=xt.Decoder(dim=64, depth=2, heads=8, attn_qk_norm=True, **option))
    sf_model = _convert(xt_model)
    x = torch.randint(0, 20000, (1, N_PARITY))
    with torch.no_grad():
        theirs, ours = xt_model(x), sf_model(x)
    # 8 groups bound the logits by 8 * 10 = 80: float32 rounding (x-transformers' softmax runs in float32 even for
    # float64 inputs) grows with that scale, to ~4e-5 on these logits (1 group: ~2.5e-6, 4 groups: ~1.1e-5)
    tol = 1e-4 if option.get("attn_qk_norm_groups", 1) > 1 else 1e-5
    torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)
