"""Host-to-device and device-to-host transfers of a step: one copy each way.

A step's inputs (token ids, positions, slots, lengths, rows, block-table and settings updates,
sampling indices) are packed into one int64 host buffer, pinned on CUDA, and reach the device in
one non-blocking copy; the sampled ids come back in one copy. `copy_to_device` and
`copy_to_host` are the only places that move step data across, so a test can count them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


def copy_to_device(host: torch.Tensor, device_buffer: torch.Tensor) -> None:
    """The step's one host-to-device copy (non-blocking from pinned memory on CUDA)."""
    device_buffer.copy_(host, non_blocking=True)


def copy_to_host(device_tensor: torch.Tensor) -> PendingCopy:
    """The step's one device-to-host copy, started here (non-blocking into pinned memory on
    CUDA) and waited for by PendingCopy.result(), so the host can work in between."""
    if device_tensor.device.type != "cuda":
        return PendingCopy(device_tensor.clone(), None)
    host = torch.empty(device_tensor.shape, dtype=device_tensor.dtype, pin_memory=True)
    host.copy_(device_tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device_tensor.device))
    return PendingCopy(host, done)


@dataclass
class PendingCopy:
    host: torch.Tensor
    done: object | None  # a CUDA event, None when the copy is already complete

    def result(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        return self.host


class StagingBuffer:
    """Two host buffers used in turn (the one a pending copy reads is never overwritten) and
    one device buffer that each step's parts are views of."""

    def __init__(self, device: torch.device, capacity: int = 1 << 14) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        self.hosts = [self._host(capacity), self._host(capacity)]
        self.events: list = [None, None]
        self.device_buffer = torch.empty(capacity, dtype=torch.int64, device=device)
        self.turn = 0

    def _host(self, capacity: int) -> torch.Tensor:
        return torch.empty(capacity, dtype=torch.int64, pin_memory=self.pin)

    def stage(self, parts: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """parts: host tensors of int64 (or float64, carried bit for bit) -> device views of
        the same names and shapes, after one copy."""
        flat = [_as_int64(t).reshape(-1) for t in parts.values()]
        total = sum(t.numel() for t in flat)
        host = self._host_for(total)
        offset = 0
        for t in flat:
            host[offset : offset + t.numel()].copy_(t)
            offset += t.numel()
        if total > self.device_buffer.numel():
            self.device_buffer = torch.empty(2 * total, dtype=torch.int64, device=self.device)
        copy_to_device(host[:total], self.device_buffer[:total])
        self._record(host)
        return self._views(parts)

    def _host_for(self, total: int) -> torch.Tensor:
        self.turn ^= 1
        event = self.events[self.turn]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer is done
        if total > self.hosts[self.turn].numel():
            self.hosts[self.turn] = self._host(2 * total)
        return self.hosts[self.turn]

    def _record(self, host: torch.Tensor) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.events[self.turn] = event

    def _views(self, parts: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        views, offset = {}, 0
        for name, t in parts.items():
            view = self.device_buffer[offset : offset + t.numel()].view(t.shape)
            views[name] = view.view(torch.float64) if t.dtype == torch.float64 else view
            offset += t.numel()
        return views


def _as_int64(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float64:
        return t.contiguous().view(torch.int64)
    return t if t.dtype == torch.int64 else t.long()
