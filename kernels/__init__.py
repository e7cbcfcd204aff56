"""Paged attention, KV stores, norms and RoPE: Triton kernels for CUDA, native C++ kernels for
CPU decode attention (kernels/cpu/, built once per machine by kernels/native.py), and their
pure-torch references (the CPU path and the test oracle). Kernels know tensors, not requests.

Must not import: scheduler, runtime, gateway, benchmarks
"""
