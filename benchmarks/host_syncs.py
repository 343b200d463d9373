"""Host syncs in a forward pass, a backward pass and a decode step, counted on CUDA.

Each case runs once to warm up, then again under ``torch.cuda.set_sync_debug_mode("warn")``, and the
warnings PyTorch raises for every synchronizing CUDA call are counted with the line of Python that made
them. A safe forward that reads nothing back to the host has 0; a decode loop that checks a stopping rule
on the host has at least one per token (``generate`` is reported as a whole, per token).

    python benchmarks/host_syncs.py --device cuda [--out benchmarks/results/host_syncs_cuda.md]

On the CPU the cases run (a dry run of the script) and nothing is counted: there is no device to wait for.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import safeformer as sf  # noqa: E402
from safeformer.decoding.static import StaticStep, capacity_bucket  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _where(w: warnings.WarningMessage) -> str:
    path = os.path.relpath(w.filename, ROOT) if w.filename.startswith(ROOT) else os.path.basename(w.filename)
    return f"{path}:{w.lineno}"


def count_syncs(fn, device: str) -> tuple[int | None, list[str]]:
    """Run ``fn`` once to warm up, then again counting synchronizing calls (None on the CPU)."""
    fn()
    if device != "cuda":
        fn()
        return None, []
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    places = collections.Counter(_where(w) for w in syncs)
    return len(syncs), [f"{p} ({n})" for p, n in places.most_common(4)]


def build(device: str, dim: int, cross: bool = False):
    torch.manual_seed(0)
    net = sf.TransformerWrapper(num_tokens=256, max_seq_len=1024,
                                attn_layers=sf.Decoder(dim=dim, depth=2, heads=4, rotary_pos_emb=True,
                                                       cross_attend=cross))
    return net.to(device)


def cases(device: str, dim: int = 256, b: int = 4, n: int = 128):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (b, n), generator=g).to(device)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, : n // 2] = False  # left padding
    mask[2] = False  # an all-padding sample
    mask = mask.to(device)
    net = build(device, dim)

    def fwd_bwd():
        net.zero_grad(set_to_none=True)
        logits = net(x, mask=mask)
        logits.float().square().mean().backward()

    def fwd():
        with torch.no_grad():
            net(x, mask=mask)

    xnet = build(device, dim, cross=True)
    ctx = torch.randn(b, 32, dim, generator=g).to(device)
    cmask = torch.ones(b, 32, dtype=torch.bool)
    cmask[0] = False  # a dropped condition: no key to attend
    cmask[3, 5:] = False
    cmask = cmask.to(device)

    def cross_fwd_bwd():
        xnet.zero_grad(set_to_none=True)
        xnet(x, mask=mask, context=ctx, context_mask=cmask).float().square().mean().backward()

    prompt = x[:, : n // 2]
    pmask = torch.ones(b, n // 2, dtype=torch.bool)
    pmask[1, : n // 4] = False  # a left-padded prompt (generation needs a real token per prompt)
    pmask = pmask.to(device)
    new = x[:, n // 2: n // 2 + 1]

    def prefill():
        with torch.no_grad():
            _, cache = net(prompt, mask=pmask, return_cache=True)
        return cache

    def dynamic_step():
        cache = prefill()
        with torch.no_grad():
            net(new, cache=cache, return_cache=True)

    def static_step(compile: bool):
        cache = prefill()
        need = cache.length + 8
        dec = StaticStep(net, cache, capacity_bucket(need) if compile else need, compile=compile)
        with torch.no_grad():
            dec.step(new)  # warm-up step (and the compilation)
        return dec

    decoders = {}

    def static_eager():
        with torch.no_grad():
            decoders.setdefault("eager", static_step(False)).step(new)

    def static_compiled():
        with torch.no_grad():
            decoders.setdefault("compiled", static_step(True)).step(new)

    wrapper = sf.AutoregressiveWrapper(net)

    def generate():
        wrapper.generate(prompt, 16, mask=pmask, cache_kv=True)

    return [
        ("forward, left padding and an all-padding sample", fwd),
        ("forward + backward, same inputs", fwd_bwd),
        ("cross-attention forward + backward, a dropped and a padded context", cross_fwd_bwd),
        ("dynamic decode step (prefill + one cached step)", dynamic_step),
        ("static decode step, eager (one step)", static_eager),
        ("static decode step, compiled (one step)", static_compiled),
        ("generate, 16 tokens, cached (whole call)", generate),
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="markdown file (default <out-dir>/host_syncs<tag>.md)")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--tag", default=None, help="suffix of the file name (default _<device>)")
    p.add_argument("--quick", action="store_true", help="the same cases (they are small); for the scripts' --quick")
    p.add_argument("--skip-compiled", action="store_true", help="leave out the compiled static step")
    args = p.parse_args(argv)
    device = args.device
    rows, bad = [], 0
    for name, fn in cases(device):
        if args.skip_compiled and "compiled" in name:
            continue
        try:
            n, places = count_syncs(fn, device)
            rows.append((name, "not counted (CPU)" if n is None else str(n), ", ".join(places) or "-"))
        except Exception as err:  # noqa: BLE001  # the table says which case broke and how
            bad += 1
            rows.append((name, "ERROR", f"{type(err).__name__}: {str(err)[:160]}"))
        print(f"{rows[-1][0]}: {rows[-1][1]} {rows[-1][2]}", flush=True)
    dev_name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    lines = [f"# Host syncs ({dev_name}, torch {torch.__version__})", "",
             "Synchronizing CUDA calls counted under `torch.cuda.set_sync_debug_mode(\"warn\")` after one warm-up "
             "run; TransformerWrapper, Decoder(dim=256, depth=2, heads=4, rotary), batch 4, 128 tokens.", "",
             "| case | syncs | where (count) |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    tag = args.tag if args.tag is not None else f"_{device}"
    out = args.out or os.path.join(args.out_dir, f"host_syncs{tag}.md")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"summary: {len(rows)} cases, {bad} errors; table in {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
