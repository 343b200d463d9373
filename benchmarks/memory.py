"""Peak memory of attention with a padding mask vs without a mask, at a long sequence.

Each row runs the same computation twice, once with no mask and once with a key padding mask
``(b, n)`` (random lengths, the last sample fully padded: dead rows), and reports the peak memory of
the masked run over the unmasked one. It also checks that no dense ``(b, h, i, j)`` tensor (a mask, a
bias, a score matrix) is ever created: with a padding mask the largest mask-like tensor is
``(b, 1, 1, j)``, or ``(b, 1, i, j)`` once a causal mask is combined with it.

Rows (float32 by default):
- ``attend`` forward (no grad) and forward+backward, on leaf q, k, v (the caller keeps them alive);
- ``Attention`` module (projections + attend), self-attention, forward+backward;
- ``Decoder`` (``TransformerWrapper``, 2 layers, causal) next-token loss forward+backward: the
  training-time footprint where the padding mask is combined with the causal one.

How memory is measured:
- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (all live tensors,
  kernel workspaces included).
- CPU (PyTorch has no CPU allocator statistics): a ``TorchDispatchMode`` sees every tensor every aten
  op returns, forward and backward. A result whose storage is not one of the op's inputs' storages is
  a new allocation: its bytes are added to a running total and a ``weakref.finalize`` on the storage
  subtracts them when the storage is freed (PyTorch keeps one Python object per storage, so the
  finalizer runs exactly when the memory is released). The peak of that total, plus the bytes of the
  inputs and parameters that already existed, is the peak footprint. Scratch buffers that a fused
  kernel allocates and frees inside itself are not seen (the same kernel runs in both columns); every
  tensor that lives between ops, including masks, saved activations and gradients, is.

Usage:
    python benchmarks/memory.py           # seq 4096, well under a minute on a CPU
    python benchmarks/memory.py --quick   # seq 1024
"""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.nn.functional as F
from common import base_parser, machine, markdown_table, setup, write_results
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

TARGET = 1.10  # padding-mask peak / unmasked peak


class TensorMemory(TorchDispatchMode):
    """Counts the bytes of tensor storages that aten ops allocate while the mode is active.

    Attributes:
        live: bytes allocated inside the window and not yet freed.
        peak: the largest ``live`` seen.
        dense: ``(op, shape, dtype)`` of every result whose storage holds ``b * h * i * j`` elements or
            more (set ``dense_numel``), i.e. a materialised dense attention-sized tensor.
    """

    def __init__(self, dense_numel: int | None = None):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.dense_numel = dense_numel
        self.dense: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self._owned: dict[int, int] = {}

    def _free(self, key: int, nbytes: int) -> None:
        if self._owned.pop(key, None) is not None:
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if self.dense_numel is not None and storage.nbytes() >= self.dense_numel * t.element_size():
                self.dense.append((str(func), tuple(t.shape), t.dtype))  # materialised, not a broadcast view
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in inputs or key in self._owned:
                continue  # a view or an in-place result of an input, or already counted
            self._owned[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, nbytes)
        return out


