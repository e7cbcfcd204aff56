"""The OpenAI-compatible API: request bodies (`schemas`), response models (`responses`), the plan
of a request (`planning`), its admitted life (`tracking`), the fan-out to the engine
(`generation`), rendering and SSE (`rendering`), and the route table (`routes`).

Must not import: gateway.admin
"""
