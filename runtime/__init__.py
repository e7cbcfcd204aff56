"""The runtime: the model (Llama family) over a flat ragged batch, weight loading, KV cache
tensors and swap copies, the sampler, tokenizer and detokenizer, the synchronous `Engine` and
the `EngineClient` that runs it on its own thread, and offline generation. It carries out what
the scheduler decided and decides nothing itself.

Must not import: gateway, benchmarks
"""
