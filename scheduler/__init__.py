"""Scheduling as a pure function of its state and the model's outputs: `Request` and its status,
waiting lines and policies, the block manager (ids and refcounts, prefix hashes, the CPU swap
pool), preemption, fair share, and the delay events of the audit trail.

Must not import: torch, runtime, kernels, gateway, benchmarks
"""
