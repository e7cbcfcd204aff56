"""Models: the model config, the families, attention over the paged cache, weight loading (HF
directories and GGUF), and the tokenizer with its incremental detokenizer.

Must not import: gateway, benchmarks, scheduler, runtime.step, runtime.sampling, runtime.engine, runtime.engine_client, runtime.offline
"""
