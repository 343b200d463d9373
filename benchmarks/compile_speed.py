"""``torch.compile`` of a safeformer model vs the same model in eager mode.

The model is a conditional decoder (``TransformerWrapper(Decoder(cross_attend=True, rotary_pos_emb=True))``)
on a batch with a padded context and dropped conditions (all-False ``context_mask`` rows), the case
where safeformer's masking does the most work. Two rows:
- ``forward``: the logits, in eval mode under ``torch.no_grad``;
- ``training step``: next-token loss (``AutoregressiveWrapper``) forward + backward + ``AdamW.step``
  (the optimizer runs eagerly in both columns; the model's forward and backward are compiled).

Both compile with ``fullgraph=True``: the compile would fail on any graph break (a host sync such as
``if mask.any()``, or Python control flow on tensor values), so a row that runs is also the check that
the masking code compiles whole. The compiled results are compared with eager ones (max abs difference
of logits / loss). The compile time is reported in units of one eager call (absolute times only on GPU).

Usage:
    python benchmarks/compile_speed.py            # about 2-3 minutes on 2 CPU cores (mostly compiling)
    python benchmarks/compile_speed.py --quick    # forward only, tiny model, < 30 s
"""

from __future__ import annotations

import time

import torch
from common import (
    base_parser,
    interleaved,
    machine,
    markdown_table,
    pick_inner,
    ratio_cells,
    setup,
    sync,
    write_results,
)

import safeformer as sf


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--depth", type=int, default=None)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--context-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--use-cache", action="store_true",
                   help="let inductor reuse its on-disk cache (the compile warm-up column then measures a cache hit)")
    args = p.parse_args()
    device = setup(args)
    if not args.use_cache:
        import torch._inductor.config as inductor_config

        inductor_config.force_disable_caches = True  # time a real compile, not a cache hit from an earlier run
    dim = args.dim or (64 if args.quick else 256)
    depth = args.depth or (1 if args.quick else 2)
    heads = args.heads if not args.quick else 2
    rounds = args.rounds or (7 if args.quick else 15)
    b, n, j = args.batch, args.seq if not args.quick else 32, args.context_len if not args.quick else 16

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (b, n + 1), generator=g).to(device)
    context = torch.randn(b, j, dim, generator=g).to(device)
    ctx_mask = torch.arange(j)[None] < torch.randint(1, j + 1, (b,), generator=g)[:, None]
    ctx_mask[: max(1, b // 10)] = False  # dropped conditions: all-False rows
    ctx_mask = ctx_mask.to(device)

    def build():
        torch.manual_seed(0)
        net = sf.TransformerWrapper(
            num_tokens=args.vocab, max_seq_len=n + 1,
            attn_layers=sf.Decoder(dim=dim, depth=depth, heads=heads, dim_head=dim // heads, cross_attend=True,
                                   rotary_pos_emb=True),
        )
        return sf.AutoregressiveWrapper(net).to(device)

    rows, ratios = [], {}

    # forward (eval, no grad)
    eager = build().eval()
    compiled_net = torch.compile(eager.net, fullgraph=True)

    def fwd(net):
        def f():
            with torch.no_grad():
                return net(tokens[:, :-1], context=context, context_mask=ctx_mask)
        return f

    t_eager_one = _time_once(fwd(eager.net), device)
    t_compile = _time_once(fwd(compiled_net), device)
    diff = (fwd(compiled_net)() - fwd(eager.net)()).abs().max().item()
    inner = pick_inner(fwd(eager.net), device, 0.05)
    t = interleaved({"eager": fwd(eager.net), "compiled": fwd(compiled_net)}, rounds=rounds, device=device, warmup=1,
                    inner=inner)
    rows.append(_row("forward (eval, no grad)", t, t_compile / t_eager_one, f"logits max abs diff {diff:.1e}", device))
    ratios["forward: compiled / eager"] = round(t.ratio("compiled"), 4)

    if not args.quick:
        # training step: compiled model forward + backward, eager optimizer
        models = {"eager": build(), "compiled": build()}
        fns = {"eager": models["eager"], "compiled": torch.compile(models["compiled"], fullgraph=True)}
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}

        def step(name):
            def f():
                loss = fns[name](tokens, context=context, context_mask=ctx_mask)
                loss.backward()
                opts[name].step()
                opts[name].zero_grad(set_to_none=True)
                return loss.detach()
            return f

        first = {}
        t_step_one = _time_once(lambda: first.setdefault("eager", step("eager")()), device)
        t_compile = _time_once(lambda: first.setdefault("compiled", step("compiled")()), device)
        diff = abs(first["eager"].item() - first["compiled"].item())
        t = interleaved({"eager": step("eager"), "compiled": step("compiled")}, rounds=rounds, device=device,
                        warmup=1)
        rows.append(_row("training step (fwd + bwd + AdamW)", t, t_compile / t_step_one,
                         f"first-step loss abs diff {diff:.1e}", device))
        ratios["training step: compiled / eager"] = round(t.ratio("compiled"), 4)

    header = ["computation", "compiled / eager (median per-round)", "ratio of medians", "per-round 25%-75%",
              "compile warm-up (x one eager call)", "compiled = eager?"]
    if device.type == "cuda":
        header += ["eager ms", "compiled ms"]
    lines = [
        "# torch.compile vs eager (safeformer)",
        "",
        f"Machine: {machine(device)}.",
        f"Model: TransformerWrapper(Decoder(dim={dim}, depth={depth}, heads={heads}, cross_attend=True, "
        f"rotary_pos_emb=True)), vocab {args.vocab}; batch {b}, sequence {n}, context {j} padded to random lengths "
        f"with {max(1, b // 10)} dropped (all-False) row(s). torch.compile(..., fullgraph=True), default inductor "
        f"backend, {'on-disk cache allowed' if args.use_cache else 'caches disabled (a real compile)'}. {rounds} interleaved rounds after 1 warm-up call each; ratio = compiled time / eager time in the "
        "same round (below 1: compiling pays).",
        "",
        *markdown_table(header, rows),
        "",
        "fullgraph=True compiled every row: the masking code has no graph break and no host sync.",
    ]
    if device.type != "cuda":
        lines.append("Absolute times are not reported on a CPU (shared machine); ratios only.")
    write_results("compile_speed", args, lines, ratios, None, "torch.compile: compiled / eager time")


def _time_once(fn, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def _row(name, t, compile_units, same, device) -> list:
    row = [name, *ratio_cells(t, "compiled"), f"{compile_units:.0f}", same]
    if device.type == "cuda":
        row += [f"{t.median('eager') * 1e3:.2f}", f"{t.median('compiled') * 1e3:.2f}"]
    return row


if __name__ == "__main__":
    main()
