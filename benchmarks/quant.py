"""`conveyor bench quant`: each GGUF type's quantized matmul (runtime/models/quant.py's
QuantizedLinear: the native CPU kernel for few rows, dequantized tiles for many; with --device
cuda kernels/triton_gguf.py on bfloat16 activations) against F.linear on the dequantized weight
(float32 on CPU, bfloat16 on CUDA), same shape, same threads, side by side in one run. Reports the
weight bytes read per second and their share of the machine's measured copy bandwidth (read +
write bytes a second of a large tensor copy, benchmarks/bound.py)."""

from __future__ import annotations

import argparse
import json
import platform

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.bound import best_seconds, measure_copy_bandwidth
from benchmarks.common import apply_threads, format_table, save_result
from runtime.models.quant import QuantizedLinear, quantized_kernel_types, random_blocks

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def register(sub) -> None:
    p = sub.add_parser("quant", help="quantized matmul per GGUF type vs float32 F.linear")
    p.add_argument("--types", default=",".join(TYPES), help="comma-separated GGUF types")
    p.add_argument("--rows", default="1,8,32,512", help="comma-separated row counts")
    p.add_argument("--out-features", type=int, default=8192)
    p.add_argument("--in-features", type=int, default=4096, help="a multiple of 256")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--save-result", default=None)
    p.set_defaults(func=cmd_quant)


def cmd_quant(args: argparse.Namespace) -> int:
    apply_threads(args)
    result = run_quant_bench(args)
    header = ["type", "rows", "quant ms", "dense ms", "speedup", "weight GB/s", "of copy bw"]
    print(format_table(header, result["table"]))
    print(json.dumps({k: v for k, v in result.items() if k != "table"}, indent=2))
    save_result(args.save_result, result)
    return 0


def run_quant_bench(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    bandwidth = measure_copy_bandwidth(device)
    table = []
    for name in args.types.split(","):
        qtype = gguf.GGMLQuantizationType[name]
        if qtype not in quantized_kernel_types(device):
            raise SystemExit(f"no quantized kernel for {name} on {device.type}")
        table += _bench_type(qtype, args, bandwidth, device)
    return {
        "bench": "quant",
        "cpu": platform.processor() or platform.machine(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(_dtype(device)).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "shape": [args.out_features, args.in_features],
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "table": table,
    }


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _bench_type(qtype, args, bandwidth: float, device: torch.device) -> list[list]:
    rng = np.random.default_rng(0)
    blocks = random_blocks(qtype, args.out_features, args.in_features, rng)
    linear = QuantizedLinear(blocks, qtype, args.out_features, args.in_features).to(device)
    dense = linear.dequantize(dtype=_dtype(device))
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, args.in_features, device=device, dtype=_dtype(device))
        quant_s = best_seconds(lambda x=x: linear(x), device, args.repeats)
        dense_s = best_seconds(lambda x=x: F.linear(x, dense), device, args.repeats)
        rate = linear.weight_nbytes / quant_s
        rows_out.append([qtype.name, rows, round(quant_s * 1e3, 3), round(dense_s * 1e3, 3),
                         f"{dense_s / quant_s:.2f}x", round(rate / 1e9, 2),
                         f"{rate / bandwidth:.0%}"])  # fmt: skip
    return rows_out
