"""The runtime carries out what the scheduler decided and decides nothing itself. Its root holds
the synchronous `Engine`, the `EngineClient` that runs it on its own thread, offline generation
and the engine's settings; its rooms are `step/` (input batch, staging, model runner, CUDA
graphs, KV cache tensors), `sampling/` (sampler, its ops and plan), `models/` (config, families,
attention, weight loading, tokenizer) and `structured/` (grammars, matchers, masks).

Must not import: gateway, benchmarks
"""
