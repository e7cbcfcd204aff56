"""Why was my request slow: audit records, the writer and its spool, explanations of delays,
the queries behind `/admin/requests` and `/v1/requests/{id}`, and retention.

Must not import: gateway.openai, gateway.admin
"""
