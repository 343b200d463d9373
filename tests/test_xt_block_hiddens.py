"""x-transformers' ``LayerIntermediates.block_hiddens`` in safeformer: with ``return_hiddens`` the stream at the end
of each default block (every ``len_default_block`` layers run, and at the index of the stack's last layer, as
x-transformers counts), several residual streams as ``(b S, n, c)``, the last entry replaced by the output after
the final norm.

Each is checked against x-transformers itself: the same keyword call on both stacks, safeformer's loaded from
x-transformers' (perturbed) weights strictly (and back), every entry and the input's gradient through them at the
real positions of a right-padded batch (float32, 1e-5). Safety: padded positions are exactly 0 in every entry and NaN
planted there reaches no entry and no gradient.

Shape legend: b batch, n positions, c model width, S residual streams.
"""

from __future__ import annotations

import pytest
import torch
import x_transformers as xt
from helpers import perturb_params

import safeformer as sf

DIM, HEADS, DIM_HEAD = 16, 2, 8
NAN = float("nan")
MASK = torch.tensor([[True] * 7, [True] * 5 + [False] * 2])
pytestmark = pytest.mark.usefixtures("one_thread")

CASES = {
    "decoder": dict(depth=3),
    "cross_attend": dict(cross_attend=True),
    "custom_layers": dict(custom_layers=("a", "f", "f", "a", "f")),
    "layers_execute_order": dict(layers_execute_order=(0, 1, 2, 3, 0, 1, 2, 3)),
    "sandwich_coef": dict(depth=3, sandwich_coef=1),
    "post_norm": dict(pre_norm=False),
    "unet_skips": dict(depth=4, unet_skips=True),
    "two_gated_streams": dict(gated_multi_residual=True, num_residual_streams=2,
                              residual_fn_kwargs=dict(read_gate_rank=4)),
}


def _pair(opts: dict, seed: int = 0):
    opts = dict(opts)
    depth = opts.pop("depth", 2)
    torch.manual_seed(seed)
    peer = perturb_params(xt.Decoder(dim=DIM, depth=depth, heads=HEADS, attn_dim_head=DIM_HEAD, **opts), seed).eval()
    ours = sf.Decoder(dim=DIM, depth=depth, heads=HEADS, dim_head=DIM_HEAD, **opts).eval()
    ours.load_state_dict(peer.state_dict(), strict=True)
    peer.load_state_dict(ours.state_dict(), strict=True)
    return ours, peer


def _real(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """An entry's real positions (an entry of several streams ``(b S, n, c)`` has ``S`` rows per sample)."""
    return t[mask.repeat_interleave(t.shape[0] // mask.shape[0], dim=0)]


@pytest.mark.parametrize("case", list(CASES))
def test_block_hiddens_match_x_transformers(case):
    opts = CASES[case]
    ours, peer = _pair(opts, seed=1)
    x = torch.randn(2, 7, DIM)
    kw = dict(context=torch.randn(2, 3, DIM)) if opts.get("cross_attend") else {}
    res = []
    for model in (ours, peer):
        xi = x.clone().requires_grad_()
        _, inter = model(xi, mask=MASK, return_hiddens=True, **kw)
        entries = [_real(h, MASK) for h in inter.block_hiddens]
        sum((e * torch.linspace(-1, 1, e.numel()).view_as(e)).sum() for e in entries).backward()
        res.append(([tuple(h.shape) for h in inter.block_hiddens], entries, xi.grad[MASK]))
    assert res[0][0] == res[1][0] and len(res[0][0]) > 1
    torch.testing.assert_close(res[0][1:], res[1][1:], atol=1e-5, rtol=1e-5)


def test_block_hiddens_last_is_the_output_and_padding_is_zero():
    ours, _ = _pair(dict(depth=3), seed=2)
    x = torch.where(MASK[..., None], torch.randn(2, 7, DIM), NAN).requires_grad_()
    out, inter = ours(x, mask=MASK, return_hiddens=True)
    assert len(inter.block_hiddens) == 3 and inter.block_hiddens[-1] is out
    assert not torch.equal(inter.block_hiddens[0], inter.block_hiddens[1])
    for h in inter.block_hiddens:
        assert torch.isfinite(h).all() and (h[~MASK] == 0).all()
    sum(h.sum() for h in inter.block_hiddens).backward()
    assert torch.isfinite(x.grad).all() and (x.grad[~MASK] == 0).all()
    with torch.no_grad():  # a padded sample's entries equal its own alone
        _, alone = ours(x[1:, :5], return_hiddens=True)
    for h, a in zip(inter.block_hiddens, alone.block_hiddens):
        torch.testing.assert_close(h[1, :5].detach(), a[0], atol=1e-5, rtol=1e-5)
    assert sf.LayerIntermediates().block_hiddens is None  # the field's default, as x-transformers'


def test_block_hiddens_through_the_wrapper():
    torch.manual_seed(3)
    net = sf.TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=sf.Decoder(dim=DIM, depth=2, heads=HEADS))
    _, inter = net(torch.randint(0, 20, (2, 7)), return_intermediates=True)
    assert len(inter.block_hiddens) == 2 and inter.block_hiddens[0].shape == (2, 7, DIM)