def tensor_bytes(*objs) -> int:
    """Bytes of the distinct storages of the tensors (and modules' parameters/buffers) given."""
    seen = {}
    for o in objs:
        ts = list(o.parameters()) + list(o.buffers()) if isinstance(o, torch.nn.Module) else [o]
        for t in ts:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def measure(fn, device: torch.device, existing: int, dense_numel: int) -> tuple[int, int, list]:
    """(peak footprint in bytes incl. ``existing``, peak of new allocations, dense tensors seen)."""
    if device.type == "cuda":
        fn()  # warm-up (lazy init, cuBLAS workspaces)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        with TensorMemory(dense_numel) as mode:  # for the dense-tensor check only
            fn()
        return peak, peak - base, mode.dense
    with TensorMemory(dense_numel) as mode:
        fn()
    return existing + mode.peak, mode.peak, mode.dense


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 4096; --quick 1024)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim-head", type=int, default=64)
    args = p.parse_args()
    device = setup(args)
    import safeformer as sf

    n = args.seq or (1024 if args.quick else 4096)
    b, h, d = args.batch, args.heads, args.dim_head
    dim = h * d
    dense = b * h * n * n
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(n // 2, n + 1, (b,), generator=g)
    lengths[-1] = 0  # a fully padded sample: dead rows
    mask = (torch.arange(n)[None] < lengths[:, None]).to(device)  # (b, n)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(device).requires_grad_() for _ in range(3))
    grad_out = torch.randn(b, h, n, d, generator=g).to(device)
    attn = sf.Attention(dim, heads=h, dim_head=d).to(device)
    x = torch.randn(b, n, dim, generator=g).to(device).requires_grad_()
    def stack(lib: str, causal: bool):
        if lib == "sf":
            layers = (sf.Decoder if causal else sf.Encoder)(dim=dim, depth=2, heads=h, dim_head=d, rotary_pos_emb=True)
            return sf.TransformerWrapper(num_tokens=256, max_seq_len=n, attn_layers=layers).to(device)
        import x_transformers as xt

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            layers = (xt.Decoder if causal else xt.Encoder)(dim=dim, depth=2, heads=h, attn_dim_head=d,
                                                            rotary_pos_emb=True, attn_flash=True)
            return xt.TransformerWrapper(num_tokens=256, max_seq_len=n, attn_layers=layers).to(device)

    tokens = torch.randint(0, 256, (b, n), generator=g).to(device)
    labels = torch.randint(0, 256, (b, n), generator=g).to(device)
    ignore = torch.where(mask, labels, -100)  # padded targets do not count

    def zero_grads(*objs):
        for o in objs:
            for t in (o.parameters() if isinstance(o, torch.nn.Module) else [o]):
                t.grad = None

    def attend_fwd(m):
        def f():
            with torch.no_grad():
                sf.attend(q, k, v, mask=m)
        return f

    def attend_fwd_bwd(m):
        def f():
            sf.attend(q, k, v, mask=m).backward(grad_out)
            zero_grads(q, k, v)
        return f

    def module_fwd_bwd(m):
        def f():
            out = attn(x, mask=None if m is None else m[:, None, None, :])
            out.sum().backward()
            zero_grads(attn, x)
        return f

    def stack_fwd_bwd(net):
        def make(m):
            def f():
                logits = net(tokens, mask=m)  # (b, n, v)
                target = (labels if m is None else ignore).flatten()
                F.cross_entropy(logits.flatten(0, 1), target, ignore_index=-100).backward()
                zero_grads(net)
            return f
        return make

    rows_spec = [  # name, safeformer's maker, bytes that exist before, x-transformers' (maker, bytes) or None
        ("attend, forward (no grad)", attend_fwd, tensor_bytes(q, k, v, mask), None),
        ("attend, forward+backward", attend_fwd_bwd, tensor_bytes(q, k, v, grad_out, mask), None),
        ("Attention module (self), forward+backward", module_fwd_bwd, tensor_bytes(attn, x, mask), None),
    ]
    for label, causal in (("Encoder", False), ("Decoder (causal)", True)):
        sf_net, xt_net = stack("sf", causal), stack("xt", causal)
        rows_spec.append((f"{label}, 2 layers, loss forward+backward", stack_fwd_bwd(sf_net),
                          tensor_bytes(sf_net, tokens, mask), (stack_fwd_bwd(xt_net), tensor_bytes(xt_net, tokens, mask))))
    rows, ratios, targets, dense_seen, xt_dense = [], {}, {}, [], []
    for name, make, existing, peer in rows_spec:
        peak0, new0, d0 = measure(make(None), device, existing, dense)
        peak1, new1, d1 = measure(make(mask), device, existing, dense)
        dense_seen += [(name, "no mask", *t) for t in d0] + [(name, "padding", *t) for t in d1]
        ratio = peak1 / peak0
        peer_cell = "-"
        if peer is not None:
            xt0, _, _ = measure(peer[0](None), device, peer[1], dense)
            xt1, _, xd = measure(peer[0](mask), device, peer[1], dense)
            xt_dense += [(name, *t) for t in xd]
            peer_cell = f"{xt1 / xt0:.3f}x ({len(xd)})"
        rows.append([name, f"{peak0 / 2**20:.1f}", f"{peak1 / 2**20:.1f}", f"{ratio:.3f}x",
                     f"{new0 / 2**20:.1f}", f"{new1 / 2**20:.1f}", len(d1), peer_cell])
        ratios[name] = round(ratio, 4)
        targets[name] = TARGET

    method = ("torch.cuda.max_memory_allocated" if device.type == "cuda" else
              "tensor accounting (TorchDispatchMode + storage finalizers; see the script's docstring)")
    lines = [
        "# Peak memory: attention with a padding mask vs without a mask",
        "",
        f"Machine: {machine(device)}.",
        f"Sequence n = {n}, batch {b}, heads {h}, head dim {d}, float32. Padding mask (b, n) with random lengths "
        f"in [n/2, n] and the last sample fully padded (dead rows). Method: {method}. Peak = the largest "
        "footprint during the call, counting the inputs and parameters that exist before it; 'new' = the peak of "
        "what the call allocates. A dense (b, h, i, j) float32 tensor would be "
        f"{dense * 4 / 2**20:.0f} MiB.",
        "",
        *markdown_table(["computation", "no mask: peak MiB", "padding mask: peak MiB", "padding / no mask",
                         "no mask: new MiB", "padding: new MiB", "dense (b,h,i,j) tensors",
                         "x-transformers padding / no mask (dense tensors)"], rows),
        "",
        f"Target: padding / no mask <= {TARGET:.2f}x. Dense (b, h, i, j) tensors seen in any run: {len(dense_seen)}.",
    ]
    for nm, kind, op, shape, dt in dense_seen:
        lines.append(f"- {nm} ({kind}): {op} -> {shape} {dt}")
    if xt_dense:
        shapes = sorted({(op, shape, str(dt)) for _, op, shape, dt in xt_dense})
        lines.append("x-transformers (same settings, attn_flash=True) with the padding mask creates dense tensors: "
                     + "; ".join(f"{op} -> {shape} {dt}" for op, shape, dt in shapes[:4]) + ".")
    write_results("memory", args, lines, ratios, targets, "peak memory: padding mask / no mask")


if __name__ == "__main__":
    main()
