"""The persistent input batch (as vLLM v1's InputBatch): one row per running request, kept
across steps and changed only where something changed: a request joins (its tokens, blocks and
sampling settings are written once), gets a new block or a new token, or leaves (finished,
aborted, preempted). A step's inputs are then gathered from these rows by tensor ops on the host
and sent to the device in one copy (runtime/step/staging.py); the device keeps its own block table
and settings rows, updated in place from that copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.sampling.plan import NUM_PARAMS, param_row
from scheduler.request import Request, RequestStatus


@dataclass
class Row:
    request: Request
    num_tokens: int  # tokens written into the host token table
    num_blocks: int  # block ids written into the block tables
    num_preemptions: int  # the request's count when it joined; a change means it left
    last_block_id: int | None = None  # the last block id written into the tables


@dataclass
class RowUpdates:
    """What changed since the last step, for the device's copies of the tables."""

    block_cells: list[tuple[int, int, int]]  # (row, column, block id)
    param_rows: list[int]
    params: list[list[float]]


class InputBatch:
    def __init__(
        self, max_num_rows: int, max_model_len: int, max_blocks_per_seq: int, device
    ) -> None:
        self.max_model_len = max_model_len
        # int32, as vLLM: [rows, max_model_len] is the one table that grows with the context
        self.token_ids = torch.zeros(max_num_rows, max_model_len, dtype=torch.int32)
        self.block_table = torch.zeros(max_num_rows, max_blocks_per_seq, dtype=torch.int64)
        self.num_blocks = torch.zeros(max_num_rows, dtype=torch.int64)  # [max_num_rows]
        self.num_tokens = torch.zeros(max_num_rows, dtype=torch.int64)
        self.params = torch.zeros(max_num_rows, NUM_PARAMS, dtype=torch.float64)
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
        self.updates = RowUpdates([], [], [])

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    # ---- rows follow the scheduler's requests -------------------------------------------------
    def update(self, scheduled: list[tuple[Request, int]]) -> list[int]:
        """Bring the rows of the scheduled requests up to date; drop rows whose requests left.
        Returns the row of each scheduled request, in order."""
        num_known = sum(request.request_id in self.rows for request, _ in scheduled)
        if len(self.rows) > num_known:  # some row was not scheduled: did its request leave?
            self._drop_departed({request.request_id for request, _ in scheduled})
        return [self._row_of(request) for request, _ in scheduled]

    def _row_of(self, request: Request) -> int:
        row = self.rows.get(request.request_id)
        state = self.row_state[row] if row is not None else None
        if state is None or state.num_preemptions != request.num_preemptions:
            if row is not None:
                self.remove(request.request_id)
            return self._add(request)
        if state.num_tokens != request.num_tokens:
            self._write_tokens(row, state, request)
        if state.num_blocks != len(request.block_ids):
            self._write_blocks(row, state, request)
        return row

    def _add(self, request: Request) -> int:
        row = self.free_rows.pop()
        self.rows[request.request_id] = row
        state = Row(request, 0, 0, request.num_preemptions)
        self.row_state[row] = state
        self._write_tokens(row, state, request)
        self._write_blocks(row, state, request)
        values = param_row(request.sampling_params)
        self.params[row] = torch.tensor(values, dtype=torch.float64)
        self.updates.param_rows.append(row)
        self.updates.params.append(values)
        return row

    def _write_tokens(self, row: int, state: Row, request: Request) -> None:
        num_tokens = request.num_tokens
        if num_tokens > self.max_model_len:
            raise ValueError(f"{request.request_id} has more than {self.max_model_len} tokens")
        start = min(state.num_tokens, num_tokens)
        new = (
            request.all_token_ids[start:]
            if start < request.num_prompt_tokens
            else (request.output_token_ids[start - request.num_prompt_tokens :])
        )
        self.token_ids[row, start:num_tokens] = torch.tensor(new, dtype=torch.int32)
        state.num_tokens = num_tokens
        self.num_tokens[row] = num_tokens

    def _write_blocks(self, row: int, state: Row, request: Request) -> None:
        start, block_ids = state.num_blocks, request.block_ids
        if len(block_ids) < start or (start and block_ids[start - 1] != state.last_block_id):
            start = 0  # the table changed under us: rewrite it whole
        new = block_ids[start:]
        if len(new) == 1:  # a decode's new block
            self.block_table[row, start] = new[0]
        else:
            self.block_table[row, start : len(block_ids)] = torch.tensor(new, dtype=torch.int64)
        self.updates.block_cells.extend((row, start + i, b) for i, b in enumerate(new))
        state.num_blocks = len(block_ids)
        state.last_block_id = block_ids[-1] if block_ids else None
        self.num_blocks[row] = len(block_ids)

    def _drop_departed(self, scheduled_ids: set[str]) -> None:
        for request_id, row in list(self.rows.items()):
            if request_id in scheduled_ids:
                continue
            request = self.row_state[row].request
            if request.is_finished or request.status is not RequestStatus.RUNNING:
                self.remove(request_id)

    def remove(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.row_state[row] = None
            self.free_rows.append(row)

    def record_sampled(
        self,
        rows: torch.Tensor,
        positions: torch.Tensor,
        token_ids: torch.Tensor,
        requests: list[Request],
    ) -> None:
        """The sampled tokens land in the token table (the scheduler appends the same ones to
        the requests, so next step's check finds the rows up to date). A row given to another
        request, or rewritten, since the step was launched (async scheduling) is left alone."""
        fits = [
            (state := self.row_state[row]) is not None
            and state.request is request
            and state.num_tokens == position < self.max_model_len
            for row, position, request in zip(rows.tolist(), positions.tolist(), requests)
        ]
        if not all(fits):
            keep = torch.tensor(fits, dtype=torch.bool)
            rows, positions, token_ids = rows[keep], positions[keep], token_ids[keep]
        self.token_ids[rows, positions] = token_ids.to(torch.int32)
        self.num_tokens[rows] = positions + 1
        for row in rows.tolist():
            self.row_state[row].num_tokens += 1

    def take_updates(self) -> dict[str, torch.Tensor]:
        """The changes since the last step, as host tensors to stage."""
        u = self.updates
        self.updates = RowUpdates([], [], [])
        cells = torch.tensor(u.block_cells, dtype=torch.int64).view(-1, 3)
        params = torch.tensor(u.params, dtype=torch.float64).view(-1, NUM_PARAMS)
        return {
            "block_cells": cells.T.contiguous(),  # [3, num_cells]
            "param_rows": torch.tensor(u.param_rows, dtype=torch.int64),
            "param_values": params,
        }

    def apply_updates(self, staged: dict[str, torch.Tensor]) -> None:
        """On the device: write the staged changes into its tables, in place."""
        rows, columns, block_ids = staged["block_cells"]
        if rows.numel():
            self.device_block_table[rows, columns] = block_ids.int()
        if staged["param_rows"].numel():
            self.device_params[staged["param_rows"]] = staged["param_values"]
