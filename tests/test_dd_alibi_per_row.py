"""x-transformers' per-row data-dependent ALiBi (``attn_data_dependent_alibi_per_row``): per head a small query and
key of each position, the gate of a pair ``logsigmoid(q_i . k_j / sqrt(d)) * post_log_scale`` for the keys before the
query, summed from each key up to the query, added to the logits. Against a float64 reference written out pair by
pair; masked positions add nothing, whatever their input holds. Checkpoints: ``tests/test_state_dict_parity.py``.

Shape legend: b batch, n positions, h heads, d the gates' head dim.
"""

from __future__ import annotations

import pytest
import torch

import safeformer as sf

DIM, H, D = 16, 2, 4


def _attn():
    torch.manual_seed(0)
    attn = sf.Attention(DIM, heads=H, dim_head=8, causal=True, data_dependent_alibi=True,
                        data_dependent_alibi_per_row=True, data_dependent_alibi_per_row_dim_head=D,
                        data_dependent_alibi_kwargs=dict(post_log_scale=0.7))
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return attn.eval()


def _reference(attn, x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The attention written out in float64, sample by sample, over its real positions only."""
    P = {n: p.detach().double() for n, p in attn.named_parameters()}
    outs = torch.zeros(x.shape, dtype=torch.float64)
    for b in range(x.shape[0]):
        xr = x[b, real[b]].double()  # (r, c)
        r = xr.shape[0]
        qk = (xr @ P["data_dependent_alibi.to_forget_gates.0.weight"].T).view(r, 2, H, D)
        gq, gk = qk[:, 0].transpose(0, 1), qk[:, 1].transpose(0, 1)  # (h, r, d)
        gate = torch.nn.functional.logsigmoid(gq @ gk.transpose(-1, -2) / D**0.5) * 0.7  # (h, r, r)
        bias = torch.zeros(H, r, r, dtype=torch.float64)
        for i in range(r):
            for j in range(i):
                bias[:, i, j] = gate[:, i, j:i].sum(-1)
        q = (xr @ P["to_q.weight"].T).view(r, H, 8).transpose(0, 1)
        k = (xr @ P["to_k.weight"].T).view(r, H, 8).transpose(0, 1)
        v = (xr @ P["to_v.weight"].T).view(r, H, 8).transpose(0, 1)
        logits = q @ k.transpose(-1, -2) / 8**0.5 + bias
        logits = logits.masked_fill(~torch.ones(r, r, dtype=torch.bool).tril(), float("-inf"))
        o = (logits.softmax(-1) @ v).transpose(0, 1).reshape(r, H * 8) @ P["to_out.weight"].T
        outs[b, real[b]] = o
    return outs


@pytest.mark.parametrize("padding", ["right", "left", "middle"])
def test_equals_the_float64_reference_over_the_real_positions(padding):
    attn = _attn()
    x = torch.randn(2, 7, DIM)
    real = torch.ones(2, 7, dtype=torch.bool)
    real[1, {"right": slice(5, 7), "left": slice(0, 2), "middle": slice(2, 4)}[padding]] = False
    x_in = torch.where(real[..., None], x, torch.full_like(x, float("nan")))  # NaN in every padded slot
    out = attn(x_in, mask=real)
    assert torch.isfinite(out).all() and (out[~real] == 0).all()
    torch.testing.assert_close(out.double()[real], _reference(attn, x, real)[real], rtol=1e-5, atol=1e-5)


def test_padded_inputs_get_no_gradient_and_the_gates_do():
    attn = _attn().train()
    x = torch.randn(2, 6, DIM, requires_grad=True)
    real = torch.tensor([[True] * 6, [False, False] + [True] * 4])
    attn(x, mask=real).sum().backward()
    assert (x.grad[~real] == 0).all() and torch.isfinite(x.grad).all()
    assert attn.data_dependent_alibi.to_forget_gates[0].weight.grad.abs().sum() > 0


def test_checks_and_earlier_keys():
    with pytest.raises(ValueError, match="needs data_dependent_alibi=True and a causal"):
        sf.Attention(DIM, heads=H, causal=False, data_dependent_alibi=True, data_dependent_alibi_per_row=True)
    with pytest.raises(ValueError, match="data_dependent_alibi_kwargs takes post_log_scale"):
        sf.Attention(DIM, heads=H, causal=True, data_dependent_alibi=True, data_dependent_alibi_per_row=True,
                     data_dependent_alibi_kwargs=dict(bias_init=3.0))
    with pytest.raises(ValueError, match="data_dependent_alibi_per_row_dim_head must be a positive integer"):
        sf.Attention(DIM, heads=H, causal=True, data_dependent_alibi=True, data_dependent_alibi_per_row=True,
                     data_dependent_alibi_per_row_dim_head=0)
    # a state dict of earlier safeformer held the (per-position) gates' linear map as to_forget_gates
    attn = sf.Attention(DIM, heads=H, causal=True, data_dependent_alibi=True)
    old = {k.replace("data_dependent_alibi.to_forget_gates.0.", "to_forget_gates."): v
           for k, v in attn.state_dict().items()}
    fresh = sf.Attention(DIM, heads=H, causal=True, data_dependent_alibi=True)
    fresh.load_state_dict(old, strict=True)
    assert torch.equal(fresh.to_forget_gates.weight, attn.to_forget_gates.weight)
