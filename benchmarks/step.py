"""`conveyor bench step`: what one decode step costs the host, around a forward that is nearly
free. A near-zero model (1 layer, hidden 64, SmolLM2's vocabulary of 49,152, random weights)
runs N sequences at once; a step is then the vocabulary projection, the sampler and the Python
around them. Reported: median Engine.step, ModelRunner.execute, and the part of execute spent in
the vocabulary projection plus sampling (the floor), against the issue's target of 20 ms per
step at 128 sequences in float32 on one thread. Greedy steps on CPU take the fused greedy
projection (kernels/cpu/greedy_projection.cpp); its steps alternate with steps on the logits
path in the same process, whose medians are reported beside them under "unfused". The step's
10th percentile (step_ms_p10) says what it takes in a quiet moment of a shared machine."""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import add_common_args, progress, save_result
from runtime.config import EngineConfig

NEAR_ZERO = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "eos_token_id": 2,
    "bos_token_id": 1,
}
TARGET_MS = 20.0
RUN_LEN = 5  # steps on one path before the other's turn


def register(sub) -> None:
    p = sub.add_parser("step", help="host cost of a decode step on a near-zero model")
    p.add_argument("--num-seqs", type=int, default=128)
    p.add_argument("--num-steps", type=int, default=50)
    p.add_argument("--sampling", choices=["greedy", "random"], default="greedy")
    p.add_argument("--dtype", default="float32")
    add_common_args(p)
    p.set_defaults(func=cmd_step, num_threads=1)
    p = sub.add_parser(
        "projection", help="the fused greedy projection alone vs packed projection + argmax"
    )
    p.add_argument("--num-rows", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--hidden-sizes", type=int, nargs="+", default=[64, 576])
    p.add_argument("--repeats", type=int, default=30)
    add_common_args(p)
    p.set_defaults(func=cmd_projection, num_threads=1)


def cmd_step(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.num_threads or 1)
    with tempfile.TemporaryDirectory() as tmp:
        result = run_step_bench(write_near_zero_model(Path(tmp)), args)
    print(json.dumps(result, indent=2))
    save_result(args.save_result, result)
    return 0


def cmd_projection(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.num_threads or 1)
    result = {"num_threads": torch.get_num_threads(), "cpu": _cpu_name(), "by_hidden_size": {}}
    for hidden_size in args.hidden_sizes:
        progress(f"{args.num_rows} x {hidden_size} x {args.vocab_size}, {args.repeats} repeats ...")
        figures = run_projection_bench(args.num_rows, hidden_size, args.vocab_size, args.repeats)
        result["by_hidden_size"][hidden_size] = figures
    print(json.dumps(result, indent=2))
    save_result(args.save_result, result)
    return 0


def run_projection_bench(num_rows: int, hidden_size: int, vocab_size: int, repeats: int) -> dict:
    """Medians in ms of the fused greedy projection, the packed oneDNN projection + the blocked
    argmax (the logits path on CPU float32), and the packed projection alone, taken in turn."""
    from kernels import native
    from kernels.row_max import argmax
    from runtime.models.layers import pack_weight, packed_linear

    fused = native.greedy_projection_for(torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(num_rows, hidden_size, generator=gen)
    weight = torch.randn(vocab_size, hidden_size, generator=gen) * 0.5
    packed = pack_weight(weight)
    paths = {
        "packed_and_argmax_ms": lambda: argmax(packed_linear(hidden, packed, None)),
        "packed_alone_ms": lambda: packed_linear(hidden, packed, None),
    }
    if fused is not None:
        paths["fused_ms"] = lambda: fused(hidden, weight)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, run in paths.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    figures = {name: round(1e3 * statistics.median(t), 2) for name, t in times.items()}
    if fused is not None:
        figures["fused_over_unfused"] = round(
            figures["fused_ms"] / figures["packed_and_argmax_ms"], 2
        )
    return figures


def write_near_zero_model(path: Path) -> Path:
    return write_random_llama(path, NEAR_ZERO)


def write_random_llama(path: Path, config: dict) -> Path:
    """A Llama of `config` with random weights (seed 0) and the default model's tokenizer, in
    `path`: the near-zero model here, the tests' tiny model (tests/conftest.py)."""
    from safetensors.torch import save_file

    from runtime.models.source import tokenizer_files_dir

    c = config
    gen = torch.Generator().manual_seed(0)
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    shapes = {
        "self_attn.q_proj": (c["num_attention_heads"] * d, h),
        "self_attn.k_proj": (c["num_key_value_heads"] * d, h),
        "self_attn.v_proj": (c["num_key_value_heads"] * d, h),
        "self_attn.o_proj": (h, c["num_attention_heads"] * d),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    weights = {
        "model.embed_tokens.weight": torch.randn(c["vocab_size"], h, generator=gen) * 0.5,
        "model.norm.weight": torch.ones(h),
    }
    for layer in range(c["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        for name, shape in shapes.items():
            weight = torch.randn(*shape, generator=gen) / shape[1] ** 0.5
            weights[prefix + name + ".weight"] = weight
        weights[prefix + "input_layernorm.weight"] = torch.ones(h)
        weights[prefix + "post_attention_layernorm.weight"] = torch.ones(h)
    (path / "config.json").write_text(json.dumps(c))
    save_file(weights, str(path / "model.safetensors"))
    real = tokenizer_files_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (real / name).exists():
            shutil.copy(real / name, path / name)
    return path


def run_step_bench(model_dir: Path, args: argparse.Namespace) -> dict:
    from runtime.engine import Engine
    from scheduler.request import SamplingParams

    num_blocks = args.num_seqs * 16  # room for 256 tokens each
    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            dtype=args.dtype,
            num_kv_blocks=max(num_blocks, 64),
            max_num_seqs=max(args.num_seqs, 1),
        )
    )
    temperature = 0.0 if args.sampling == "greedy" else 0.8
    params = SamplingParams(max_tokens=10**6, temperature=temperature, top_p=0.9, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    for i in range(args.num_seqs):
        prompt = torch.randint(256, 40000, (64 + i % 64,), generator=gen).tolist()
        engine.add_request(prompt, params)
    for _ in range(5):  # every prompt in, the steps are decodes from here
        engine.step()
    model = engine.runner.model
    fused = model.greedy_projection if args.sampling == "greedy" else None
    timers = _install_timers(engine.runner)
    modes = ("fused", "unfused") if fused is not None else ("unfused",)
    progress(
        f"{args.num_steps} decode steps of {args.num_seqs} sequences, {' and '.join(modes)} ..."
    )
    samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    # The paths alternate in runs of RUN_LEN steps, the first of each run not counted: the noise
    # of a shared machine falls on both alike, and each path is measured in its steady state
    # (the logits path's 25 MB of logits would evict the weights the fused path finds in cache).
    while len(samples[modes[-1]]) < args.num_steps:
        for mode in modes:
            model.greedy_projection = fused if mode == "fused" else None
            run = [_timed_step(engine, timers) for _ in range(RUN_LEN)]
            samples[mode].extend(run[1:])
    model.greedy_projection = fused
    result = {
        "num_seqs": args.num_seqs,
        "sampling": args.sampling,
        "dtype": args.dtype,
        "num_threads": torch.get_num_threads(),
        "cpu": _cpu_name(),
        "path": "fused greedy projection" if fused is not None else "logits + sampler",
    }
    result.update(_medians(samples[modes[0]]))
    if fused is not None:
        result["unfused"] = _medians(samples["unfused"])
    result["target_step_ms"] = TARGET_MS
    result["meets_target"] = result["step_ms"] <= TARGET_MS
    return result


def _cpu_name() -> str:
    """The CPU's model name and widest vector extension (the kernels are built for it)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    widest = next((f for f in ("avx512f", "avx2", "avx") if f in flags), "")
    return f"{name} ({widest})" if widest else name


def _timed_step(engine, timers: dict[str, float]) -> dict[str, float]:
    for name in timers:
        timers[name] = 0.0
    start = time.perf_counter()
    engine.step()
    return {"step": time.perf_counter() - start, **timers}


def _medians(samples: list[dict[str, float]]) -> dict:
    """Medians over steps, in ms: the step, execute, and the vocabulary projection + sampling
    (the logits path) or the fused greedy projection; and the step's 10th percentile, what a
    step takes when the (shared) machine is quiet."""

    def median_ms(values) -> float:
        return round(1e3 * statistics.median(values), 2)

    steps = sorted(s["step"] for s in samples)
    figures = {
        "step_ms": median_ms(steps),
        "step_ms_p10": round(1e3 * steps[len(steps) // 10], 2),  # a quiet moment's step
        "execute_ms": median_ms([s["execute"] for s in samples]),
        "logits_and_sampling_ms": median_ms(
            [s["logits"] + s["sampling"] + s["greedy_projection"] for s in samples]
        ),
        "num_steps": len(samples),
    }
    return figures


def _install_timers(runner) -> dict[str, float]:
    """Wraps the runner's launch and collect (together: execute), vocabulary projection, sampler
    and fused greedy projection with wall-clock timers (seconds in the current step)."""
    timers = {"execute": 0.0, "logits": 0.0, "sampling": 0.0, "greedy_projection": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[name] += time.perf_counter() - start

        return wrapper

    runner.launch = timed("execute", runner.launch)
    runner.collect = timed("execute", runner.collect)
    runner.model.compute_logits = timed("logits", runner.model.compute_logits)
    runner.sampler.sample_on_device = timed("sampling", runner.sampler.sample_on_device)
    model = runner.model
    model.compute_greedy_tokens = timed("greedy_projection", model.compute_greedy_tokens)
    return timers
