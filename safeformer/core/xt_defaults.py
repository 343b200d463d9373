"""x-transformers' keywords that safeformer takes at x-transformers' default value only.

The default is what safeformer does; another value is a ``TypeError`` that names the keyword (never silently
ignored). ``XT_DEFAULT_ONLY`` holds the stack's spellings (``AttentionLayers``' keywords and the ``attn_`` forms of
``Attention``'s); ``Attention`` itself takes the ``attn_`` ones without the prefix (``ATTENTION_DEFAULT_ONLY``).
No safeformer imports: the stack and the attention module both read it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable

XT_DEFAULT_ONLY: dict[str, object] = {
    "attn_dim_context": None, "attn_dim_out": None, "attn_learned_value_residual_mix": False,
    "attn_qkv_receive_diff_residuals": False, "attn_rotate_num_heads": None,
}

# among them, those x-transformers 2.31.10's own stack refuses at another value too (it sets them on each block
# itself: a second value is a duplicate keyword, or the block's shapes no longer fit): here the default-only rule is
# x-transformers' behaviour (tests/test_xt_keywords.py builds each in x-transformers and sees it fail)
XT_REFUSES_TOO = ("attn_dim_context", "attn_dim_out", "attn_learned_value_residual_mix",
                  "attn_qkv_receive_diff_residuals", "attn_rotate_num_heads")

# Attention's own keywords among them (safeformer's Attention has dim_context, dim_out, inverted_attention and
# learned_value_residual_mix itself); onnxable is accepted with any value (no effect on the numbers)
ATTENTION_DEFAULT_ONLY: dict[str, object] = {
    k.removeprefix("attn_"): v for k, v in XT_DEFAULT_ONLY.items()
    if k.startswith("attn_") and k not in ("attn_dim_context", "attn_dim_out", "attn_inverted_attention",
                                           "attn_learned_value_residual_mix", "attn_aggregated_residuals",
                                           "attn_aggregated_residual_kwargs", "attn_rotate_num_heads",
                                           "attn_qkv_receive_diff_residuals")
}
ATTENTION_ANY_VALUE = ("onnxable",)


def same(v, default) -> bool:
    """``v`` is x-transformers' default value (a bool is not a number here)."""
    if isinstance(v, bool) != isinstance(default, bool):
        return False
    try:
        return bool(v == default)
    except Exception:  # noqa: BLE001  # a tensor or another value without a plain ==
        return False


def default_only(name: str, default) -> Callable[[object], dict]:
    """An alias-table entry: ``name`` accepted at ``default``, refused (``_unsupported``) at any other value."""
    return lambda v: {} if same(v, default) else {"_unsupported": f"{name}={v!r}"}


def check_xt_options(owner: str, given: dict, table: dict, any_value: Iterable[str], valid: Iterable[str]) -> None:
    """``given`` (keywords beyond ``owner``'s own) checked against ``table``: each at its default value, or one of
    ``any_value``.

    Raises:
        TypeError: an unknown keyword (the closest of ``valid`` and the table suggested), or an x-transformers
            keyword at a value safeformer does not build.
    """
    for key, value in given.items():
        if key in any_value:
            continue
        if key not in table:
            close = difflib.get_close_matches(key, sorted(set(valid) | set(table)), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {key!r}{hint}")
        if not same(value, table[key]):
            raise TypeError(f"{owner}: x-transformers' option {key}={value!r} is not supported by safeformer")
