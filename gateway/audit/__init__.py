"""Why was my request slow: audit records, the writer and its spool, explanations of delays,
a request's timeline data (drawn by `gateway.pages`), the queries behind `/admin/requests` and
`/v1/requests/{id}` (whose explanation links to the timeline page), and retention.

Must not import: gateway.openai, gateway.admin, gateway.pages
"""
