"""The mask layout CUDA's memory-efficient kernel needs (``attend._cuda_kernel_mask``), checked on the CPU.

On an H200 (torch 2.11) the kernel refused a query-padding mask broadcast over the keys ("(*bias): last
dimension must be contiguous") and read misaligned addresses; the layout fix is a pure tensor function,
so its choices are tested here without a GPU.
"""
import pytest
import torch

from safeformer.core.attend import _cuda_kernel_mask


def _ok_layout(m: torch.Tensor, j: int) -> bool:
    return (m.shape[-1] == j and m.stride(-1) == 1 and m.data_ptr() % 16 == 0
            and all(s % 8 == 0 for s, n in zip(m.stride()[:-1], m.shape[:-1]) if n > 1))


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.bfloat16])
def test_query_padding_mask_broadcast_over_keys_is_expanded_and_aligned(dtype):
    m = (torch.rand(2, 1, 5, 1) > 0.5).to(dtype)  # (b, 1, i, 1): one value per query
    out = _cuda_kernel_mask(m, 13)
    assert out.shape == (2, 1, 5, 13) and out.dtype == dtype
    assert _ok_layout(out, 13)
    assert torch.equal(out, m.expand(2, 1, 5, 13))


def test_stride_zero_last_dim_is_materialised():
    m = torch.randn(3, 1, 4, 1).expand(3, 1, 4, 9)  # right shape, stride 0 on the keys
    out = _cuda_kernel_mask(m, 9)
    assert _ok_layout(out, 9) and torch.equal(out, m)


def test_misaligned_view_is_copied():
    base = torch.randn(2, 4, 17)
    m = base[:, :, 1:]  # a view 4 bytes into its storage, rows of 17
    assert m.data_ptr() % 16 != 0
    out = _cuda_kernel_mask(m, 16)
    assert _ok_layout(out, 16) and torch.equal(out, m)


def test_aligned_mask_is_returned_as_is():
    m = torch.randn(2, 1, 3, 16)
    assert _cuda_kernel_mask(m, 16) is m
    key_padding = torch.ones(2, 1, 1, 24, dtype=torch.bool)  # size-1 dims: their strides do not matter
    assert _cuda_kernel_mask(key_padding, 24) is key_padding


def test_gradient_reaches_a_trainable_bias_through_the_copy():
    bias = torch.randn(1, 2, 3, 1, requires_grad=True)
    out = _cuda_kernel_mask(bias, 5)
    out.sum().backward()
    assert torch.equal(bias.grad, torch.full_like(bias, 5.0))
