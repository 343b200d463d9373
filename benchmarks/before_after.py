"""Before / after one change, in one run: the same workloads on two safeformer trees, interleaved, medians.

The other tree is imported under another package name (``--before``: a directory holding a copy of an older
``safeformer`` package renamed, e.g. ``sf_old``; every import inside the package is relative, so it loads beside
today's). Each round times every workload once on each tree in alternating order; the number is the median over
rounds of the per-round ratio ``after / before`` of the time (below 1: today's tree is faster).

Workloads (float32, CPU, one thread): a training step (forward and backward) of a decoder with a padding mask;
greedy KV-cached generation, plain and guided with two branches (``cond_scale``), batch 1 and 16; ``attend`` with a
padding mask, forward and backward; the unpadded path (an encoder on a mostly padded batch, forward and backward);
greedy generation with options an earlier decode step could not run (softclamped logits, sparse top-k, talking
heads, a forward hook); with ``--compiled`` also generation with ``compile=True`` (``--only compiled`` times just
those).

    git worktree add /tmp/old <commit> && mkdir -p /tmp/oldpkg && cp -r /tmp/old/safeformer /tmp/oldpkg/sf_old
    python benchmarks/before_after.py --before /tmp/oldpkg --name sf_old
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time

import torch


def _build(lib, dim: int, depth: int, cross: bool):
    torch.manual_seed(0)
    layers = lib.Decoder(dim=dim, depth=depth, heads=4, dim_head=dim // 4, rotary_pos_emb=True, cross_attend=cross)
    return lib.TransformerWrapper(num_tokens=256, max_seq_len=256, attn_layers=layers)


def _workloads(lib, quick: bool, compiled: bool = False, width: int = 256) -> dict:
    dim, depth = width, 4
    g = torch.Generator().manual_seed(1)
    b, n = (4, 64) if quick else (8, 128)
    ids = torch.randint(0, 256, (b, n), generator=g)
    mask = torch.arange(n)[None] < torch.randint(n // 2, n + 1, (b,), generator=g)[:, None]
    net = _build(lib, dim, depth, cross=False)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def train_step():
        logits = net(ids, mask=mask)
        loss = lib.safe_cross_entropy(logits[:, :-1], torch.where(mask[:, 1:], ids[:, 1:], -100))
        opt.zero_grad()
        loss.backward()
        opt.step()

    out = {f"train step (b 8, n 128, dim {dim})": train_step}
    tokens = 16 if quick else 32
    gen_net = _build(lib, dim, depth, cross=True).eval()
    ar = lib.AutoregressiveWrapper(gen_net)
    for batch in (1, 16):
        prompt = torch.randint(0, 256, (batch, 8), generator=g)
        ctx = torch.randn(batch, 16, dim, generator=g)
        ctx_mask = torch.arange(16)[None] < torch.randint(1, 17, (batch,), generator=g)[:, None]
        out[f"generate plain, batch {batch}"] = (
            lambda p=prompt, c=ctx, m=ctx_mask: ar.generate(p, tokens, context=c, context_mask=m, temperature=0.0))
        out[f"generate CFG 2 branches, batch {batch}"] = (
            lambda p=prompt, c=ctx, m=ctx_mask: ar.generate(p, tokens, context=c, context_mask=m, temperature=0.0,
                                                          cond_scale=3.0))
        if compiled:  # generate(compile=True): the decode step compiled (the warm-up compiles it)
            out[f"generate plain, batch {batch}, compiled"] = (
                lambda p=prompt, c=ctx, m=ctx_mask: ar.generate(p, tokens, context=c, context_mask=m, temperature=0.0,
                                                              compile=True))
            out[f"generate CFG 2 branches, batch {batch}, compiled"] = (
                lambda p=prompt, c=ctx, m=ctx_mask: ar.generate(p, tokens, context=c, context_mask=m, temperature=0.0,
                                                              cond_scale=3.0, compile=True))
    # options the earlier decode step could not run (it fell back to the dynamic cache): plain generation with each
    for label, kw in (("softclamped logits", dict(attn_softclamp_logits=True)), ("sparse top-k", dict(attn_sparse_topk=8)),
                      ("talking heads", dict(attn_pre_talking_heads=True, attn_post_talking_heads=True))):
        torch.manual_seed(0)
        opt_net = lib.TransformerWrapper(num_tokens=256, max_seq_len=256, attn_layers=lib.Decoder(
            dim=dim, depth=depth, heads=4, dim_head=dim // 4, rotary_pos_emb=True, **kw)).eval()
        prompt1, wrapped = torch.randint(0, 256, (1, 8), generator=g), lib.AutoregressiveWrapper(opt_net)
        out[f"generate with {label}, batch 1"] = (
            lambda m=wrapped, p=prompt1: m.generate(p, tokens, temperature=0.0))
    hooked = _build(lib, dim, depth, cross=False).eval()
    hooked.attn_layers.layers[0].register_forward_hook(lambda *a: None)  # a probe (FSDP2 hooks every block)
    hooked_ar, prompt1 = lib.AutoregressiveWrapper(hooked), torch.randint(0, 256, (1, 8), generator=g)
    out["generate with a forward hook, batch 1"] = lambda: hooked_ar.generate(prompt1, tokens, temperature=0.0)
    q = torch.randn(4, 8, 256, 64, generator=g, requires_grad=True)
    k = torch.randn(4, 8, 256, 64, generator=g, requires_grad=True)
    v = torch.randn(4, 8, 256, 64, generator=g, requires_grad=True)
    pad = torch.arange(256)[None] < torch.tensor([256, 200, 100, 30])[:, None]

    def attend_step():
        lib.attend(q, k, v, mask=pad).sum().backward()

    out["attend fwd+bwd (padding mask)"] = attend_step
    # the unpadded path: an encoder on a mostly padded batch, forward and backward on the real tokens only
    torch.manual_seed(0)
    packed = lib.Encoder(dim=dim, depth=depth, heads=4, dim_head=dim // 4, rotary_pos_emb=True, unpadded=True)
    xs = torch.randn(b, n, dim, generator=g)
    sparse = torch.arange(n)[None] < torch.randint(1, n // 4 + 1, (b,), generator=g)[:, None]

    def unpadded_step():
        packed(xs, mask=sparse).sum().backward()

    out[f"unpadded step (b {b}, n {n}, <= 25% real)"] = unpadded_step
    return out


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="a directory holding the older package")
    p.add_argument("--name", default="sf_old", help="the older package's name there")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--compiled", action="store_true", help="also time generate(compile=True), plain and CFG")
    p.add_argument("--dim", type=int, default=256, help="the model width of the train and generate workloads")
    p.add_argument("--only", default=None, help="time only the workloads whose name contains this")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sys.path.insert(0, args.before)
    old = importlib.import_module(args.name)
    new = importlib.import_module("safeformer")
    work = {"before": _workloads(old, args.quick, args.compiled, args.dim),
            "after": _workloads(new, args.quick, args.compiled, args.dim)}
    if args.only:
        work = {side: {k: v for k, v in w.items() if args.only in k} for side, w in work.items()}
    for side in work.values():  # warm-up
        for fn in side.values():
            fn()
    ratios: dict[str, list[float]] = {name: [] for name in work["after"]}
    for r in range(args.rounds):
        for name in ratios:
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            t = {side: _time(work[side][name]) for side in order}
            ratios[name].append(t["after"] / t["before"])
    print(f"| workload | after / before time (median of {args.rounds} interleaved rounds) |")
    print("|---|---:|")
    result = {name: statistics.median(v) for name, v in ratios.items()}
    for name, value in result.items():
        print(f"| {name} | {value:.3f} |")
    return result


if __name__ == "__main__":
    main()
