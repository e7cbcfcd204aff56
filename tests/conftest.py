"""Shared fixtures. Real services: Redis and PostgreSQL on 127.0.0.1 (CI has them; a test that
needs one fails, never skips, when it is missing)."""

from __future__ import annotations

import os
import uuid

import pytest

# Test servers run beside the in-process engine on few cores: spinning OpenMP threads of one
# process would starve the others (measured: attention 2x slower), so idle threads sleep.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Triton picks its interpreter when it is first imported: decide before any test imports it.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

REDIS_URL = os.environ.get("CONVEYOR_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get(
    "CONVEYOR_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)


@pytest.fixture
def redis_url() -> str:
    """URL of the real Redis; keys used by a test should carry `unique_name` to stay apart."""
    return REDIS_URL


@pytest.fixture
def postgres_url() -> str:
    return POSTGRES_URL


@pytest.fixture
def unique_name() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def tiny_llama() -> dict:
    """The tests' tiny model: the near-zero model of `conveyor bench step` with two layers."""
    from benchmarks.step import NEAR_ZERO

    return dict(NEAR_ZERO, num_hidden_layers=2)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-initialised 2-layer Llama with SmolLM2's tokenizer: fast engine tests."""
    from benchmarks.step import write_random_llama

    return write_random_llama(tmp_path_factory.mktemp("tiny-llama"), tiny_llama())


@pytest.fixture(scope="session")
def batch_invariant_kernels() -> None:
    """For tests that run the same requests under two schedules and want the same tokens: a
    row's result must not depend on the rest of its batch. The native CPU kernels give that;
    the torch reference's decode attention pads each length group of a batch, so its rounding
    (and a seeded sample near a tie) follows the batch."""
    from kernels import native

    assert native.native_ops() is not None, (
        "this test needs the native CPU kernels (`make install` builds them; "
        "CONVEYOR_NATIVE_KERNELS=0 turns them off)"
    )
