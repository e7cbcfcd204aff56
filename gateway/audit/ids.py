"""The ids a request goes by, made and read here only: the audit record's id (the x-request-id,
32 hex digits), the response body's id (`cmpl-` or `chatcmpl-` + the record id), and the engine's
id of each choice (`<record id>-<choice>`)."""

from __future__ import annotations

import re

COMPLETION_ID_PREFIX = "cmpl-"
CHAT_COMPLETION_ID_PREFIX = "chatcmpl-"
_SEQUENCE_ID = re.compile(r"^([0-9a-f]{32})-(\d+)$")


def record_id_of(any_id: str) -> str:
    """The audit record id for either id a client holds: the body's or the bare x-request-id."""
    for prefix in (CHAT_COMPLETION_ID_PREFIX, COMPLETION_ID_PREFIX):
        if any_id.startswith(prefix):
            return any_id.removeprefix(prefix)
    return any_id


def sequence_id(record_id: str, choice: int) -> str:
    """The engine's id of one choice of a request."""
    return f"{record_id}-{choice}"


def split_sequence_id(engine_id: str | None) -> tuple[str, int] | None:
    """(record id, choice) of an engine id the gateway made; None for any other id."""
    match = _SEQUENCE_ID.match(engine_id or "")
    return (match.group(1), int(match.group(2))) if match else None
