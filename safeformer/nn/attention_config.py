"""``AttentionConfig``: every keyword of an ``Attention``, as one frozen value of typed option families.

Each family is declared beside the part that reads it (``options.Options``): ``HeadOptions`` here (heads, their
pairing, dropout, the kernel, the value width, the inputs), ``ProjectionOptions`` and ``NormOptions``
(``attention_projections``), ``ScoringOptions`` (the scoring part ``attend``) and ``LogitOptions``
(``attention_scoring``), ``BiasOptions`` (``attention_bias``), ``KeyOptions`` (``attention_keys``),
``OutputOptions`` and ``GateOptions`` (``attention_output``), ``HybridOptions`` (``hybrid``).

``Attention``'s signature, the stack's ``attn_<name>`` / ``cross_attn_<name>`` keywords, which of them stay out of
cross-attention (``self_only``) and a saved config's types are read from these fields: a new option is a field in
its family's file and the code that reads it there.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field

from ..core.xt_defaults import ATTENTION_ANY_VALUE, ATTENTION_DEFAULT_ONLY, check_xt_options
from .attention_bias import BiasOptions
from .attention_keys import KeyOptions
from .attention_output import GateOptions, OutputOptions
from .attention_projections import NormOptions, ProjectionOptions
from .attention_scoring import LogitOptions, ScoringOptions
from .hybrid import HybridOptions
from .options import Options, unknown_keyword

__all__ = ["AttentionConfig", "HeadOptions"]


@dataclass(frozen=True)
class HeadOptions(Options):
    """The heads and inputs of an attention (x-transformers' names).

    kv_heads, one_kv_head, kv_head_order: grouped key/value heads and which one a query head reads (``Attention``'s
    docstring); dropout: attention dropout; backend: ``attend``'s backend; value_dim_head: the value head width;
    qkv_receive_diff_residuals: a call's ``x`` holds the queries', keys' and values' inputs; flash_pack_seq: calls
    take ``flash_pack_seq_kwargs`` (``Attention._init_inputs``).
    """

    kv_heads: int | None = None
    one_kv_head: bool = False
    kv_head_order: str = "tiled"
    dropout: float = 0.0
    backend: str = "auto"
    value_dim_head: int | None = None
    qkv_receive_diff_residuals: bool = False
    flash_pack_seq: bool = False


@dataclass(frozen=True)
class AttentionConfig:
    """One ``Attention``'s keywords: x-transformers' six positional ones, then one value per option family.

    Built once, at the door: ``AttentionConfig.from_keywords(dim, ..., **keywords)`` (what ``Attention(...)``
    does) routes each keyword to its family, whose creation checks its type; an unknown keyword is a ``TypeError``
    naming it with the closest ones suggested; x-transformers' keywords safeformer does not build are accepted at
    their default value only. ``Attention.from_config(config)`` builds the module from a config without checking
    the keywords again (a stack builds its blocks so, from one config per kind).
    """

    dim: int
    dim_head: int = 64
    dim_context: int | None = None
    heads: int = 8
    causal: bool = False
    flash: bool = False
    core: HeadOptions = field(default_factory=HeadOptions)
    projections: ProjectionOptions = field(default_factory=ProjectionOptions)
    norms: NormOptions = field(default_factory=NormOptions)
    scoring: ScoringOptions = field(default_factory=ScoringOptions)
    logits: LogitOptions = field(default_factory=LogitOptions)
    biases: BiasOptions = field(default_factory=BiasOptions)
    keys: KeyOptions = field(default_factory=KeyOptions)
    output: OutputOptions = field(default_factory=OutputOptions)
    gates: GateOptions = field(default_factory=GateOptions)
    hybrid: HybridOptions = field(default_factory=HybridOptions)

    @classmethod
    def from_keywords(cls, dim: int, dim_head: int = 64, dim_context: int | None = None, heads: int = 8,
                      causal: bool = False, flash: bool = False, **keywords) -> AttentionConfig:
        """The config of ``Attention(dim, dim_head, dim_context, heads, causal, flash, **keywords)``.

        Raises:
            TypeError: an unknown keyword (with suggestions), a keyword of the wrong type, or an x-transformers
                keyword at a value safeformer does not build.
        """
        given = dict(keywords)
        families = {name: kind.take(given) for name, kind in FAMILIES.items()}
        if given:  # x-transformers' other keywords: at their default value only (xt_defaults), else by name
            check_xt_options("Attention", given, ATTENTION_DEFAULT_ONLY, ATTENTION_ANY_VALUE, FIELDS)
        return cls(dim, dim_head, dim_context, heads, causal, flash, **families)

    def replace(self, **changes) -> AttentionConfig:
        """This config with ``changes`` (keywords of any family, or the positional ones) applied."""
        top = {k: changes.pop(k) for k in list(changes) if k in _POSITIONAL}
        families = {}
        for name, kind in FAMILIES.items():
            mine = {k: changes.pop(k) for k in list(changes) if k in kind.names()}
            if mine:
                families[name] = dataclasses.replace(getattr(self, name), **mine)
        if changes:
            raise unknown_keyword("Attention", next(iter(changes)), FIELDS)
        return dataclasses.replace(self, **top, **families)

    def keywords(self) -> dict[str, object]:
        """Every keyword with its value (the positional ones first)."""
        out = {k: getattr(self, k) for k in _POSITIONAL}
        for name in FAMILIES:
            family = getattr(self, name)
            out.update({k: getattr(family, k) for k in family.names()})
        return out


FAMILIES: dict[str, type[Options]] = {
    f.name: f.default_factory for f in dataclasses.fields(AttentionConfig) if f.default_factory is not dataclasses.MISSING}
_POSITIONAL = ("dim", "dim_head", "dim_context", "heads", "causal", "flash")
# every keyword-only keyword, by family order: (name -> its inspect.Parameter)
FIELDS: dict[str, inspect.Parameter] = {p.name: p for kind in FAMILIES.values() for p in kind.parameters()}
# the keywords a stack keeps out of its cross-attention blocks
SELF_ONLY: frozenset[str] = frozenset().union(*(kind.self_only() for kind in FAMILIES.values()))
HINTS: dict[str, object] = {k: v for kind in FAMILIES.values() for k, v in kind.hints().items()}


def signature(first: inspect.Signature) -> inspect.Signature:
    """``first`` (x-transformers' six positional parameters) followed by every family's keywords and
    ``**xt_options`` (x-transformers' other keywords, at their default)."""
    params = [p for p in first.parameters.values() if p.kind != p.VAR_KEYWORD]
    return first.replace(parameters=[*params, *FIELDS.values(),
                                     inspect.Parameter("xt_options", inspect.Parameter.VAR_KEYWORD)])
