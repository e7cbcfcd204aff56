"""Who may call and how much: tenants, API keys and authentication, rate limits, concurrency
leases and quotas in Redis, and admission.

Must not import: gateway.openai, gateway.audit, gateway.admin
"""
