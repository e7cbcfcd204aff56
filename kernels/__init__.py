"""Paged attention, KV stores, norms and RoPE: Triton kernels for CUDA and their pure-torch
references (the CPU path and the test oracle). Kernels know tensors, not requests.

Must not import: scheduler, runtime, gateway, benchmarks
"""
