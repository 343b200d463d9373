"""Worker for ``test_gradients.py::test_ddp_with_one_rank_all_padding`` (run with torchrun, 2 processes).

Rank 0 trains on a ragged batch, rank 1 on a batch that is all padding (every token masked, every
context empty, every condition dropped), with ``DistributedDataParallel(find_unused_parameters=False)``.
Every parameter must get a gradient on both ranks, or the reduction stalls or fails.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import safeformer as sf

B, N, J, C, V = 3, 6, 4, 16, 11


def batch(rank: int) -> dict:
    g = torch.Generator().manual_seed(10 + rank)
    kw = dict(x=torch.randint(0, V, (B, N), generator=g), context=torch.randn(B, J, C, generator=g),
              condition=torch.randn(B, 3, generator=g))
    if rank == 0:
        mask = torch.ones(B, N, dtype=torch.bool)
        mask[0, :2] = False
        ctx_mask = torch.ones(B, J, dtype=torch.bool)
        ctx_mask[1] = False
        kw.update(mask=mask, context_mask=ctx_mask, condition_mask=torch.tensor([True, True, False]))
    else:
        kw.update(mask=torch.zeros(B, N, dtype=torch.bool), context_mask=torch.zeros(B, J, dtype=torch.bool),
                  condition_mask=torch.zeros(B, dtype=torch.bool))
    return kw


def build() -> sf.AutoregressiveWrapper:
    """The model of both ranks (and of the single-process reference): no dropout, no random dropping."""
    torch.manual_seed(0)
    layers = sf.Decoder(dim=C, depth=2, heads=2, dim_head=8, cross_attend=True, rotary_pos_emb=True,
                        use_adaptive_layernorm=True, dim_condition=3, attn_bias=True)
    net = sf.TransformerWrapper(num_tokens=V, max_seq_len=16, attn_layers=layers)
    return sf.AutoregressiveWrapper(net).train()


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build()
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    first = None
    for _ in range(3):
        kw = batch(rank)
        loss = ddp(kw.pop("x"), **kw)
        loss.backward()
        if first is None:
            first = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.save({"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}, "first_grads": first},
               out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
