"""Which JSON-schema keywords a grammar can enforce, and the error for a schema it cannot.

xgrammar drops the keywords it does not implement (`not`, `if`, `dependentSchemas`, ...)
without a word, which would let an answer through that the schema forbids: such a schema is
refused here instead, naming the keyword and where it stands."""

from __future__ import annotations

import re
from typing import Any

ANNOTATIONS = frozenset({
    "$schema", "$id", "$comment", "$anchor", "title", "description", "default", "examples",
    "deprecated", "readOnly", "writeOnly", "contentEncoding", "contentMediaType",
})  # fmt: skip
ENFORCED = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties",
    "patternProperties", "propertyNames", "minProperties", "maxProperties", "items",
    "prefixItems", "minItems", "maxItems", "anyOf", "oneOf", "allOf", "$ref", "$defs",
    "definitions", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "unevaluatedProperties",
})  # fmt: skip
SUPPORTED_KEYWORDS = ANNOTATIONS | ENFORCED
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties")


class GrammarError(ValueError):
    """A grammar that cannot be compiled (invalid, unsupported or too large); `param` names
    the request field at fault, `code` is the OpenAI error code."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


def check_schema(schema: Any, where: str = "schema") -> None:
    """Raise GrammarError for a schema that is not an object (or boolean) or uses a keyword
    that the grammar would not enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"{where} must be a JSON object (a JSON schema)", code="invalid_schema")
    for keyword, value in schema.items():
        if keyword not in SUPPORTED_KEYWORDS:
            raise GrammarError(
                f"{where} uses the keyword '{keyword}', which structured outputs do not support",
                code="unsupported_schema_keyword",
            )
        for child_where, child in subschemas(keyword, value, where):
            check_schema(child, child_where)


def subschemas(keyword: str, value: Any, where: str):
    """(location, schema) of each schema nested under one keyword."""
    if keyword in SCHEMA_MAPS and isinstance(value, dict):
        return [(f"{where}.{keyword}.{name}", child) for name, child in value.items()]
    if keyword in SCHEMA_LISTS and isinstance(value, list):
        return [(f"{where}.{keyword}[{i}]", child) for i, child in enumerate(value)]
    if keyword in SCHEMA_VALUES and isinstance(value, dict | list) and value != []:
        children = value if isinstance(value, list) else [value]
        return [(f"{where}.{keyword}", child) for child in children]
    return []


_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


def compiler_message(error: Exception) -> str:
    """xgrammar's message without its time stamp and C++ source location."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return _XGRAMMAR_PREFIX.sub("", text)
