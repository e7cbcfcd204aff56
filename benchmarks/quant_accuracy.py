"""`conveyor bench quant-accuracy`: a GGUF model served on its quantized blocks
(`--quantization gguf`) against the same file dequantized to float32 (`--quantization none`, the
oracle), teacher-forced on a fixed text: how often the next-token argmax agrees, and both
perplexities. The text is prefilled in chunks of at most the decode kernel's row count: its matmuls
run the prompt kernels (`--quantized-activations int8`: 8-bit activations in bfloat16), the logits
the decode kernel (int16 activations, integer dot products)."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import save_result
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.models import cpu_kernels
from scheduler.request import SamplingParams

TEXT_FILES = ("README.md", "docs/architecture.md", "docs/benchmarks.md")


@dataclass
class TeacherForced:
    """Per position i of the text but the last: the argmax after tokens [0, i] and the
    log-probability of token i + 1."""

    argmax: torch.Tensor  # [n - 1] int64
    target_logprobs: torch.Tensor  # [n - 1] float64

    @property
    def perplexity(self) -> float:
        return math.exp(-self.target_logprobs.mean().item())


def register(sub) -> None:
    p = sub.add_parser(
        "quant-accuracy",
        help="teacher-forced argmax agreement and perplexity, quantized vs dequantized float32",
    )
    p.add_argument("--model", required=True, help="a GGUF file or a known model name")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the fixed text")
    p.add_argument("--dtype", default="float32", help="the quantized path's activations")
    p.add_argument(
        "--quantized-activations", choices=("auto", "int8", "dtype"), default="auto",
        help="as `conveyor serve`'s: prompt rows in 8 bits (int8), in --dtype, or the family's",
    )  # fmt: skip
    p.add_argument("--save-result", default=None)
    p.set_defaults(func=cmd_quant_accuracy)


def cmd_quant_accuracy(args: argparse.Namespace) -> int:
    result = compare(args.model, args.tokens, args.dtype, args.quantized_activations)
    print(json.dumps(result, indent=2))
    save_result(args.save_result, result)
    return 0


def compare(model: str, num_tokens: int, dtype: str = "float32", activations: str = "auto") -> dict:
    oracle_engine = _engine(model, "none", "float32")
    ids = fixed_text_ids(oracle_engine, num_tokens)
    oracle = teacher_forced(oracle_engine, ids)
    del oracle_engine
    quantized = teacher_forced(_engine(model, "gguf", dtype, activations), ids)
    agreement = (quantized.argmax == oracle.argmax).double().mean().item()
    return {
        "bench": "quant-accuracy",
        "model": model,
        "tokens": len(ids),
        "dtype": dtype,
        "quantized_activations": activations,
        "argmax_agreement": round(agreement, 5),
        "perplexity_quantized": round(quantized.perplexity, 4),
        "perplexity_float32": round(oracle.perplexity, 4),
        "perplexity_change": round(quantized.perplexity / oracle.perplexity - 1, 5),
    }


def _engine(model: str, quantization: str, dtype: str, activations: str = "auto") -> Engine:
    return Engine(
        EngineConfig(
            model=model,
            quantization=quantization,
            dtype=dtype,
            quantized_activations=activations,
            max_batch_tokens=cpu_kernels.DECODE_ROWS,
            enable_prefix_caching=False,
            kv_cache_memory="1GiB",
        )
    )


def fixed_text_ids(engine: Engine, num_tokens: int) -> list[int]:
    root = Path(__file__).resolve().parent.parent
    text = "\n\n".join((root / name).read_text() for name in TEXT_FILES)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < num_tokens:
        raise SystemExit(f"the fixed text has {len(ids)} tokens, fewer than {num_tokens}")
    return ids[:num_tokens]


def final_hidden_states(engine: Engine, ids: list[int]) -> list[torch.Tensor]:
    """Prefills `ids` (chunks of max_batch_tokens): the final norm's output of each chunk,
    [chunk tokens, hidden] each, len(ids) rows in all."""
    model = engine.runner.model
    hidden_chunks: list[torch.Tensor] = []
    norm_forward = model.norm.forward

    def keep_output(*args):  # the norm is a StepModule: no forward hooks
        output = norm_forward(*args)
        hidden_chunks.append(output[0].detach().clone())
        return output

    model.norm.forward = keep_output
    try:
        engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    finally:
        del model.norm.forward
    return hidden_chunks[: _prefill_steps(len(ids), engine)]


def teacher_forced(engine: Engine, ids: list[int]) -> TeacherForced:
    """Prefills `ids` and scores every position's logits, computed from the final norm's output
    by the model's own lm_head."""
    model = engine.runner.model
    argmax, logprobs = [], []
    targets = torch.tensor(ids[1:] + [0])
    start = 0
    prompt_step = cpu_kernels.step_kind(True, int8_activations=engine.runner.int8_activations)
    with torch.inference_mode(), prompt_step:  # the kernel a prompt step's rows take
        for hidden in final_hidden_states(engine, ids):
            logits = model.compute_logits(hidden).double()
            argmax.append(logits.argmax(-1))
            picked = targets[start : start + len(hidden)].unsqueeze(1)
            logprobs.append(logits.log_softmax(-1).gather(1, picked).squeeze(1))
            start += len(hidden)
    return TeacherForced(torch.cat(argmax)[:-1], torch.cat(logprobs)[:-1])


def _prefill_steps(num_tokens: int, engine: Engine) -> int:
    return -(-num_tokens // engine.config.max_batch_tokens)
