"""Engine settings: one model behind the flags of `conveyor generate`, `bench` and `serve` and
the `CONVEYOR_*` variables of `serve`."""

from __future__ import annotations

import argparse
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from kernels.native import cpu_flags
from runtime.flags import add_flags, model_values
from scheduler.config import POLICIES, PREEMPTION_MODES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_supports_bf16() -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


class EngineConfig(BaseModel):
    """Every engine setting, declared once: `conveyor generate`, `bench` and `serve` take them as
    flags (`runtime.flags`), `serve` also as `CONVEYOR_*` variables (`gateway.settings`)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        None, description="HF model dir or .gguf (default: SmolLM2-135M-Instruct)"
    )
    served_model_name: Annotated[list[str] | None, NoDecode] = Field(
        None,
        description="names /v1/models lists and requests may use (default: from --model)",
        json_schema_extra={"nargs": "+", "metavar": "NAME"},
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bfloat16 on CUDA and on CPUs with avx512_bf16, else float32"
    )
    quantization: Literal["gguf", "none"] = Field(
        "gguf",
        description="gguf: a .gguf's quantized weights stay in their blocks (native CPU kernels, "
        "Triton on CUDA); none: dequantize at load to --dtype",
    )
    quantized_activations: Literal["auto", "int8", "dtype"] = Field(
        "auto",
        description="CPU matmuls of GGUF weights over many rows (prompts, 7+ sequences): int8: "
        "activations rounded to 8 bits per 32 values as llama.cpp rounds them (AVX-512 VNNI: "
        "1.3-1.5x faster than bfloat16 tiles; AVX2: 2-2.6x faster than float32); dtype: kept in "
        "--dtype (closer to float32); auto: int8 except for families whose perplexity it moves by "
        "more than half a percent (Gemma 3) and for a --dtype float32 asked for by name",
    )
    device: str = Field(
        "auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$", description="auto | cpu | cuda | cuda:N"
    )
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    num_kv_blocks: int | None = Field(
        None, ge=1, description="KV blocks on the device (default: from --kv-cache-memory)"
    )
    kv_cache_memory: str = Field(
        "2GiB",
        pattern=r"^([0-9]+(\.[0-9]+)?\s*([KMGT]i?B?|[kmgt]i?b?)?|auto)$",
        description="bytes or e.g. 2GiB; auto: a share of the memory left once the weights are "
        "loaded (0.9 of the GPU's free memory, 0.5 of the CPU's available memory less the swap "
        "pool), no more than max-num-seqs sequences of max-model-len tokens",
    )
    swap_space: float = Field(1.0, ge=0, description="GiB of CPU swap pool")
    max_num_seqs: int = Field(256, ge=1, description="running sequences at most")
    max_batch_tokens: int = Field(2048, ge=1, description="tokens per step at most")
    max_model_len: int | None = Field(
        None, ge=1, description="context length (default: the model's)"
    )
    scheduling: Literal[POLICIES] = Field(
        "priority",
        description="priority/fcfs: continuous batching; static: a batch runs to completion; "
        "dynamic: as static, but a batch waits up to --batch-window for max-num-seqs requests",
    )
    batch_window: float = Field(
        0.05,
        ge=0,
        description="dynamic batching: seconds the oldest waiting request waits for a batch",
        json_schema_extra={"metavar": "SECONDS"},
    )
    preemption_mode: Literal[PREEMPTION_MODES] = Field(
        "auto", description="auto: the cost model picks swap or recompute per victim"
    )
    priority_aging: float | None = Field(
        None,
        gt=0,
        description="seconds after which a waiting request gains urgency",
        json_schema_extra={"metavar": "SECONDS"},
    )
    enable_prefix_caching: bool = Field(True, json_schema_extra={"flag": "--no-prefix-caching"})
    enforce_eager: bool = Field(False, description="CUDA: run every step eagerly (no CUDA graphs)")
    seed: int = Field(0, description="seeds the sampler of requests without their own seed")
    async_output: Literal["auto", "on", "off"] = Field(
        "auto",
        description="build step N's outputs (detokenize) while the device runs step N+1; "
        "auto: on CUDA",
    )

    async_scheduling: Literal["auto", "on", "off"] = Field(
        "auto",
        description="schedule and launch step N+1 before step N's tokens reach the host (its "
        "decodes read them on the device), building step N's outputs meanwhile; auto: on CUDA",
    )

    speculative: Literal["off", "ngram", "draft"] = Field(
        "off",
        description="speculative decoding: ngram (prompt lookup) or draft (a small model, "
        "--draft-model); each request's k is chosen from its measured acceptance",
    )
    num_speculative_tokens: int | None = Field(
        None,
        ge=1,
        le=16,
        description="speculative decoding: the most drafts a row verifies; default 8 for ngram "
        "(its drafts cost nothing to propose: json at one stream 1.93-1.97x with 5, 2.1-2.3x "
        "with 8), 7 for draft (each draft is a forward pass of the draft model; k + 1 = 8 "
        "verify rows are one block of the 8-bit GEMM's lanes: Qwen2.5-Coder-1.5B's copy at one "
        "stream 1.35x with 5, 1.71x with 7)",
    )
    ngram_min: int = Field(
        2,
        ge=1,
        description="prompt lookup: the shortest n-gram matched; default 2 (SmolLM2's drafts "
        "after a one-token match were accepted 7 to 22 times in 100, after two 75 to 87, after "
        "four 96 to 97: a verify row costs a third of a step, so one-token matches lose)",
    )
    ngram_max: int = Field(
        32, ge=1, description="prompt lookup: the longest n-gram matched (it chooses among places)"
    )
    draft_model: str | None = Field(
        None,
        description="--speculative draft: the draft model (HF dir, .gguf or a known name), "
        "with the target's tokenizer",
    )
    draft_prompt_lookup: bool = Field(
        True,
        description="--speculative draft: a row whose last 3 or more tokens occurred before "
        "drafts the tokens that followed them (prompt lookup, free), the draft model only where "
        "no such match is found (on by default: Qwen2.5-Coder-1.5B's copy 2.60x against 1.46x "
        "with the model alone, chat alike, on a Zen 5)",
        json_schema_extra={"negatable": True},
    )
    draft_vocab_size: int = Field(
        32768,
        ge=0,
        description="--speculative draft: a draft token is the draft model's best among this "
        "many lowest token ids (a BPE vocabulary's frequent ones) and the tokens its "
        "request has seen (FR-Spec); its output projection reads those rows only (GGUF heads "
        "on the CPU: Qwen2.5's 145 MB at 0.5B, 31 MB for 32768 rows). 0: the whole vocabulary",
    )
    draft_quantization: Literal["auto", "gguf", "none"] = Field(
        "auto",
        description="--speculative draft: the draft model's weights, as --quantization (auto: "
        "the same); gguf keeps a small draft's one-row decodes on the GGUF kernels",
    )

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_async_output(self) -> bool:
        return self._on_or_auto_on_cuda(self.async_output)

    def resolved_async_scheduling(self) -> bool:
        return self._on_or_auto_on_cuda(self.async_scheduling)

    def _on_or_auto_on_cuda(self, setting: str) -> bool:
        if setting == "auto":
            return self.resolved_device().type == "cuda"
        return setting == "on"

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        device = self.resolved_device()
        if device.type == "cuda" or cpu_supports_bf16():
            return torch.bfloat16
        return torch.float32

    @field_validator("served_model_name", mode="before")
    @classmethod
    def split_names(cls, value: object) -> object:
        """`CONVEYOR_SERVED_MODEL_NAME="a b"` or `a,b`; empty: derived from the model."""
        if isinstance(value, str):
            return value.replace(",", " ").split() or None
        return value

    @model_validator(mode="after")
    def check_speculation(self) -> EngineConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError("--ngram-min must not exceed --ngram-max")
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError("--speculative draft needs --draft-model")
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = 8 if self.speculative == "ngram" else 7
        return self

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_flags(parser.add_argument_group("engine"), cls)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**model_values(cls, args))
