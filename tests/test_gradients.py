"""Every parameter that takes part gets a gradient, on every path, even when a batch is all padding
(docs/safety.md, "Gradients are always present"): a missing gradient is not a zero gradient, and under
data parallelism a parameter without one on one rank breaks the reduction (``find_unused_parameters``
off). A torchrun test proves it with one rank whose batch is all padding.

Shape legend: b batch, n positions, j context length, c width.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import safeformer as sf

ROOT = Path(__file__).resolve().parent.parent
B, N, J, C, V = 3, 6, 4, 16, 11

CONFIGS = {
    "plain": dict(),
    "adaptive": dict(use_adaptive_layernorm=True, dim_condition=3),
    "memory-kv": dict(attn_num_mem_kv=2),
    "sink-bias": dict(attn_head_learned_sink=True, attn_bias=True),
    "alibi-qknorm": dict(alibi_pos_bias=True, attn_qk_norm=True),
}


def _wrapper(config: dict, unpadded, **wrapper_kw) -> sf.AutoregressiveWrapper:
    torch.manual_seed(0)
    layers = sf.Decoder(dim=C, depth=2, heads=2, dim_head=8, cross_attend=True, unpadded=unpadded,
                        rotary_pos_emb="alibi_pos_bias" not in config, **config)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=16, attn_layers=layers, **wrapper_kw)
    return sf.AutoregressiveWrapper(net, cond_drop_prob=0.5, null_context="learned")


def _all_padding(config: dict) -> dict:
    kw = dict(x=torch.randint(0, V, (B, N)), mask=torch.zeros(B, N, dtype=torch.bool),
              context=torch.randn(B, J, C), context_mask=torch.zeros(B, J, dtype=torch.bool))
    if "dim_condition" in config:
        kw.update(condition=torch.randn(B, 3), condition_mask=torch.zeros(B, dtype=torch.bool))
    return kw


def _assert_every_grad_present_and_zero(model: torch.nn.Module, what: str) -> None:
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"{what}: parameters without a gradient: {missing}"
    nonzero = [n for n, p in model.named_parameters() if p.grad is not None and bool(p.grad.ne(0).any())]
    assert not nonzero, f"{what}: an all-padding batch must give zero gradients, got nonzero for {nonzero}"


@pytest.mark.parametrize("unpadded", ["auto", True, False])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_an_all_padding_batch_gives_every_parameter_a_zero_gradient(config, unpadded):
    cfg = CONFIGS[config]
    if unpadded is True and ("attn_num_mem_kv" in cfg or "attn_head_learned_sink" in cfg):
        pytest.skip("memory keys and sinks run on the padded path only (unpadded=True refuses them)")
    model = _wrapper(cfg, unpadded).train()
    kw = _all_padding(cfg)
    loss = model(kw.pop("x"), **kw)
    assert loss.item() == 0.0
    loss.backward()
    _assert_every_grad_present_and_zero(model, f"{config}, unpadded={unpadded}")


@pytest.mark.parametrize("unpadded", ["auto", False])
def test_all_ignored_targets_and_memory_tokens_give_zero_gradients(unpadded):
    """Every target ignored (no mask), with memory tokens: still a zero gradient for every parameter."""
    model = _wrapper({}, unpadded, num_memory_tokens=2).train()
    x = torch.full((B, N), -100)
    loss = model(x, context=torch.randn(B, J, C), context_mask=torch.zeros(B, J, dtype=torch.bool))
    loss.backward()
    _assert_every_grad_present_and_zero(model, f"all ignored, unpadded={unpadded}")


def test_the_other_wrappers_on_an_all_padding_batch():
    torch.manual_seed(0)
    cont_net = sf.ContinuousTransformerWrapper(dim_in=2, dim_out=2, max_seq_len=16, attn_layers=sf.Decoder(
        dim=C, depth=1, heads=2, dim_head=8, cross_attend=True))
    cont = sf.ContinuousAutoregressiveWrapper(cont_net)
    loss = cont(torch.randn(B, 5, 2), mask=torch.zeros(B, 5, dtype=torch.bool), context=torch.randn(B, J, C),
                context_mask=torch.zeros(B, J, dtype=torch.bool))
    loss.backward()
    _assert_every_grad_present_and_zero(cont, "ContinuousAutoregressiveWrapper")
    nar = sf.NonAutoregressiveWrapper(sf.TransformerWrapper(num_tokens=V, max_seq_len=8, attn_layers=sf.Encoder(
        dim=C, depth=1, heads=2, dim_head=8)), mask_id=V - 1)
    nar(torch.randint(0, V - 1, (B, 5)), mask=torch.zeros(B, 5, dtype=torch.bool)).loss.backward()
    _assert_every_grad_present_and_zero(nar, "NonAutoregressiveWrapper")
    xt = sf.XTransformer(dim=C, enc_num_tokens=V, enc_max_seq_len=8, dec_num_tokens=V, dec_max_seq_len=8,
                         enc_depth=1, dec_depth=1, enc_heads=2, dec_heads=2)
    xt(torch.randint(0, V, (B, 5)), torch.randint(0, V, (B, 5)), mask=torch.zeros(B, 5, dtype=torch.bool),
       tgt_mask=torch.zeros(B, 5, dtype=torch.bool)).backward()
    _assert_every_grad_present_and_zero(xt, "XTransformer")


def test_attend_with_zero_keys_keeps_a_trainable_bias_in_the_graph():
    q = torch.randn(2, 2, 3, 4, requires_grad=True)
    k = torch.randn(2, 2, 0, 4, requires_grad=True)
    v = torch.randn(2, 2, 0, 4, requires_grad=True)
    bias = torch.zeros(1, 2, 3, 0, requires_grad=True)
    out = sf.attend(q, k, v, bias=bias)
    assert out.shape == (2, 2, 3, 4) and out.eq(0).all()
    out.sum().backward()
    for name, t in (("q", q), ("k", k), ("v", v), ("bias", bias)):
        assert t.grad is not None, f"{name} has no gradient"
        assert t.grad.eq(0).all()


@pytest.mark.slow
def test_ddp_with_one_rank_all_padding(tmp_path):
    """torchrun, 2 processes (gloo), ``find_unused_parameters=False``: rank 1's batch is all padding. The
    steps complete, both ranks end with identical weights, and the averaged gradient equals half of
    rank 0's (rank 1 contributes exact zeros)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).parent / "ddp_all_padding.py"), str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for key in got[0]["weights"]:
        assert torch.equal(got[0]["weights"][key], got[1]["weights"][key]), f"ranks differ at {key}"
    # the same first step in one process: rank 0's batch alone, its gradient halved (the DDP average)
    from ddp_all_padding import batch, build

    model = build()
    kw = batch(0)
    model(kw.pop("x"), **kw).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[0]["first_grads"][name], p.grad / 2, rtol=1e-5, atol=1e-7, msg=name)
