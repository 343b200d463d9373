"""Contract cases for x-transformers' key/value residuals and extra keys/values given to the stack.

Each case subclasses a case of ``models.py`` (imported from there at the end of that module) and joins its
``CASES``; a case that runs on the padded path only sets ``padded_only = True``.
"""

from __future__ import annotations

import torch

from .masks import plant
from .models import DIM, DIM_HEAD, HEADS, DecoderCase, Inputs, _randn

EXTRA_KEYS = 3  # added keys per self-attention block


class DecoderExtraKVCase(DecoderCase):
    """``Decoder`` with cross-attention, fed x-transformers' ``self_attn_additional_kv`` (one ``(k, v)`` pair per
    self-attention block, ``HEADS`` heads against the stack's one key/value head, with a padding mask
    ``additional_kv_mask`` that drops every added key of some samples) and ``self_attn_kv_residuals`` (one per
    block, added to the keys'/values' input). Garbage is planted at masked added keys/values and at the padded
    rows of the residuals too; alone, a sample's masked added keys are removed. The cache does not keep the
    added keys: decoding passes them (and the new positions' residuals) on every call. Padded path only."""

    name = "Decoder-extra-kv"
    padded_only = True

    def _added_mask(self, sc) -> torch.Tensor:
        g = torch.Generator().manual_seed(sc.seed + 7)
        m = torch.rand(sc.b, EXTRA_KEYS, generator=g) < 0.6
        m[0] = False  # a sample with no added key at all
        return m

    def dead(self, sc):
        # a query with no real key of the sequence at or before it still sees its sample's real added keys
        out = super().dead(sc)
        out["main.self"] = out["main.self"] & ~self._added_mask(sc).any(1, keepdim=True)
        return out

    def inputs(self, sc, dtype=torch.float32):
        inp = super().inputs(sc, dtype)
        g = torch.Generator().manual_seed(sc.seed + 11)
        kv, leaves = [], dict(inp.leaves)
        for layer in range(2):
            k = _randn(g, sc.b, HEADS, EXTRA_KEYS, DIM_HEAD, dtype=dtype)
            v = _randn(g, sc.b, HEADS, EXTRA_KEYS, DIM_HEAD, dtype=dtype)
            kv.append((k, v))
            leaves[f"k{layer}"], leaves[f"v{layer}"] = k, v
        res = _randn(g, 2, sc.b, sc.n, DIM, dtype=dtype)
        leaves["kv_residuals"] = res
        kwargs = dict(inp.kwargs, self_attn_additional_kv=kv, additional_kv_mask=self._added_mask(sc),
                      self_attn_kv_residuals=res)
        return Inputs(inp.args, kwargs, leaves, dict(inp.planted))

    def plant(self, inp, sc, value):
        out = super().plant(inp, sc, value)
        amask = inp.kwargs["additional_kv_mask"]
        where_kv = ~amask[:, None, :, None].expand(-1, HEADS, -1, DIM_HEAD)
        kv, leaves, planted = [], dict(out.leaves), dict(out.planted)
        for layer, (k, v) in enumerate(inp.kwargs["self_attn_additional_kv"]):
            pk = plant(k.detach(), where_kv, value).requires_grad_(k.requires_grad)
            pv = plant(v.detach(), where_kv, value).requires_grad_(v.requires_grad)
            kv.append((pk, pv))
            leaves[f"k{layer}"], leaves[f"v{layer}"] = pk, pv
            planted[f"k{layer}"] = planted[f"v{layer}"] = where_kv
        res = inp.kwargs["self_attn_kv_residuals"]
        where_res = ~sc.seq_mask[None, :, :, None].expand_as(res)
        pres = plant(res.detach(), where_res, value).requires_grad_(res.requires_grad)
        leaves["kv_residuals"], planted["kv_residuals"] = pres, where_res
        kwargs = dict(out.kwargs, self_attn_additional_kv=kv, additional_kv_mask=amask, self_attn_kv_residuals=pres)
        return Inputs(out.args, kwargs, leaves, planted)

    def alone(self, inp, sc, s):
        out = super().alone(inp, sc, s)
        keep = inp.kwargs["additional_kv_mask"][s]
        kv = [(k[s : s + 1, :, keep], v[s : s + 1, :, keep]) for k, v in inp.kwargs["self_attn_additional_kv"]]
        res = inp.kwargs["self_attn_kv_residuals"][:, s : s + 1, sc.seq_mask[s]]
        kwargs = dict(out.kwargs, self_attn_additional_kv=kv, self_attn_kv_residuals=res)
        return Inputs(out.args, kwargs, out.leaves)

    def decode(self, model, inp, sc, prefix):
        x, kw = inp.args[0], inp.kwargs
        extra = dict(self_attn_additional_kv=kw["self_attn_additional_kv"], additional_kv_mask=kw["additional_kv_mask"])
        res = kw["self_attn_kv_residuals"]
        out, cache = model(x[:, :prefix], mask=kw["mask"][:, :prefix], context=kw["context"],
                           context_mask=kw["context_mask"], self_attn_kv_residuals=res[:, :, :prefix],
                           return_cache=True, **extra)
        outs = [out]
        for t in range(prefix, sc.n):
            out, cache = model(x[:, t : t + 1], mask=kw["mask"][:, t : t + 1], cache=cache, return_cache=True,
                               self_attn_kv_residuals=res[:, :, t : t + 1], **extra)
            outs.append(out)
        return torch.cat(outs, dim=1)

    def bad_calls(self, model, inp):
        x, kw = inp.args[0], inp.kwargs
        b, n = x.shape[:2]
        kv, amask = kw["self_attn_additional_kv"], kw["additional_kv_mask"]
        return super().bad_calls(model, inp) + [
            ("additional_kv_mask without keys", lambda: model(x, additional_kv_mask=amask), ValueError, "additional_kv_mask"),
            ("int additional_kv_mask", lambda: model(x, self_attn_additional_kv=kv, additional_kv_mask=amask.long()),
             TypeError, "additional_key_value_mask"),
            ("additional_kv_mask of wrong length", lambda: model(x, self_attn_additional_kv=kv,
                                                                 additional_kv_mask=amask[:, 1:]), ValueError, "additional_key_value_mask"),
            ("added keys of wrong head dim", lambda: model(x, self_attn_additional_kv=[(t[..., 1:], t[..., 1:]) for t, _ in kv]),
             ValueError, "additional_key_values"),
            ("more residuals than blocks", lambda: model(x, self_attn_kv_residuals=torch.randn(3, b, n, DIM)),
             ValueError, "self_attn_kv_residuals"),
        ]


CASES: list = [DecoderExtraKVCase()]
