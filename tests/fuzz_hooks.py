"""Schemathesis hooks for tests/test_openapi_fuzz.py (loaded through SCHEMATHESIS_HOOKS).

Some refusals of schema-valid requests are by design and documented, since no JSON Schema can
say what they depend on: a prompt plus max_tokens over the context length is a 400
`context_length_exceeded` (OpenAI's answer, which clients expect: the prompt's length in tokens
is not in the request), and the grammar refusals below. This check is the built-in
`positive_data_acceptance` with exactly these exceptions; the run excludes the built-in. (A
`cursor` needs none: its schema's pattern is exactly the form the server accepts.)
"""

from __future__ import annotations

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

# A JSON schema in response_format or a tool's parameters that the grammar cannot enforce, that
# is no valid schema, or that compiles past the tenant's max_grammar_bytes; a named tool_choice
# not among tools (or with no tools): no JSON Schema can say these.
GRAMMAR_REFUSALS = {"invalid_schema", "unsupported_schema_keyword", "schema_too_large"}


def is_documented_refusal(response) -> bool:
    if response.status_code != 400:
        return False
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    if error["code"] in GRAMMAR_REFUSALS or error["param"] == "tool_choice":
        return True
    return error["code"] == "context_length_exceeded"


@schemathesis.check
def positive_data_acceptance_but_documented(ctx, response, case):
    if is_documented_refusal(response):
        return None
    return positive_data_acceptance(ctx, response, case)
