"""Masks are validated once per call at the outermost door, and every door still validates on its own."""

from __future__ import annotations

import collections

import pytest
import torch

import safeformer as sf
import safeformer.core.masks as masks_mod


@pytest.fixture
def checks(monkeypatch):
    """Counts the checks ``validate_mask`` actually runs, per mask tensor (by identity)."""
    seen: collections.Counter = collections.Counter()
    names: dict[int, str] = {}
    real = masks_mod._check_mask

    def counting(mask, name, shape, device):
        seen[id(mask)] += 1
        names[id(mask)] = name
        return real(mask, name, shape, device)

    monkeypatch.setattr(masks_mod, "_check_mask", counting)
    return seen, names


def _model():
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=sf.Decoder(
        dim=16, depth=3, heads=2, dim_head=8, cross_attend=True))
    return sf.AutoregressiveWrapper(net)


def test_each_mask_is_validated_once_through_a_wrapper_forward(checks):
    seen, names = checks
    ar = _model()
    x = torch.randint(0, 20, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[0, :3] = False
    ctx, ctx_mask = torch.randn(3, 5, 16), torch.ones(3, 5, dtype=torch.bool)
    ctx_mask[1] = False
    loss = ar(x, mask=mask, context=ctx, context_mask=ctx_mask)
    assert torch.isfinite(loss)
    assert seen[id(ctx_mask)] == 1, "the user's context_mask is checked once (wrapper, conditions, stack, 3 layers)"
    assert seen[id(mask)] == 1
    repeated = {names[k]: v for k, v in seen.items() if v > 1}
    assert not repeated, f"masks validated more than once in one call: {repeated}"


def test_a_module_used_on_its_own_still_validates():
    attn = sf.Attention(16, heads=2, dim_head=8)
    with pytest.raises(TypeError, match="mask must have dtype torch.bool"):
        attn(torch.randn(2, 4, 16), mask=torch.ones(2, 4, dtype=torch.long))
    stack = sf.Encoder(dim=16, depth=1, heads=2, dim_head=8)
    with pytest.raises(ValueError, match="mask must have shape"):
        stack(torch.randn(2, 4, 16), mask=torch.ones(2, 5, dtype=torch.bool))


def test_a_mask_changed_in_place_within_a_call_is_checked_again(checks):
    seen, _ = checks
    m = torch.ones(2, 3, dtype=torch.bool)
    with masks_mod.validation_scope():
        masks_mod.validate_mask(m, "m", shape=(2, 3))
        masks_mod.validate_mask(m, "m", shape=(2, 3))
        assert seen[id(m)] == 1
        m[0, 0] = False  # a new version
        masks_mod.validate_mask(m, "m", shape=(2, 3))
        assert seen[id(m)] == 2
        with pytest.raises(ValueError, match="must have shape"):  # another requirement is checked
            masks_mod.validate_mask(m, "m", shape=(3, 3))
    masks_mod.validate_mask(m, "m", shape=(2, 3))  # outside a scope: every call checks
    masks_mod.validate_mask(m, "m", shape=(2, 3))
    assert seen[id(m)] == 5
