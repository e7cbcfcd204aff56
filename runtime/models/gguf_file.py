"""A GGUF file, memory-mapped: its metadata, its tensors, and `materialize`, the one place a tensor
of the file becomes a torch tensor the engine computes with.

The header is parsed here rather than with gguf-py's GGUFReader, which builds a numpy view per
string of the vocabulary (4-14 s on the files we serve, before any weight is read); gguf-py still
supplies the tensor types, their block sizes and the dequantizers.

GGUF lists a tensor's dimensions fastest-first (ggml's ne[0] is the row length): a torch shape is
the reverse.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
DEQUANTIZE_CHUNK_BYTES = 8 << 20  # float32 bytes dequantized at once
# the tensor types this engine dequantizes (gguf-py's numpy dequantizers); others are refused
SUPPORTED_TENSOR_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in (
        "F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K".split()  # noqa: SIM905
    )
)
# GGUF value types -> struct format (8 string, 9 array: below)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?",
          10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
STRING, ARRAY = 8, 9


class UnsupportedModelError(ValueError):
    """A model this engine refuses to load rather than run wrong (architecture, rope, type)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (slowest first)
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # uint8 [*shape[:-1], bytes per row], a view of the mapped file

    @property
    def type_name(self) -> str:
        return self.tensor_type.name


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self.path.open("rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        header = _HeaderParser(memoryview(self._map))
        self.metadata: dict[str, Any] = header.metadata
        infos = header.tensor_infos
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self.data_offset = -(-header.pos // alignment) * alignment
        self.tensors = {name: self._tensor(name, *info) for name, *info in infos}

    def _tensor(self, name: str, dims: list[int], type_id: int, offset: int) -> GGUFTensor:
        try:
            tensor_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise UnsupportedModelError(
                f"{self.path.name}: {name} has unknown type {type_id}"
            ) from None
        shape = tuple(reversed(dims))
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        row_bytes = dims[0] // block_size * type_size
        num_rows = int(np.prod(shape[:-1], dtype=np.int64))
        start = self.data_offset + offset
        raw = np.frombuffer(self._map, np.uint8, num_rows * row_bytes, start)
        return GGUFTensor(name, shape, tensor_type, raw.reshape(*shape[:-1], row_bytes))

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}` of the metadata."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def metadata_digest(self) -> str:
        """sha256 of the header (all metadata and tensor infos): what the tokenizer is built from,
        and different for any two files that differ in more than their weights' bytes."""
        digest = hashlib.sha256(self._map[: self.data_offset])
        digest.update(str(self.path.stat().st_size).encode())
        return digest.hexdigest()[:24]

    def drop_pages(self) -> None:
        """Give the file's pages back (the OS keeps them cached): the weights were copied."""
        self._map.madvise(mmap.MADV_DONTNEED)

    def check_tensor_types(self) -> None:
        unsupported = [
            t for t in self.tensors.values() if t.tensor_type not in SUPPORTED_TENSOR_TYPES
        ]
        if unsupported:
            first = unsupported[0]
            supported = ", ".join(t.name for t in sorted(SUPPORTED_TENSOR_TYPES))
            raise UnsupportedModelError(
                f"{self.path.name}: unsupported GGUF tensor type {first.type_name} ({first.name}"
                f"{f' and {len(unsupported) - 1} more tensors' if len(unsupported) > 1 else ''}); "
                f"supported: {supported}"
            )


def materialize(tensor: GGUFTensor, dtype: torch.dtype) -> torch.Tensor:
    """The tensor in the engine's dtype, dequantized in memory. The one place a file's tensor
    becomes a weight: a quantized-weights path hands out the file's blocks here instead.
    Dequantized a few MiB of rows at a time (gguf-py's dequantizers make several float32
    temporaries of their input's size: whole, a 500 MB embedding would peak at ~2 GB more)."""
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        raise UnsupportedModelError(f"unsupported GGUF tensor type {tensor.type_name}")
    out = torch.empty(tensor.shape, dtype=dtype)
    rows = tensor.data.reshape(-1, tensor.data.shape[-1])  # [num_rows, bytes per row]
    out_rows = out.view(rows.shape[0], -1)  # [num_rows, row length]
    step = max(1, DEQUANTIZE_CHUNK_BYTES // (4 * out_rows.shape[1]))
    for start in range(0, rows.shape[0], step):
        values = dequantize(rows[start : start + step], tensor.tensor_type)
        values = np.require(values, requirements=("C", "W"))  # a copy only of mapped floats
        out_rows[start : start + step].copy_(torch.from_numpy(values))
    return out


class _HeaderParser:
    """Reads the header front to back: metadata key/values, then the tensor infos."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer, self.pos = buffer, len(GGUF_MAGIC)
        if bytes(buffer[:4]) != GGUF_MAGIC:
            raise UnsupportedModelError("not a GGUF file (bad magic)")
        version = self._scalar("<I")
        if version not in (2, 3):
            raise UnsupportedModelError(f"unsupported GGUF version {version} (supported: 2, 3)")
        num_tensors, num_kv = self._scalar("<Q"), self._scalar("<Q")
        self.metadata = {self._string(): self._value(self._scalar("<I")) for _ in range(num_kv)}
        self.tensor_infos = [self._tensor_info() for _ in range(num_tensors)]

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("<Q")
        text = bytes(self.buffer[self.pos : self.pos + length]).decode("utf-8", errors="replace")
        self.pos += length
        return text

    def _value(self, value_type: int):
        if value_type == STRING:
            return self._string()
        if value_type == ARRAY:
            return self._array()
        if value_type not in _SCALARS:
            raise UnsupportedModelError(f"GGUF metadata value of unknown type {value_type}")
        return self._scalar(_SCALARS[value_type])

    def _array(self):
        item_type, count = self._scalar("<I"), self._scalar("<Q")
        if item_type in _NUMPY:  # numbers: one view, no per-item parsing
            values = np.frombuffer(self.buffer, _NUMPY[item_type], count, self.pos)
            self.pos += values.nbytes
            return values
        return [self._value(item_type) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        dims = [self._scalar("<Q") for _ in range(self._scalar("<I"))]
        return name, dims, self._scalar("<I"), self._scalar("<Q")
