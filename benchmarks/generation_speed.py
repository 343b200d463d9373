"""KV-cached greedy generation, guided and plain: safeformer vs x-transformers, side by side in one run.

One x-transformers ``TransformerWrapper(Decoder(rotary_pos_emb=True, attn_flash=True, ...))`` is built with
random weights per model; safeformer's model is the same network imported with
``safeformer.from_x_transformers`` (same weights). Contenders, interleaved in rounds:

- ``x-transformers``: its ``AutoregressiveWrapper.generate(..., cache_kv=True)`` for unguided rows; for
  guided rows the loop a user of it writes (it has no guidance in ``generate``): one forward per branch
  per step, each with its own cache (``return_intermediates=True`` / ``cache=``), the logits combined as
  ``uncond + sum_k s_k (cond_k - uncond)``, argmax;
- ``safeformer``: ``generate`` with its defaults (every branch in one batched forward; the static cache:
  one fixed-shape step per token, no host read in the loop);
- ``safeformer dynamic``: ``static_cache=False`` (the growing ``KVCache``, the previous default), the
  before/after of the static cache;
- ``safeformer compiled``: ``compile=True`` (on rows listed by ``--compiled``; the first, compiling
  generation is the warm-up and is not timed: compiling costs tens of seconds on a CPU, see the note);
- ``products floor``: not a generation but its arithmetic floor: for each new token, the matrix products
  of one decode step of safeformer's model (its own weights, every branch's rows: each self-attention's
  q/k/v/out, each cross-attention's q/out (the context's keys/values are projected once), the
  feed-forwards, the logits), nothing else. No implementation of the same float32 step can take less,
  so ``x-transformers time / floor time`` (the ``bound`` column) is the highest ratio any such
  implementation could reach in that row: a target above it is out of reach on the machine measured.

Cases: ``plain`` (no cross-attention), ``padded context`` (cross-attention to a context padded to random
lengths), ``left-padded prompts`` (safeformer: ``mask=``; x-transformers: ``prompt_lens=``, right-aligned;
x-transformers counts padding in the positions, safeformer does not, so tokens may differ there by
design), ``CFG 2 branches`` (padded context, ``cond_scale=3``: uncond + joint), ``CFG 3 branches``
(compositional guidance over the context and a prefix of 4 embeddings, ``prepend_embeds``: uncond,
context only, prefix only; x-transformers' dropped prefix is no prefix, which is what safeformer's
all-padding prefix equals; its cached forward is given the prefix on every call, as it needs).

The number is tokens/s of a safeformer contender / tokens/s of x-transformers, the median over
interleaved rounds of the per-round ratio (higher is better).

Usage:
    python benchmarks/generation_speed.py            # about 10 minutes on 2 CPU cores
    python benchmarks/generation_speed.py --quick    # smoke run, < 1 minute
"""

from __future__ import annotations

import json
import warnings

import torch
from common import base_parser, interleaved, machine, markdown_table, setup, write_results

# targets, tokens/s safeformer / x-transformers (the headline contender: the better of eager and compiled)
TARGETS = {("CFG 2 branches", 1): 3.0, ("CFG 2 branches", 16): 2.0, ("plain", 1): 2.5}
FLOOR = 1.0  # every other row: at least x-transformers' speed
CASES = ("plain", "padded context", "left-padded prompts", "CFG 2 branches", "CFG 3 branches")


