"""One grammar matcher per constrained request, keyed by request id: created at admission,
advanced by each sampled token, dropped when the request finishes or is aborted.

A preempted request keeps its matcher: swapped or recomputed, it resumes sampling after the
tokens it already produced, which the matcher has already accepted (a recompute replays them
through the model only, never through the matcher)."""

from __future__ import annotations

import logging
from typing import Any

import xgrammar as xgr

log = logging.getLogger(__name__)


class GrammarMatchers:
    def __init__(self) -> None:
        self._matchers: dict[str, Any] = {}

    def add(self, request_id: str, compiled: Any) -> None:
        self._matchers[request_id] = xgr.GrammarMatcher(compiled)

    def get(self, request_id: str) -> Any | None:
        return self._matchers.get(request_id)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher; True when its grammar has reached its end."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        if not matcher.accept_token(token_id):  # only a token the mask allowed can be sampled
            log.warning("grammar of %s refused token %d", request_id, token_id)
        return matcher.is_terminated()
