"""The transformers peers of `conveyor bench offline`: `generate` on Conveyor static's batches and
transformers' own continuous batching (`generate_batch`), or a clear reason why it cannot run
with the transformers this machine has.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path

import torch

from benchmarks.common import (
    progress,
)
from benchmarks.workload import SystemRun, Workload


# ---- transformers ---------------------------------------------------------------------------
def load_transformers_model(model_dir: Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = Path(model_dir)  # an HF directory or a GGUF file
    gguf = {"gguf_file": path.name} if path.is_file() else {}
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent if gguf else path), dtype=dtype, attn_implementation="sdpa", **gguf
    )
    return model.to(device).eval()


def generate_padded(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int) -> None:
    """One static batch through `generate`: left padding, greedy, exactly max_new_tokens each."""
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    input_ids = torch.tensor(
        [[pad_id] * (width - len(p)) + p for p in prompts], device=model.device
    )
    mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device
    )
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,  # suppresses EOS: the ignore_eos of the other systems
        pad_token_id=pad_id,
    )
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
    assert out.shape[1] == width + max_new_tokens, out.shape


def run_transformers_static(model, workload: Workload, batches: list[list[int]]) -> SystemRun:
    generate_padded(model, [workload.prompts[0][:8]], 2, pad_id=0)  # warm-up
    start = time.perf_counter()
    for number, batch in enumerate(batches):
        prompts = [workload.prompts[i] for i in batch]
        generate_padded(model, prompts, max(workload.output_lens[i] for i in batch), pad_id=0)
        progress(f"  transformers static: batch {number + 1}/{len(batches)} done")
    seconds = time.perf_counter() - start
    details = {"batch_sizes": [len(b) for b in batches]}
    return SystemRun("transformers_static", seconds, sum(workload.output_lens), details)


class PeerUnavailable(Exception):
    """A peer that cannot run with the transformers this machine has; the message says why."""


def run_transformers_continuous(model, workload: Workload, engine) -> SystemRun:
    """transformers' own continuous batching, one add_request per request (its max_new_tokens),
    a paged KV cache of the same bytes as Conveyor's, the same token budget and slot cap."""
    from transformers import GenerationConfig

    gen_config = GenerationConfig(
        do_sample=False, max_new_tokens=max(workload.output_lens), eos_token_id=-1, pad_token_id=0
    )
    cb_config, page_size = generate_batch_config(engine)
    with model.continuous_batching_context_manager(
        generation_config=gen_config, continuous_batching_config=cb_config, timeout=60
    ) as manager:
        start = time.perf_counter()
        ids = [
            manager.add_request(prompt, max_new_tokens=n, eos_token_id=-1)
            for prompt, n in zip(workload.prompts, workload.output_lens)
        ]
        results = collect_results(manager, set(ids))
        seconds = time.perf_counter() - start
    output_tokens = sum(len(results[i].generated_tokens) for i in ids)
    assert output_tokens == sum(workload.output_lens), "generate_batch stopped a request early"
    details = {"page_size": page_size, "num_blocks": cb_config.num_blocks}
    return SystemRun("transformers_generate_batch", seconds, output_tokens, details)


def generate_batch_config(engine):
    """transformers' ContinuousBatchingConfig as this transformers spells it (5.x releases
    differ: the page size is `page_size` or `block_size`, a class or instance attribute)
    -> (config, tokens per page); PeerUnavailable when it offers no paged cache we can size."""
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError as error:
        raise PeerUnavailable(f"transformers has no ContinuousBatchingConfig ({error})") from None
    accepted = set(inspect.signature(ContinuousBatchingConfig).parameters)
    limits = {
        "max_batch_tokens": engine.config.max_batch_tokens,
        "max_requests_per_batch": engine.config.max_num_seqs,
    }
    limits = {name: value for name, value in limits.items() if name in accepted}
    probe = ContinuousBatchingConfig(**limits)
    page_size = next(
        (getattr(probe, name) for name in ("page_size", "block_size")
         if isinstance(getattr(probe, name, None), int)),
        None,
    )  # fmt: skip
    if page_size is None or "num_blocks" not in accepted:
        raise PeerUnavailable(
            "this transformers' ContinuousBatchingConfig takes no num_blocks or has no page size "
            f"(accepts {sorted(accepted)}), so its KV cache cannot be sized like Conveyor's"
        )
    config = ContinuousBatchingConfig(num_blocks=hf_num_blocks(engine, page_size), **limits)
    return config, page_size


def hf_num_blocks(engine, page_size: int) -> int:
    mc = engine.runner.model_config
    bytes_per_token = (
        2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * engine.runner.dtype.itemsize
    )
    return max(1, engine.runner.kv_cache.gpu.nbytes // (page_size * bytes_per_token))


def collect_results(manager, pending: set[str]) -> dict:
    results = {}
    while pending:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
            continue
        if result.is_finished() and result.request_id in pending:
            if result.error is not None:
                raise RuntimeError(f"transformers request failed: {result.error}")
            results[result.request_id] = result
            pending.discard(result.request_id)
    return results
