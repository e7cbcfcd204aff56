"""Compiling a GrammarSpec into an xgrammar CompiledGrammar, once per distinct spec.

The cache is a bounded LRU keyed by the SHA-256 of the spec, shared by every tenant: the same
schema compiles once. `prepare` runs on a worker thread (EngineClient.prepare_grammar), never
on the event loop nor inside an engine step; the engine thread only looks compiled grammars up.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from runtime.structured.schema_rules import GrammarError, check_schema, compiler_message
from scheduler.request import GrammarSpec

DEFAULT_MAX_ENTRIES = 256
JSON_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True)
class PreparedGrammar:
    """A compiled grammar and what its preparation cost."""

    key: str  # SHA-256 of the spec
    compiled: Any  # xgrammar.CompiledGrammar
    compile_s: float  # 0 on a cache hit
    cache_hit: bool
    size_bytes: int  # memory of the compiled grammar, what the per-tenant cap limits


def spec_key(spec: GrammarSpec) -> str:
    return hashlib.sha256(f"{spec.kind}\n{spec.text}".encode()).hexdigest()


class GrammarCompiler:
    """xgrammar's compiler for one tokenizer, behind a bounded LRU cache (thread-safe)."""

    def __init__(self, tokenizer_info: Any, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.tokenizer_info = tokenizer_info
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
        self.max_entries = max_entries
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(
        cls, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], **kwargs: Any
    ) -> GrammarCompiler:
        """vocab_size: the model's logits width; ids past the tokenizer's are never allowed."""
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        return cls(info, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer_info.vocab_size

    def prepare(self, spec: GrammarSpec, max_size_bytes: int | None = None) -> PreparedGrammar:
        """The spec's compiled grammar, from the cache or compiled now (then cached). Raises
        GrammarError for an invalid spec or one larger than max_size_bytes."""
        key = spec_key(spec)
        compiled = self.lookup(key)
        cache_hit, compile_s = compiled is not None, 0.0
        if compiled is None:
            start = time.perf_counter()
            compiled = self._compile(spec)
            compile_s = time.perf_counter() - start
            self._store(key, compiled)
        size = compiled.memory_size_bytes
        if max_size_bytes is not None and size > max_size_bytes:
            raise GrammarError(
                f"the compiled grammar takes {size} bytes, more than this tenant's limit of "
                f"{max_size_bytes} bytes: simplify the schema",
                code="schema_too_large",
            )
        return PreparedGrammar(key, compiled, compile_s, cache_hit, size)

    def lookup(self, key: str) -> Any | None:
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def _store(self, key: str, compiled: Any) -> None:
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _compile(self, spec: GrammarSpec) -> Any:
        try:
            if spec.kind == "json_object":
                return self.compiler.compile_json_schema(
                    JSON_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False
                )
            if spec.kind == "json_schema":
                check_schema(parse_json(spec.text, "schema"))
                return self.compiler.compile_json_schema(spec.text, any_whitespace=False)
            return self.compiler.compile_structural_tag(spec.text)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's, pydantic's
            raise GrammarError(
                f"invalid schema: {compiler_message(error)}", code="invalid_schema"
            ) from None


def parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as error:
        raise GrammarError(
            f"the {what} is not valid JSON: {error}", code="invalid_schema"
        ) from None
