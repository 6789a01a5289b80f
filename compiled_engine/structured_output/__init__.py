"""Constrained decoding on xgrammar: JSON schema, JSON object, regex, choice and EBNF grammars.

constraint.py parses a request's StructuredOutputsParams (errors name the problem), compiler.py
compiles each distinct constraint once off the step loop, request_grammar.py follows one request
through its grammar, logits_mask.py applies a step's masks to the logits. docs/structured_outputs.md.
"""
