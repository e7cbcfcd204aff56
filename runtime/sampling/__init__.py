"""Sampling: the batched sampler over a step's logits, its operations (penalties, top-k/p/min-p,
seeded draws, logprobs), the per-step sampling plan, and the hook that applies grammar masks.

Must not import: gateway, benchmarks, runtime.step, runtime.engine, runtime.engine_client, runtime.offline
"""
