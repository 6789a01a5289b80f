"""A randomized mix of structured-output requests and the checks their outputs must pass.

JSON schemas (nested objects, arrays with min/max items, enums, bounded integers, required and
optional fields, $ref), regexes, choices and an EBNF grammar; each output is checked with
`jsonschema`, `re.fullmatch` or membership. Shared by the engine tests and the server tests.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

import jsonschema

from compiled_engine import SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "$defs": {
        "item": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["sku", "qty"],
            "additionalProperties": False,
        }
    },
    "properties": {
        "id": {"type": "integer", "minimum": 1000, "maximum": 9999},
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
        "note": {"type": "string", "maxLength": 4},
    },
    "required": ["id", "items"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "point": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -5, "maximum": 5},
                "y": {"type": "integer", "minimum": -5, "maximum": 5},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "tags": {
            "type": "array",
            "items": {"enum": ["red", "green", "blue"]},
            "minItems": 2,
            "maxItems": 4,
        },
        "level": {"enum": [1, 2, 3]},
    },
    "required": ["point", "tags", "level"],
    "additionalProperties": False,
}
SCHEMAS = (PERSON, ORDER, NESTED)
REGEXES = (r"[0-9]{3}-[a-z]{2,4}", r"(yes|no|maybe)!?", r"[A-F0-9]{4}( [A-F0-9]{4}){0,2}")
CHOICES = (("alpha", "beta", "gamma"), ("cat", "dog"), ("north", "south", "east", "west"))
# Sums of small numbers; the regex below accepts exactly the same strings.
SUM_GRAMMAR = 'root ::= num (" + " num){0,3}\nnum ::= [1-9] [0-9]?'
SUM_REGEX = r"[1-9][0-9]?( \+ [1-9][0-9]?){0,3}"
PROMPTS = ("Answer in JSON:", "def parse(text):", "The result is", "import json\n", "Q: pick one. A:")


@dataclass(frozen=True)
class Case:
    prompt: str
    params: SamplingParams

    def check(self, text: str) -> None:
        """Raise (AssertionError or jsonschema's ValidationError) unless `text` keeps the constraint."""
        so = self.params.structured_outputs
        assert so is not None
        if so.json is not None:
            jsonschema.validate(json.loads(text), so.json)
        elif so.json_object:
            assert isinstance(json.loads(text), dict), text
        elif so.regex is not None:
            assert re.fullmatch(so.regex, text), (so.regex, text)
        elif so.choice is not None:
            assert text in so.choice, (so.choice, text)
        else:
            assert re.fullmatch(SUM_REGEX, text), text


def structured_cases(
    count: int, seed: int = 0, *, max_tokens: int = 160, json_object: bool = True
) -> list[Case]:
    """`json_object=False` leaves out free-form JSON objects (the slowest to finish: any keys)."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        kind = i % 6
        if kind <= 2:
            so = StructuredOutputsParams(
                json=SCHEMAS[rng.randrange(len(SCHEMAS))], disable_any_whitespace=True
            )
        elif kind == 3:
            so = StructuredOutputsParams(regex=rng.choice(REGEXES))
        elif kind == 4:
            so = StructuredOutputsParams(choice=list(rng.choice(CHOICES)))
        else:
            so = (
                StructuredOutputsParams(grammar=SUM_GRAMMAR)
                if rng.random() < 0.5 or not json_object
                else StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
            )
        params = SamplingParams(
            temperature=1.0,
            max_tokens=max_tokens,
            n=2 if rng.random() < 0.15 else 1,
            seed=rng.randrange(1 << 20) if rng.random() < 0.5 else None,
            structured_outputs=so,
        )
        # Some long prompts (chunked prefill) and many shared ones (prefix caching).
        prompt = rng.choice(PROMPTS) * (rng.choice([1, 1, 1, 8]))
        cases.append(Case(prompt, params))
    return cases
