"""benchmarks/random_gguf.py (a real file's header with random weights) and gpu_quant's listing:
the tools that let a GPU machine without the model file time the model."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from benchmarks.gpu_quant import listing_of
from benchmarks.random_gguf import cut, fill
from runtime.models.catalog import DEFAULT_MODEL, pull
from runtime.models.source import known_model_file

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def model_file() -> str:
    pull(DEFAULT_MODEL)
    return str(known_model_file(DEFAULT_MODEL))


@pytest.mark.slow
def test_filled_file_has_the_real_header_and_random_weights(model_file, tmp_path):
    header, out = tmp_path / "header", tmp_path / "random.gguf"
    cut(model_file, str(header))
    assert header.stat().st_size < 16 << 20
    fill(str(header), str(out))
    real, fake = gguf.GGUFReader(model_file), gguf.GGUFReader(str(out))
    assert out.stat().st_size == len(real.data)
    with open(model_file, "rb") as src, open(out, "rb") as dst:
        assert dst.read(real.data_offset) == src.read(real.data_offset)
    for a, b in zip(real.tensors, fake.tensors, strict=True):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, list(b.shape))
        if b.tensor_type in (Q.F32, Q.F16):
            assert np.isfinite(b.data).all()
        else:  # the float16 scales must be finite for the kernels' arithmetic
            values = gguf.quants.dequantize(np.asarray(b.data)[:4], b.tensor_type)
            assert np.isfinite(values).all() and np.abs(values).max() < 10
    assert not np.array_equal(real.tensors[-1].data, fake.tensors[-1].data)


def test_listing_names_every_matrix_and_a_tied_output(model_file):
    listing = listing_of(model_file)
    names = {w["name"] for w in listing}
    assert "token_embd.weight" in names and "output.weight" in names  # SmolLM2 ties its head
    embedding = next(w for w in listing if w["name"] == "token_embd.weight")
    output = next(w for w in listing if w["name"] == "output.weight")
    assert output["shape"] == embedding["shape"] == [49152, 576]
    assert all(Q[w["type"]] in Q for w in listing) and len(listing) == 1 + 1 + 30 * 7
