"""The step: what turns a scheduler output into device inputs and runs it. The persistent input
batch, the host staging buffers and their one copy each way, the typed step inputs, the model
runner (launch, land), CUDA graphs, and the KV cache tensors with their swap copies.

Must not import: gateway, benchmarks, runtime.engine, runtime.engine_client, runtime.offline
"""
