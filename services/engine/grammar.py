"""Grammar-constrained decoding: structured outputs (JSON mode, JSON schemas) and forced tool
calls, with llguidance.

Why llguidance: a 3 MB self-contained wheel (no torch, triton or compiler dependency), JSON
schemas and Lark grammars, masks computed per token in microseconds with an Earley parser over a
token trie (no per-grammar precomputation over the vocabulary). xgrammar pulls triton and an
unpinned torch.

A request carries a JSON schema (`SamplingParams.json_schema`); the engine turns it into a
`Matcher` per request, asks every constrained row of a step for its allowed tokens (one
[rows, vocab] bool mask, filled by llguidance's thread pool), and feeds each sampled token back.
JSON is compact (no optional whitespace), so no token is spent on layout.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from typing import Any

import llguidance as llg
import numpy as np
import torch

JSON_OPTIONS = {"whitespace_flexible": False}
MAX_SCHEMA_BYTES = 64 * 1024


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled (the message says why)."""


def _key(schema: dict[str, Any]) -> str:
    """A schema's canonical JSON text (the cache key of its grammar)."""
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be a JSON object")
    try:
        key = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None
    if len(key) > MAX_SCHEMA_BYTES:
        raise GrammarError(f"the JSON schema is larger than {MAX_SCHEMA_BYTES} bytes")
    return key


@functools.lru_cache(maxsize=256)
def _compiled(key: str) -> str | GrammarError:
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(key, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        return GrammarError(f"invalid JSON schema: {e}")
    error = llg.LLMatcher.validate_grammar(grammar)
    return GrammarError(f"invalid JSON schema: {error}") if error else grammar


def json_grammar(schema: dict[str, Any]) -> str:
    """A JSON schema -> llguidance grammar text (cached); raises GrammarError for an invalid one."""
    grammar = _compiled(_key(schema))
    if isinstance(grammar, GrammarError):
        raise grammar
    return grammar


def check_json_schema(schema: dict[str, Any]) -> None:
    """Raise GrammarError unless `schema` compiles (no tokenizer needed)."""
    json_grammar(schema)


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: llg.LLMatcher):
        self._m = matcher

    def consume(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar did not allow it."""
        return self._m.consume_token(token) and not self._m.is_error()

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (EOS included)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class GrammarCompiler:
    """Builds matchers for one tokenizer and fills their token masks, batched."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], threads: int = 2):
        """tokenizer_json: a Hugging Face `tokenizers` JSON; vocab_size: the logits' width (the
        model's vocabulary, which may be larger than the tokenizer's)."""
        self.vocab_size = vocab_size
        self._tok = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._executor = llg.LLExecutor(num_threads=threads)
        self._words = (vocab_size + 31) // 32
        self._templates: OrderedDict[str, llg.LLMatcher] = OrderedDict()  # schema key -> fresh matcher

    def matcher(self, schema: dict[str, Any]) -> Matcher:
        """A fresh matcher at the start of `schema`'s grammar; raises GrammarError when it cannot
        be built or fails on its first mask (e.g. a schema that only refers to itself). Built
        matchers are cached per schema and copied (n > 1, repeated schemas)."""
        key = _key(schema)
        template = self._templates.pop(key, None)
        if template is None:
            template = llg.LLMatcher(self._tok, json_grammar(schema), log_level=0)
            self.allowed([Matcher(template)])  # the first mask surfaces errors the grammar hides
            if template.is_error():
                raise GrammarError(f"invalid JSON schema: {template.get_error()}")
        self._templates[key] = template
        while len(self._templates) > 64:
            self._templates.popitem(last=False)
        return Matcher(template.deep_copy())

    def allowed(self, matchers: list[Matcher]) -> torch.Tensor:
        """[len(matchers), vocab_size] bool: the tokens each matcher allows next."""
        words = torch.zeros(len(matchers), self._words, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m._m, i) for i, m in enumerate(matchers)], words.data_ptr(), self._words * 4, len(matchers)
        )
        bits = np.unpackbits(words.numpy().view(np.uint8), axis=-1, bitorder="little")  # token t: bit t
        return torch.from_numpy(bits[:, : self.vocab_size]).view(torch.bool)
