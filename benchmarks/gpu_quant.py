"""`conveyor bench gpu-quant`: one decode token's quantized matmuls of a real GGUF model on a GPU.

The weights are the model's own list (each tensor's GGUF type and shape, read from the file or
from a listing that `--write-listing` made of it: a GPU machine may not hold the file), filled
with random blocks that have finite scales and repacked into kernels/gguf_planes.py's planes. For
kernels/triton_gguf_dot.py's integer-dot GEMV in a few tile shapes, and for cuBLAS on the
dequantized bfloat16 weights:

1. the relative error against F.linear on the dequantized weight, per type and shape;
2. each role's matmuls over all layers (every layer's own weight, so nothing is served from L2)
   replayed as one CUDA graph: weight bytes / time, as a share of the copy bandwidth;
3. the whole token's matmuls (the output projection included, the embedding lookup not) as one
   CUDA graph: the share of the copy bandwidth at which the token reads its weights.

    conveyor bench gpu-quant --weights benchmarks/data/qwen2.5-coder-1.5b-instruct.json
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import gguf
import torch
import torch.nn.functional as F

from benchmarks.bound import measure_copy_bandwidth
from benchmarks.gpu import relative_error
from runtime.models.quant import HALF_OFFSETS, row_bytes

Q = gguf.GGMLQuantizationType
DEVICE = torch.device("cuda")
DOT_SHAPES = [
    (256, 2, 2, 528, 8, False),
    (256, 2, 2, 528, 8, None),
    (256, 2, 2, 528, 8, True),
    (128, 2, 1, 528, 8, None),
]
# (block_n, sub-blocks per step, warps, programs wanted, partial sums summed at a time, x
# quantized inside the GEMV: None where quantizes_in_kernel says so) of the integer-dot GEMV; the
# second is its default


def listing_of(path: str) -> list[dict]:
    """Every 2-D weight of a GGUF file: name, type, [out_features, in_features]; a tied output
    projection (no output.weight) is listed as token_embd read as `output.weight`."""
    reader = gguf.GGUFReader(path)
    tensors = [
        {"name": t.name, "type": Q(t.tensor_type).name, "shape": [int(t.shape[1]), int(t.shape[0])]}
        for t in reader.tensors
        if len(t.shape) == 2
    ]
    if not any(t["name"] == "output.weight" for t in tensors):
        embedding = next(t for t in tensors if t["name"] == "token_embd.weight")
        tensors.append({**embedding, "name": "output.weight"})
    return tensors


def random_device_blocks(qtype: Q, out_features: int, in_features: int) -> torch.Tensor:
    """[out, row_bytes] uint8 on the GPU: random quants, small finite float16 scales."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = torch.randint(0, 256, (out_features, row_bytes(qtype, in_features)),
                           dtype=torch.uint8, device=DEVICE)  # fmt: skip
    per_block = blocks.view(out_features, in_features // block_values, block_bytes)
    for offset in HALF_OFFSETS[qtype]:
        halves = (torch.rand(per_block.shape[:2], device=DEVICE) - 0.5) * 0.04
        per_block[:, :, offset : offset + 2] = (
            halves.half().view(torch.uint8).view(*per_block.shape[:2], 2)
        )
    return blocks


def role_of(name: str) -> str:
    return re.sub(r"^blk\.\d+\.", "blk.*.", name)


def kernels() -> dict:
    from kernels import triton_gguf_dot

    found = {}
    for shape in DOT_SHAPES:
        block_n, subs, warps, programs, at_once, fused = shape
        fusion = {None: "", False: "q", True: "f"}[fused]
        found[f"{block_n}x{subs}w{warps}p{programs}s{at_once}{fusion}"] = (
            lambda x, planes, shape=shape: triton_gguf_dot.gguf_dot(
                x, planes, block_n=shape[0], subs=shape[1], num_warps=shape[2],
                target_programs=shape[3], splits_at_once=shape[4], fused=shape[5]))  # fmt: skip
    return found


def time_graph(calls, repeats: int = 50) -> float:
    """Seconds per replay of one CUDA graph that runs every call once (median of repeats)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compile and warm every kernel outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def check(weights: list[dict], found: dict, rows: int) -> bool:
    from kernels.triton_gguf import gguf_dequantize

    ok = True
    seen = set()
    print(f"\nerror against F.linear on the dequantized weight, {rows} row(s), bfloat16")
    for w in weights:
        key = (w["type"], tuple(w["shape"]))
        if key in seen:
            continue
        seen.add(key)
        out_features, in_features = w["shape"]
        x = torch.randn(rows, in_features, device=DEVICE, dtype=torch.bfloat16)
        dense = gguf_dequantize(w["planes"], torch.float32)
        expected = x.float() @ dense.T
        errors = {name: relative_error(fn(x, w["planes"]), expected)
                  for name, fn in found.items()}  # fmt: skip
        worst = max(errors.values())
        ok &= worst < 2e-2
        print(f"  {w['type']:5} {out_features:>6}x{in_features:<6} worst {worst:.1e}  "
              + "  ".join(f"{n}: {e:.1e}" for n, e in errors.items()))  # fmt: skip
    return ok


def calls_for(weights: list[dict], fn, rows: int) -> list:
    inputs = {}
    calls = []
    for w in weights:
        in_features = w["shape"][1]
        if in_features not in inputs:
            inputs[in_features] = torch.randn(rows, in_features, device=DEVICE,
                                              dtype=torch.bfloat16)  # fmt: skip
        x = inputs[in_features]
        if fn is None:  # cuBLAS on the dequantized weight
            calls.append(lambda x=x, d=w["dense"]: F.linear(x, d))
        else:
            calls.append(lambda x=x, planes=w["planes"]: fn(x, planes))
    return calls


def table(weights: list[dict], found: dict, rows: int, copy_rate: float) -> None:
    roles = sorted({role_of(w["name"]) for w in weights})
    groups = {role: [w for w in weights if role_of(w["name"]) == role] for role in roles}
    groups["whole token"] = weights
    print(f"\n{rows} row(s): weight bytes read / time as a share of copy bandwidth "
          f"({copy_rate / 1e9:.0f} GB/s)")  # fmt: skip
    header = f"  {'role':22} {'MB':>7} " + " ".join(f"{n:>16}" for n in found)
    print(header + f" {'cuBLAS bf16':>14}")
    for role, group in groups.items():
        quant_bytes = sum(w["planes"].data.nbytes for w in group)
        cells = []
        for fn in found.values():
            seconds = time_graph(calls_for(group, fn, rows))
            cells.append(f"{seconds * 1e6:7.0f}us {quant_bytes / seconds / copy_rate:4.0%}")
        dense_bytes = sum(w["dense"].numel() * 2 for w in group)
        seconds = time_graph(calls_for(group, None, rows))
        cells.append(f"{seconds * 1e6:7.0f}us {dense_bytes / seconds / copy_rate:4.0%}")
        print(f"  {role:22} {quant_bytes / 1e6:7.1f} " + " ".join(f"{c:>16}" for c in cells))


def run(args) -> int:
    if args.write_listing:
        Path(args.weights).write_text(json.dumps(listing_of(args.write_listing), indent=0) + "\n")
        return 0
    if not torch.cuda.is_available():
        print("no GPU present: nothing to measure")
        return 0
    from kernels.gguf_planes import repack
    from kernels.triton_gguf import gguf_dequantize

    weights = [w for w in json.loads(Path(args.weights).read_text())
               if w["name"] != "token_embd.weight"]  # fmt: skip
    for w in weights:
        qtype, (out_features, in_features) = Q[w["type"]], w["shape"]
        blocks = random_device_blocks(qtype, out_features, in_features)
        w["planes"] = repack(blocks, qtype, in_features)
        w["dense"] = gguf_dequantize(w["planes"], torch.bfloat16)
    found = kernels()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    ok = all(check(weights, found, rows) for rows in (1, 4))
    copy_rate = measure_copy_bandwidth(DEVICE)
    for rows in (int(r) for r in args.rows.split(",")):
        table(weights, found, rows, copy_rate)
    print("all checks passed" if ok else "MISMATCH: see the errors above")
    return 0 if ok else 1


def register(sub) -> None:
    p = sub.add_parser("gpu-quant", help="a GGUF model's decode matmuls on a GPU, per kernel")
    p.add_argument("--weights", required=True, help="a .json listing (see --write-listing)")
    p.add_argument("--write-listing", default=None, metavar="GGUF",
                   help="write the listing of this GGUF file to --weights and stop")  # fmt: skip
    p.add_argument("--rows", default="1,4", help="comma-separated decode row counts")
    p.set_defaults(func=run)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    parsed = parser.parse_args(["gpu-quant", *sys.argv[1:]])
    sys.exit(parsed.func(parsed))