def build(dim: int, depth: int, heads: int, vocab: int, max_len: int, cross: bool, device: torch.device,
          adaptive: bool = False):
    """x-transformers' wrapper and safeformer's wrapper around the same weights."""
    import x_transformers as xt

    import safeformer as sf

    extra = dict(use_adaptive_layernorm=True, dim_condition=dim // 4) if adaptive else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = xt.TransformerWrapper(
            num_tokens=vocab, max_seq_len=max_len,
            attn_layers=xt.Decoder(dim=dim, depth=depth, heads=heads, attn_dim_head=dim // heads, rotary_pos_emb=True,
                                   rotary_emb_dim=max(dim // heads // 2, 32), attn_flash=True, cross_attend=cross,
                                   **extra),
        )
    with torch.no_grad():  # move weights off their init (norm gains of exactly 1, zero biases)
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    sf_net = sf.from_x_transformers(net)
    return xt.AutoregressiveWrapper(net).to(device).eval(), sf.AutoregressiveWrapper(sf_net).to(device).eval()


@torch.no_grad()
def xt_guided(model, prompts: torch.Tensor, n_new: int, branches: list[tuple[float, dict]]) -> torch.Tensor:
    """Guided greedy decoding the way a user of x-transformers writes it: one forward (and one cache) per
    branch per step. ``branches``: ``[(scale, forward kwargs)]``, the first being the unconditional one
    (its scale unused): ``uncond + sum_k s_k (cond_k - uncond)``."""
    net = model.net
    caches = [None] * len(branches)
    out, x = prompts, prompts
    for _ in range(n_new):
        logits = []
        for i, (_, kw) in enumerate(branches):
            lg, caches[i] = net(x, cache=caches[i], return_intermediates=True, **kw)
            logits.append(lg[:, -1])
        guided = logits[0]
        for (s, _), lg in zip(branches[1:], logits[1:]):
            guided = guided + s * (lg - logits[0])
        out = torch.cat((out, guided.argmax(-1, keepdim=True)), dim=-1)
        x = out
    return out[:, prompts.shape[1]:]


def step_products(model, rows: int):
    """The matrix products of one decode step of safeformer's ``model`` (an ``AutoregressiveWrapper``) for
    ``rows`` samples (batch times branches), as ``(weight, bias, input)`` triples with the model's own
    weights: what ``products floor`` times (see the module docstring)."""
    from torch import nn

    net = model.net
    linears = []
    for blk in net.attn_layers.layers:
        if blk.kind == "self":
            linears += [blk.mixer.to_q, blk.mixer.to_k, blk.mixer.to_v, blk.mixer.to_out]
        elif blk.kind == "cross":  # the context's keys/values are projected once per generation
            linears += [blk.mixer.to_q, blk.mixer.to_out]
        else:
            linears += [m for m in blk.mixer.modules() if isinstance(m, nn.Linear)]
    linears += [m for m in net.to_logits.modules() if isinstance(m, nn.Linear)]
    p = next(net.parameters())
    return [(m.weight, m.bias, torch.randn(rows, 1, m.in_features, dtype=p.dtype, device=p.device)) for m in linears]


@torch.no_grad()
def run_products(products, n_new: int) -> None:
    """``n_new`` decode steps' matrix products and nothing else (the floor of ``step_products``)."""
    linear = torch.nn.functional.linear
    for _ in range(n_new):
        for w, bias, x in products:
            linear(x, w, bias)


def case_inputs(case: str, b: int, n: int, j: int, dim: int, vocab: int, device, g: torch.Generator):
    """``(cross, adaptive, xt run(model, n_new), sf kwargs)`` for one case."""
    prompts = torch.randint(0, vocab, (b, n), generator=g).to(device)
    context = torch.randn(b, j, dim, generator=g).to(device)
    ctx_mask = (torch.arange(j)[None] < torch.randint(1, j + 1, (b,), generator=g)[:, None]).to(device)
    none_mask = torch.zeros_like(ctx_mask)
    if case == "plain":
        return False, False, lambda m, k: m.generate(prompts, k, temperature=0.0, cache_kv=True), dict(prompts=prompts)
    if case == "padded context":
        kw = dict(context=context, context_mask=ctx_mask)
        return True, False, lambda m, k: m.generate(prompts, k, temperature=0.0, cache_kv=True, **kw), dict(prompts=prompts, **kw)
    if case == "left-padded prompts":
        lens = torch.randint(1, n + 1, (b,), generator=g)
        lens[0] = n
        right = torch.where(torch.arange(n)[None] < lens[:, None], prompts.cpu(), 0).to(device)
        left = torch.zeros_like(prompts)
        for s in range(b):
            left[s, n - int(lens[s]):] = right[s, : int(lens[s])]
        left_mask = (torch.arange(n)[None] >= (n - lens[:, None])).to(device)
        return (False, False, lambda m, k: m.generate(right, k, temperature=0.0, cache_kv=True, prompt_lens=lens.to(device)),
                dict(prompts=left, mask=left_mask))
    if case == "CFG 2 branches":
        branches = [(0.0, dict(context=context, context_mask=none_mask)), (3.0, dict(context=context, context_mask=ctx_mask))]
        return (True, False, lambda m, k: xt_guided(m, prompts, k, branches),
                dict(prompts=prompts, context=context, context_mask=ctx_mask, cond_scale=3.0))
    if case == "CFG 3 branches":
        prefix = torch.randn(b, 4, dim, generator=g).to(device)
        branches = [(0.0, dict(context=context, context_mask=none_mask)),
                    (2.0, dict(context=context, context_mask=ctx_mask)),
                    (1.5, dict(context=context, context_mask=none_mask, prepend_embeds=prefix))]
        return (True, False, lambda m, k: xt_guided(m, prompts, k, branches),
                dict(prompts=prompts, context=context, context_mask=ctx_mask, prepend_embeds=prefix,
                     cond_scale={"context": 2.0, "prepend": 1.5}))
    raise ValueError(case)


def verdict(best: float, target: float, bound: float) -> str:
    """The target column: met, not met, or out of reach (the products floor's bound is below the target)."""
    if best >= target:
        return f">= {target:.1f}x: met"
    if bound < target:
        return f">= {target:.1f}x: out of reach (bound {bound:.2f}x; {best / bound:.0%} of it reached)"
    return f">= {target:.1f}x: NOT met"


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=None, help="new tokens per sample (default 64)")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 16)")
    p.add_argument("--dims", type=int, nargs="+", default=None, help="model widths (default 256 512)")
    p.add_argument("--cases", nargs="+", default=None, choices=CASES)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--context-len", type=int, default=32)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--compiled", nargs="*", default=None,
                   help="rows 'case@batch@dim' that also time compile=True (default: plain and CFG 2 branches at "
                        "every batch and dim); none with an empty list")
    args = p.parse_args()
    device = setup(args)
    n_new = args.tokens or (16 if args.quick else 64)
    rounds = args.rounds or (2 if args.quick else 5)
    batches = args.batches or ([1] if args.quick else [1, 16])
    dims = args.dims or ([128] if args.quick else [256, 512])
    cases = args.cases or (("plain", "CFG 2 branches") if args.quick else CASES)
    compiled = set(args.compiled) if args.compiled is not None else (
        set() if args.quick else {f"{c}@{b}@{d}" for c in ("plain", "CFG 2 branches") for b in batches for d in dims})
    n, j = args.prompt_len, args.context_len

    rows, ratios, targets, bounds, notes = [], {}, {}, {}, []
    for dim in dims:
        for b in batches:
            for case in cases:
                g = torch.Generator().manual_seed(0)
                cross, adaptive, xt_run, sf_kw = case_inputs(case, b, n, j, dim, args.vocab, device, g)
                torch.manual_seed(0)
                xt_model, sf_model = build(dim, args.depth, args.heads, args.vocab, n + n_new + 8, cross, device, adaptive)
                prompts = sf_kw.pop("prompts")
                outs: dict[str, torch.Tensor] = {}

                def run(name, fn, outs=outs):
                    def go():
                        outs[name] = fn()
                    return go

                contenders = {
                    "x-transformers": run("xt", lambda m=xt_model, r=xt_run: r(m, n_new)),
                    "safeformer": run("sf", lambda m=sf_model, kw=sf_kw, prompts=prompts: m.generate(prompts, n_new, temperature=0.0, **kw)),
                    "safeformer dynamic": run("dyn", lambda m=sf_model, kw=sf_kw, prompts=prompts: m.generate(
                        prompts, n_new, temperature=0.0, static_cache=False, **kw)),
                }
                branches = 3 if case == "CFG 3 branches" else 2 if case == "CFG 2 branches" else 1
                products = step_products(sf_model, b * branches)
                contenders["products floor"] = lambda p=products: run_products(p, n_new)
                key = f"{case}@{b}@{dim}"
                if key in compiled:
                    contenders["safeformer compiled"] = run("comp", lambda m=sf_model, kw=sf_kw, prompts=prompts: m.generate(
                        prompts, n_new, temperature=0.0, compile=True, **kw))
                t = interleaved(contenders, rounds=rounds, device=device, warmup=1)
                speed = {name: 1.0 / t.ratio(name) for name in contenders if name != "x-transformers"}
                bound = speed.pop("products floor")
                same = torch.equal(outs["xt"], outs["sf"])
                agree = (outs["xt"] == outs["sf"]).float().mean().item()
                static_same = torch.equal(outs["sf"], outs["dyn"]) and ("comp" not in outs or torch.equal(outs["sf"], outs["comp"]))
                best = max(speed.get("safeformer", 0), speed.get("safeformer compiled", 0))
                target = TARGETS.get((case, b), FLOOR)
                rows.append([case, str(b), str(dim), f"{speed['safeformer']:.2f}x",
                             f"{speed['safeformer compiled']:.2f}x" if "safeformer compiled" in speed else "-",
                             f"{speed['safeformer dynamic']:.2f}x", f"{speed['safeformer'] / speed['safeformer dynamic']:.2f}x",
                             "yes" if same else f"no ({agree:.0%})", "yes" if static_same else "NO",
                             f"{bound:.2f}x", verdict(best, target, bound)])
                label = f"{case}, batch {b}, dim {dim}"
                ratios[label] = round(best, 4)
                targets[label] = target
                bounds[label] = round(bound, 4)
                print(" | ".join(rows[-1]), flush=True)

    header = ["case", "batch", "dim", "safeformer / xt", "compiled / xt", "dynamic cache / xt", "static / dynamic",
              "same tokens as xt", "static = dynamic (= compiled)", "bound (xt / products floor)",
              "target (best of eager, compiled)"]
    lines = [
        "# Guided and plain KV-cached generation: safeformer vs x-transformers",
        "",
        f"Machine: {machine(device)}.",
        f"Model: x-transformers Decoder depth={args.depth} heads={args.heads} (head dim dim/{args.heads}), rotary, "
        f"attn_flash=True, vocab {args.vocab}; safeformer runs the same weights (from_x_transformers). Prompts of {n} "
        f"tokens, {n_new} new tokens, greedy; context of {j} positions with random padding where used. "
        f"{rounds} interleaved rounds after 1 warm-up generation each (the warm-up compiles the compiled contender); "
        "ratio = x-transformers time / contender time in the same round (= tokens/s ratio, higher is better), "
        "median over rounds.",
        "",
        *markdown_table(header, rows),
        "",
        "x-transformers' guided rows run one forward and one cache per branch per step (its generate has no "
        "guidance); safeformer runs all branches in one batched forward. Left-padded prompts: x-transformers "
        "counts padding in the positions, safeformer does not, so tokens may differ there by design. "
        "`static / dynamic`: safeformer's static cache against its dynamic cache in the same rounds. "
        "`bound`: x-transformers' time over the time of safeformer's matrix products alone (one step's "
        "float32 products per new token, nothing else, in the same rounds): the highest ratio any implementation of the same "
        "step could reach here; a target above it is marked out of reach.",
        "",
        "Bounds: " + json.dumps(bounds),
    ]
    if device.type != "cuda":
        lines.append("Absolute tokens/s are not reported on a CPU (shared machine); ratios only.")
    lines += notes
    write_results("generation_speed", args, lines, ratios, targets, "generation: tokens/s safeformer / x-transformers")


if __name__ == "__main__":
    main()
