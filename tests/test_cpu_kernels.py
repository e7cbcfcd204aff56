"""The native CPU kernels (kernels/cpu/) against their oracle, the torch references."""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from kernels import native, reference

BLOCK_SIZE, NUM_BLOCKS = 16, 96


@pytest.fixture(scope="module")
def ops():
    assert native.enabled(), "CONVEYOR_NATIVE_KERNELS=0: nothing to test"
    built = native.native_ops()
    assert built is not None, "the native CPU kernels did not build (see the log)"
    return built


def _decode_case(num_seqs, num_heads, num_kv_heads, head_dim, dtype, max_len, generator):
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    seq_lens = torch.randint(1, max_len + 1, (num_seqs,), generator=generator, dtype=torch.int32)
    max_blocks = (max_len + BLOCK_SIZE - 1) // BLOCK_SIZE + 1  # a spare column, never read
    tables = torch.randperm(NUM_BLOCKS, generator=generator)[: num_seqs * max_blocks]
    tables = tables.view(num_seqs, max_blocks).to(torch.int32)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=generator).to(dtype)
    return q, k_cache, v_cache, tables, seq_lens


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 16), (2, 1, 8), (3, 1, 12)]
)
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_paged_decode_matches_reference(ops, num_heads, num_kv_heads, head_dim, dtype, atol):
    generator = torch.Generator().manual_seed(num_heads * 100 + head_dim)
    case = _decode_case(6, num_heads, num_kv_heads, head_dim, dtype, 70, generator)
    expected = reference.paged_attention_decode(*case, scale=head_dim**-0.5)
    out = ops.paged_attention_decode(*case, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("num_seqs", [1, 5])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_paged_decode_splits_a_sequence_by_kv_heads(ops, num_seqs, dtype, atol):
    """Tasks are (sequence, kv head): with 2 threads, one sequence's kv heads (and one of five
    sequences', 15 tasks) run on both threads; long rows span many 32-token chunks."""
    generator = torch.Generator().manual_seed(num_seqs)
    case = _decode_case(num_seqs, 9, 3, 64, dtype, 250, generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = ops.paged_attention_decode(*case, 0.125)
    finally:
        torch.set_num_threads(threads)
    expected = reference.paged_attention_decode(*case, scale=0.125)
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)


def test_paged_decode_matches_reference_on_sharp_scores(ops):
    """Scores hundreds apart: the weights of all but the best keys underflow to zero."""
    generator = torch.Generator().manual_seed(11)
    case = _decode_case(5, 4, 2, 16, torch.float32, 70, generator)
    expected = reference.paged_attention_decode(*case, scale=40.0)
    torch.testing.assert_close(ops.paged_attention_decode(*case, 40.0), expected, atol=2e-5, rtol=0)


def test_paged_decode_reads_only_the_table_entries_in_use(ops):
    """Keys past a sequence's length and blocks outside its table never change its output."""
    generator = torch.Generator().manual_seed(7)
    q, k_cache, v_cache, tables, seq_lens = _decode_case(4, 4, 2, 16, torch.float32, 40, generator)
    before = ops.paged_attention_decode(q, k_cache, v_cache, tables, seq_lens, 0.25)
    used = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, dtype=torch.bool)
    for seq, length in enumerate(seq_lens.tolist()):
        for position in range(length):
            used[tables[seq, position // BLOCK_SIZE], position % BLOCK_SIZE] = True
    k_cache[~used], v_cache[~used] = float("nan"), float("nan")
    after = ops.paged_attention_decode(q, k_cache, v_cache, tables, seq_lens, 0.25)
    torch.testing.assert_close(after, before, atol=0, rtol=0)


def test_paged_decode_refuses_mismatched_inputs(ops):
    generator = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, tables, seq_lens = _decode_case(2, 4, 2, 16, torch.float32, 20, generator)
    with pytest.raises(RuntimeError, match="int32"):
        ops.paged_attention_decode(q, k_cache, v_cache, tables.long(), seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.paged_attention_decode(q.double(), k_cache, v_cache, tables, seq_lens, 1.0)


def test_backend_uses_the_native_decode_on_cpu(ops):
    from runtime.models.attention import AttentionBackend

    assert AttentionBackend(torch.device("cpu"), BLOCK_SIZE, torch.bfloat16).native is ops
    # float16: the reference's planned groups, decided once, not per layer call
    assert AttentionBackend(torch.device("cpu"), BLOCK_SIZE, torch.float16).native is None


def test_every_file_the_build_reads_ships_in_the_package():
    """A wheel install (the Docker image's) builds the kernels from the package's own copy: a
    source or header the package data leaves out fails that build, and the references run."""
    root = Path(native.__file__).resolve().parent.parent
    with open(root / "pyproject.toml", "rb") as file:
        shipped = tomllib.load(file)["tool"]["setuptools"]["package-data"]["kernels"]
    needed = [
        path.relative_to(root / "kernels").as_posix() for path in native.SOURCES + native.HEADERS
    ]
    assert [name for name in needed if not any(fnmatch.fnmatch(name, g) for g in shipped)] == []


@pytest.mark.slow
@pytest.mark.skipif(
    "avx512f" not in native.cpu_flags(),
    reason="this host's own build is the AVX2 one: tested as is",
)
@pytest.mark.parametrize(
    "march",
    [
        "x86-64-v3",
        pytest.param(
            "x86-64-v3 -mavxvnni",
            marks=pytest.mark.skipif(
                "avx_vnni" not in native.cpu_flags(), reason="this CPU runs no AVX-VNNI"
            ),
        ),
    ],
)
def test_the_avx2_kernels_are_their_oracle_on_a_host_with_avx512(march):
    """The build takes -march=native, so a host with AVX-512 compiles and runs only the AVX-512
    branches of kernels/cpu. This builds every source for AVX2 with FMA and F16C and no AVX-512
    (x86-64-v3, CONVEYOR_NATIVE_MARCH), then with AVX-VNNI too (Alder Lake's vpdpbusd on 256
    bits), and runs the GGUF kernels' oracle tests on that build, in a process of its own, so
    that a change here cannot break an AVX2 host unseen (one did: a helper used before its
    declaration there)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["CONVEYOR_NATIVE_MARCH"] = march
    root = Path(native.__file__).resolve().parent.parent
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_quant_kernels.py", "-k", "integer_dot or int8 or row or linear"],
        cwd=root, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    probe = "from kernels.native import native_ops as n; o = n(); print(o.quant_gemm_available())"
    built = subprocess.run(
        [sys.executable, "-c", probe], cwd=root, env=env, capture_output=True, text=True
    )
    assert built.stdout.split() == ["False"], built.stderr  # AVX-512 BF16 absent: the AVX2 build
