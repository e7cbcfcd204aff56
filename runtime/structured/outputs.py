"""The engine's one handle on structured outputs: the compiler (built on first use), the
matchers of the running constrained requests and the mask builder the model runner uses."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from runtime.structured.compiler import GrammarCompiler, PreparedGrammar
from runtime.structured.masks import MaskBuilder
from runtime.structured.matchers import GrammarMatchers
from scheduler.request import GrammarSpec, Request


class StructuredOutputs:
    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        device: torch.device,
    ) -> None:
        self.hf_tokenizer, self.vocab_size = hf_tokenizer, vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.matchers = GrammarMatchers()
        self.masks = MaskBuilder(self.matchers, vocab_size, device)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        """Built on first use (reading the vocabulary takes ~0.2 s): engines that never see a
        constrained request never pay it."""
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler.for_tokenizer(
                    self.hf_tokenizer, self.vocab_size, self.stop_token_ids
                )
            return self._compiler

    def prepare(self, spec: GrammarSpec, max_size_bytes: int | None = None) -> PreparedGrammar:
        """Thread-safe; raises GrammarError."""
        return self.compiler.prepare(spec, max_size_bytes)

    def admit(self, request_id: str, spec: GrammarSpec, prepared: PreparedGrammar | None) -> None:
        """A matcher for a new request (its grammar compiled now if the caller did not)."""
        prepared = prepared or self.prepare(spec)
        self.matchers.add(request_id, prepared.compiled)

    def advance(self, advanced: Sequence[tuple[Request, int]]) -> list[Request]:
        """Accept each request's newest tokens (its last `num_new` outputs), in order; -> the
        unfinished ones whose grammar ended."""
        if not self.matchers:
            return []
        ended = []
        for request, num_new in advanced:
            for token_id in request.output_token_ids[-num_new:]:
                if self.matchers.accept(request.request_id, token_id):
                    if not request.is_finished:
                        ended.append(request)
                    break
        return ended

    def release(self, request_id: str) -> None:
        self.matchers.release(request_id)
