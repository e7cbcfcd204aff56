"""Per-row maxima of [rows, n] tensors on CPU, where torch's argmax and topk run a scalar loop
(~8x and ~20x slower than amax): the maxima of blocks of each row first, then the few blocks that
can hold the answer."""

from __future__ import annotations

import torch


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x: [num_rows, n] -> [num_rows] int64, the first index of each row's maximum, as
    x.argmax(-1). On CPU torch's argmax (and max with indices) is a scalar loop, ~8x slower than
    amax: take the max of blocks of the row, then the argmax inside the winning block only."""
    blocks = _row_blocks(x)  # [num_rows, num_blocks, block]
    if blocks is None:
        return x.argmax(dim=-1)
    num_rows, _, block = blocks.shape
    best_block = blocks.amax(dim=-1).argmax(dim=-1)  # [num_rows], first block holding the max
    inside = blocks[torch.arange(num_rows, device=x.device), best_block]  # [num_rows, block]
    return best_block * block + inside.argmax(dim=-1)


def largest(x: torch.Tensor, count: int) -> torch.Tensor:
    """x: [num_rows, n] -> [num_rows, count] int64, the columns of each row's `count` largest
    values in no order, as x.topk(count).indices. On CPU torch's topk is ~20x slower than amax:
    the count largest lie in the count blocks of largest maxima, and topk looks there only."""
    blocks = _row_blocks(x, count)  # [num_rows, num_blocks, block]
    if blocks is None:
        return x.topk(count, dim=-1, sorted=False).indices
    num_rows, _, block = blocks.shape
    best_blocks = blocks.amax(dim=-1).topk(count, dim=-1, sorted=False).indices
    columns = (best_blocks.unsqueeze(-1) * block + torch.arange(block)).view(num_rows, -1)
    inside = x.gather(1, columns).topk(count, dim=-1, sorted=False).indices
    return columns.gather(1, inside)


def _row_blocks(x: torch.Tensor, min_blocks: int = 8) -> torch.Tensor | None:
    """x [num_rows, n] on CPU, contiguous, as [num_rows, n // block, block]: block the widest
    power of two up to 1024 that divides n into at least min_blocks blocks (and 8). None: none
    does, or x is elsewhere."""
    num_rows, n = x.shape
    if x.device.type != "cpu" or not x.is_contiguous():
        return None
    for block in (1024, 512, 256, 128, 64):
        if n % block == 0 and n // block >= max(min_blocks, 8):
            return x.view(num_rows, n // block, block)
    return None
