"""Grammar compilation for structured outputs: JSON Schema, regex, Lark, GBNF -> Grammar.

llguidance does the work (the token-mask engine that vLLM, SGLang and llama.cpp integrate);
this module builds its tokenizer view once per model and caches compiled grammars by text.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher, LLTokenizer
from llguidance.gbnf_to_lark import any_to_lark

from model.load.tokenizer import Tokenizer
from scheduler.constraint import Grammar

KINDS = ("json_schema", "regex", "lark", "gbnf", "choice")
# NOTE: no free whitespace between JSON tokens: a small model given the choice loops on
# newlines until max_tokens. Separators are json.dumps' defaults, the spacing models read most.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
_LISTING = re.compile(r"^\d+ \| ")


class GrammarError(ValueError):
    """The grammar does not compile; the message says where."""


@dataclass(slots=True, frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    source: str  # JSON Schema text, regex, Lark or GBNF text, or a JSON list of strings

    @staticmethod
    def json_schema(schema: dict[str, Any] | bool) -> GrammarSpec:
        return GrammarSpec("json_schema", json.dumps(schema))  # NOTE: key order is output order

    @staticmethod
    def choice(options: list[str]) -> GrammarSpec:
        return GrammarSpec("choice", json.dumps(options))


class GrammarCompiler:
    """Thread-safe; `compile` may block for a complex grammar (llguidance drops the GIL)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 128) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width (>= the tokenizer's)
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._ll_tokenizer: LLTokenizer | None = None
        self._cache: OrderedDict[GrammarSpec, Grammar] = OrderedDict()

    @property
    def ll_tokenizer(self) -> LLTokenizer:
        """Built on first use (~0.4 s for a 49k vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = LLTokenizer(
                    self.tokenizer.hf.to_str(),
                    n_vocab=self.vocab_size,
                    eos_token=sorted(self.tokenizer.eos_ids),
                )
            return self._ll_tokenizer

    def compile(self, spec: GrammarSpec) -> Grammar:
        """Raises GrammarError for a grammar llguidance rejects."""
        if spec.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {spec.kind!r}; use one of {KINDS}")
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        ll_grammar = to_llguidance(spec)
        matcher = LLMatcher(self.ll_tokenizer, ll_grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_error_text(matcher.get_error()))
        grammar = Grammar(spec.kind, spec.source, matcher)
        with self._lock:
            self._cache[spec] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar


def to_llguidance(spec: GrammarSpec) -> str:
    """The llguidance grammar text of `spec`; raises GrammarError for malformed input."""
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.source)
            return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
        except ValueError as e:
            raise GrammarError(f"invalid JSON Schema: {e}") from e
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "lark":
        return LLMatcher.grammar_from_lark(spec.source)
    if spec.kind == "gbnf":
        try:
            return LLMatcher.grammar_from_lark(any_to_lark(spec.source))
        except Exception as e:  # noqa: BLE001 - the converter raises bare Exceptions
            raise GrammarError(f"invalid GBNF grammar: {e}") from e
    options = json.loads(spec.source)
    if not options or not all(isinstance(o, str) for o in options):
        raise GrammarError("a choice needs a non-empty list of strings")
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))


def _error_text(message: str) -> str:
    """llguidance's message without its annotated listing of the grammar (`  1 | ...`, `^`)."""
    lines = [ln.strip() for ln in message.splitlines()]
    kept = [ln for ln in lines if ln and set(ln) != {"^"} and not _LISTING.match(ln)]
    return " ".join(kept) or "invalid grammar"
