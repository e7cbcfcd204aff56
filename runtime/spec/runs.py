"""A row that lands several tokens in one step (its accepted drafts and one more) is read out
one token at a time where stop strings apply: the tokens after the one that completes a stop
string were never produced, as without speculation, and leave the request."""

from __future__ import annotations

from scheduler.request import Request, RequestStatus


def detokenize_run(request: Request, detok, token_ids: list[int]) -> tuple[str, list[int]]:
    """detok: the request's IncrementalDetokenizer. -> the new text and the tokens kept."""
    text, num_read = "", 0
    for token_id in token_ids:
        text += detok.add_tokens([token_id])
        num_read += 1
        if detok.stop_hit is not None:
            break
    if num_read < len(token_ids):
        del request.output_token_ids[num_read - len(token_ids) :]
        if request.is_finished:  # by a later token: the stop string came first
            restate_finish(request, detok.stop_hit)
    return text, token_ids[:num_read]


def restate_finish(request: Request, stop_string: str) -> None:
    """A request the scheduler finished (length, end of sequence) stopped earlier, by a stop
    string: its finish and its FINISHED event say so."""
    request.status = RequestStatus.FINISHED_STOPPED
    request.finish_reason, request.stop_reason = "stop", stop_string
    finished = request.events[-1]
    finished.data.update(reason="stop", num_output_tokens=request.num_output_tokens)
