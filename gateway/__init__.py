"""The gateway: everything between an HTTP client and the engine.

The server shell lives at this level: the app factory (`app`), settings, typed app keys,
lifecycle and drain, errors, the database and Redis connections, SQL models, Prometheus
metrics, `conveyor serve` and the CLI. The rooms below it own the rest: `openai/` (the OpenAI
API), `tenancy/` (keys, tenants, limits, admission), `audit/` (records, writer, explanations,
queries, retention) and `admin/` (REST and CLI). The engine is reached only through
`runtime.engine_client.EngineClient`; no model code runs on the event loop.

Must not import: benchmarks, kernels, runtime.step.model_runner, runtime.sampling.sampler, runtime.models.attention
"""
