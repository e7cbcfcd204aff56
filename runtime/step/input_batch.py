"""The persistent input batch (as vLLM v1's InputBatch): one row per running request, kept
across steps and changed only where the scheduler's output says: rows leave (finished, aborted,
preempted), rows join (new and resumed requests, written whole), rows gain tokens and blocks.
The batch applies what it is told and never reads a live `Request`. A step's inputs are then
gathered from these rows (numpy arrays) on the host and sent to the device in one copy
(runtime/step/inputs.py); the device keeps its own block table and settings rows, updated in
place from that copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from runtime.sampling.plan import NUM_PARAMS, param_row
from scheduler.output import NewRow, RowAppend, SchedulerOutput


@dataclass(slots=True)
class Row:
    request_id: str
    num_prompt_tokens: int
    seed: int | None
    has_grammar: bool
    num_tokens: int = 0  # tokens written into the host token table
    num_blocks: int = 0  # block ids written into the block tables


@dataclass
class RowUpdates:
    """What changed since the last step, for the device's copies of the tables."""

    block_cells: list[tuple[int, int, int]] = field(default_factory=list)  # (row, column, id)
    param_rows: list[int] = field(default_factory=list)
    params: list[list[float]] = field(default_factory=list)


class InputBatch:
    def __init__(
        self, max_num_rows: int, max_model_len: int, max_blocks_per_seq: int, device
    ) -> None:
        self.max_model_len = max_model_len
        # the host's tables, numpy: a step writes and reads a few cells of them, where each torch
        # setitem or index costs microseconds of dispatch (runtime/step/inputs.py stages them).
        # int32, as vLLM: [rows, max_model_len] is the one table that grows with the context
        self.token_ids = np.zeros((max_num_rows, max_model_len), dtype=np.int32)
        self.block_table = np.zeros((max_num_rows, max_blocks_per_seq), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_rows, dtype=np.int64)  # [max_num_rows]
        self.num_tokens = np.zeros(max_num_rows, dtype=np.int64)
        self.params = np.zeros((max_num_rows, NUM_PARAMS), dtype=np.float64)
        # the device's copies, changed in place from each step's staged updates
        self.device_block_table = torch.zeros(
            max_num_rows, max_blocks_per_seq, dtype=torch.int32, device=device
        )
        self.device_params = torch.zeros(
            max_num_rows, NUM_PARAMS, dtype=torch.float64, device=device
        )
        self.rows: dict[str, int] = {}  # request id -> row
        self.row_state: list[Row | None] = [None] * max_num_rows
        self.free_rows = list(range(max_num_rows - 1, -1, -1))
        self.updates = RowUpdates()

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    # ---- the scheduler tells, the batch applies ---------------------------------------------
    def apply(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_ids:
            self.remove(request_id)
        for request in out.preempted:
            self.remove(request.request_id)
        for row in out.new_rows:
            self.add(row)
        if out.appends:
            self._append_all(out.appends)

    def add(self, new: NewRow) -> int:
        row = self.free_rows.pop()
        self.rows[new.request_id] = row
        params = new.sampling_params
        state = Row(new.request_id, new.num_prompt_tokens, params.seed, params.grammar is not None)
        self.row_state[row] = state
        self._write_tokens(row, state, new.token_ids)
        self._write_blocks(row, state, new.block_ids)
        values = param_row(params)
        self.params[row] = values
        self.updates.param_rows.append(row)
        self.updates.params.append(values)
        return row

    def _append_all(self, appends: list[RowAppend]) -> None:
        """Every row's new tokens in one indexed write (a decode step brings one per row)."""
        rows, columns, token_ids, lengths = [], [], [], {}
        for append in appends:
            row = self.rows[append.request_id]
            state = self.row_state[row]
            if append.token_ids:
                start = state.num_tokens
                state.num_tokens += len(append.token_ids)
                if state.num_tokens > self.max_model_len:
                    raise ValueError(
                        f"{state.request_id} has more than {self.max_model_len} tokens"
                    )
                rows += [row] * len(append.token_ids)
                columns += range(start, state.num_tokens)
                token_ids += append.token_ids
                lengths[row] = state.num_tokens
            if append.block_ids:
                self._write_blocks(row, state, append.block_ids, append.first_block)
        if rows:
            self.token_ids[rows, columns] = token_ids
            self.num_tokens[list(lengths)] = list(lengths.values())

    def _write_tokens(self, row: int, state: Row, token_ids: list[int]) -> None:
        start, end = state.num_tokens, state.num_tokens + len(token_ids)
        if end > self.max_model_len:
            raise ValueError(f"{state.request_id} has more than {self.max_model_len} tokens")
        self.token_ids[row, start:end] = token_ids
        state.num_tokens = end
        self.num_tokens[row] = end

    def _write_blocks(
        self, row: int, state: Row, block_ids: list[int], start: int | None = None
    ) -> None:
        """start: the first column written (None: after the row's blocks)."""
        start = state.num_blocks if start is None else start
        end = start + len(block_ids)
        self.block_table[row, start:end] = block_ids
        self.updates.block_cells.extend((row, start + i, b) for i, b in enumerate(block_ids))
        state.num_blocks = end
        self.num_blocks[row] = end

    def write_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Speculative drafts go after each row's tokens, not counted as its tokens: the step
        reads them as extra query positions, and the tokens that land overwrite them."""
        for request_id, draft in drafts.items():
            row = self.rows[request_id]
            start = self.row_state[row].num_tokens
            self.token_ids[row, start : start + len(draft)] = draft

    def remove(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.row_state[row] = None
            self.free_rows.append(row)

    # ---- what a step reads ------------------------------------------------------------------
    def row_of(self, request_id: str) -> int:
        return self.rows[request_id]

    def seen_token_ids(self, rows: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """The prompt and output tokens the host holds for each row (penalties read them)."""
        prompts, outputs = [], []
        for row in rows:
            state = self.row_state[row]
            tokens = self.token_ids[row, : state.num_tokens].tolist()
            prompts.append(tokens[: state.num_prompt_tokens])
            outputs.append(tokens[state.num_prompt_tokens :])
        return prompts, outputs

    def take_updates(self) -> RowUpdates:
        """The changes since the last step, to stage."""
        updates, self.updates = self.updates, RowUpdates()
        return updates
