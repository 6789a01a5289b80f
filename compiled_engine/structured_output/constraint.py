"""A request's `StructuredOutputsParams` → an xgrammar `Grammar`, checked when the request is added.

Parsing a schema, regex or EBNF grammar is cheap (no tokenizer involved), so it runs on the
request's own path: any problem is an `InvalidRequestError` naming it, before anything is queued.
Compiling the grammar against the vocabulary (the slow part) happens later, off the step loop
(compiled_engine/structured_output/compiler.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import xgrammar as xgr

from compiled_engine.errors import InvalidRequestError
from compiled_engine.sampling_params import StructuredOutputsParams

# JSON-schema keywords xgrammar would silently ignore, so an output could break them: refused
# rather than promised and not kept.
_UNSUPPORTED_KEYWORDS = {
    "multipleOf": "numbers that are multiples of a value",
    "uniqueItems": "arrays of unique items",
    "contains": "arrays that must contain a match",
    "minContains": "arrays that must contain a match",
    "maxContains": "arrays that must contain a match",
    "patternProperties": "properties matched by pattern",
    "propertyNames": "constraints on property names",
    "dependentRequired": "dependent properties",
    "dependentSchemas": "dependent schemas",
    "if": "conditional schemas",
    "not": "negated schemas",
    "unevaluatedProperties": "unevaluated properties",
    "unevaluatedItems": "unevaluated items",
}
# Whitespace characters allowed in one gap between JSON tokens when whitespace is free: enough for
# pretty-printing several levels deep, too few for a model to spend its max_tokens on blank lines.
MAX_WHITESPACE_RUN = 20
# Keywords whose value is a schema, a list of schemas or a map of them (where to look for more).
_SUBSCHEMA_KEYWORDS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LIST_KEYWORDS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAP_KEYWORDS = ("properties", "$defs", "definitions")


def build_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The grammar of a constraint; InvalidRequestError naming the problem when it has one."""
    kind = params.kind
    try:
        if kind == "json":
            assert params.json is not None
            check_json_schema_supported(params.json)
            return xgr.Grammar.from_json_schema(
                json.dumps(params.json),
                any_whitespace=not params.disable_any_whitespace,
                max_whitespace_cnt=MAX_WHITESPACE_RUN,
                strict_mode=True,
            )
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(
                json.dumps({"type": "object"}),
                any_whitespace=not params.disable_any_whitespace,
                max_whitespace_cnt=MAX_WHITESPACE_RUN,
            )
        if kind == "regex":
            assert params.regex is not None
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice or ()))
        assert params.grammar is not None
        return xgr.Grammar.from_ebnf(params.grammar)
    except InvalidRequestError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the parser's message
        raise InvalidRequestError(f"structured_outputs.{kind} is invalid: {_first_line(exc)}") from None


def choice_ebnf(choices: tuple[str, ...] | list[str]) -> str:
    """EBNF accepting exactly one of `choices` (each a JSON-escaped string literal)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_json_schema_supported(schema: Any) -> None:
    """Refuse schema keywords the backend cannot enforce, naming the first one found and where."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"structured_outputs.json must be a JSON schema object, got {schema!r}")
    for path, node in _subschemas(schema, "#"):
        for keyword, what in _UNSUPPORTED_KEYWORDS.items():
            if keyword in node:
                raise InvalidRequestError(
                    f"structured_outputs.json uses {keyword!r} at {path} ({what}), which the "
                    "structured-output backend (xgrammar) does not support"
                )
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            raise InvalidRequestError(
                f"structured_outputs.json has $ref {ref!r} at {path}: only local references "
                "(#/$defs/...) are supported"
            )


def _subschemas(node: dict, path: str) -> Iterator[tuple[str, dict]]:
    yield path, node
    for keyword in _SUBSCHEMA_KEYWORDS:
        child = node.get(keyword)
        if isinstance(child, dict):
            yield from _subschemas(child, f"{path}/{keyword}")
    for keyword in _SUBSCHEMA_LIST_KEYWORDS:
        children = node.get(keyword)
        if isinstance(children, list):
            for i, child in enumerate(children):
                if isinstance(child, dict):
                    yield from _subschemas(child, f"{path}/{keyword}/{i}")
    for keyword in _SUBSCHEMA_MAP_KEYWORDS:
        children = node.get(keyword)
        if isinstance(children, dict):
            for name, child in children.items():
                if isinstance(child, dict):
                    yield from _subschemas(child, f"{path}/{keyword}/{name}")


# xgrammar's messages start with a timestamp and its C++ source location: not the user's business.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def _first_line(exc: BaseException) -> str:
    text = _CPP_PREFIX.sub("", str(exc).strip()) or type(exc).__name__
    return text.splitlines()[0] if len(text) > 300 else text
