"""DecodeOptions: how to decode, beside what to sample (SamplingParams): the fast paths and the cache's elements.

Every entry point of gptkit.decoding.api takes one DecodeOptions; the public functions (generate, generate_ids,
stream) also take its fields as keywords, next to SamplingParams' fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gptkit.decoding.lookup import LOOKUP_K, LOOKUP_NGRAM, Lookup
from gptkit.decoding.sampling import SamplingParams
from gptkit.decoding.speculative import DRAFT_K
from gptkit.errors import ConfigError
from gptkit.model import GPT

_SAMPLING = tuple(f.name for f in dataclasses.fields(SamplingParams))


@dataclass(frozen=True)
class DecodeOptions:
    """The decoding path: compile (a compiled decode step), draft and draft_k (speculative decoding with a smaller
    model proposing draft_k tokens per target pass), kv_cache ("int8" stores the keys and values as int8), and
    lookup (speculation without a draft: up to lookup_k tokens that followed an earlier match of the last
    lookup_ngram..1 tokens, gptkit.decoding.lookup)."""

    compile: bool = False
    draft: GPT | None = None
    draft_k: int = DRAFT_K
    kv_cache: str | None = None
    lookup: bool = False
    lookup_k: int = LOOKUP_K
    lookup_ngram: int = LOOKUP_NGRAM

    def lookup_proposer(self) -> Lookup | None:
        """The lookup that proposes tokens, or None without lookup; a ConfigError beside a draft model."""
        if not self.lookup:
            return None
        if self.draft is not None:
            raise ConfigError("lookup and a draft model are two ways to speculate: choose one")
        return Lookup(self.lookup_k, self.lookup_ngram)


_OPTIONS = tuple(f.name for f in dataclasses.fields(DecodeOptions))


def split_overrides(
    params: SamplingParams | None, options: DecodeOptions | None, overrides: dict[str, Any]
) -> tuple[SamplingParams, DecodeOptions]:
    """params and options (or their defaults) with the keyword overrides that name their fields replaced; an
    unknown keyword is a ConfigError naming it."""
    unknown = sorted(set(overrides) - set(_SAMPLING) - set(_OPTIONS))
    if unknown:
        raise ConfigError(
            f"unknown sampling parameter {unknown[0]!r}; the parameters are: {', '.join(_SAMPLING)}; "
            f"the decoding options are: {', '.join(_OPTIONS)}"
        )
    sampling = {name: value for name, value in overrides.items() if name in _SAMPLING}
    decoding = {name: value for name, value in overrides.items() if name in _OPTIONS}
    return (
        dataclasses.replace(params or SamplingParams(), **sampling),
        dataclasses.replace(options or DecodeOptions(), **decoding),
    )
