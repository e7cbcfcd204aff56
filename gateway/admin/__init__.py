"""Operators' tools: the admin REST sub-app under `/admin` and the `conveyor tenants|keys|db`
commands.

Must not import: gateway.openai
"""
