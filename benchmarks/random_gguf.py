"""A real GGUF model's file with random weights: its header (metadata, tokenizer, tensor types and
shapes) kept byte for byte, every tensor filled with random quants and small finite scales. The
engine loads it as it loads the real file, so a machine that cannot hold the file (a lent GPU, with
64 MiB of luggage) can still run and time the model: only the text it writes is noise.

    python -m benchmarks.random_gguf cut MODEL.gguf HEADER     # here: the header alone (MBs)
    python -m benchmarks.random_gguf fill HEADER OUT.gguf      # there: the whole file again
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from runtime.models.quant import random_blocks

Q = gguf.GGMLQuantizationType


def cut(model: str, header: str) -> None:
    """Writes the file's bytes up to its tensor data, then its total size as 8 bytes."""
    reader = gguf.GGUFReader(model)
    size = Path(model).stat().st_size
    with open(model, "rb") as src, open(header, "wb") as dst:
        dst.write(src.read(reader.data_offset))
        dst.write(size.to_bytes(8, "little"))


def fill(header: str, out: str, seed: int = 0) -> None:
    raw = Path(header).read_bytes()
    size = int.from_bytes(raw[-8:], "little")
    with open(out, "wb") as dst:
        dst.write(raw[:-8])
        dst.truncate(size)
    rng = np.random.default_rng(seed)
    for tensor in gguf.GGUFReader(out, "r+").tensors:
        _fill_tensor(tensor, rng)


def _fill_tensor(tensor, rng) -> None:
    data, qtype = tensor.data, Q(tensor.tensor_type)
    if qtype in (Q.F32, Q.F16):
        shape = data.shape
        # norms near 1, biases and float matrices small: activations stay finite
        center = 1.0 if len(tensor.shape) == 1 and "norm" in tensor.name else 0.0
        data[...] = (center + rng.uniform(-0.05, 0.05, shape)).astype(data.dtype)
        return
    in_features = int(tensor.shape[0])  # ne0: the contiguous dimension
    flat = data.reshape(-1)
    flat[...] = random_blocks(
        qtype, int(tensor.n_elements) // in_features, in_features, rng
    ).reshape(-1)


if __name__ == "__main__":
    import sys

    {"cut": cut, "fill": fill}[sys.argv[1]](*sys.argv[2:])
