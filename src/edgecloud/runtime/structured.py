"""Structured output: a request's ``response_format`` as a grammar the decoder is held to.

This module owns :func:`response_grammar`: ``{"type": "json_object"}`` becomes llama.cpp's JSON
grammar, ``{"type": "json_schema", "json_schema": {"schema": ...}}`` the grammar of that schema
(llama-cpp-python's JSON-schema converter). That converter lets control characters into
strings, which JSON forbids: its ``char`` rule is tightened here as llama.cpp's own converter
has it, so the answer always parses. It enforces types, ``required``, ``enum`` / ``const``,
``additionalProperties: false``, string lengths and array sizes, not numeric bounds
(``minimum`` / ``maximum``) or string ``format``s. A schema the converter cannot handle is an :class:`~edgecloud.errors.InvalidRequestError` naming
``response_format``, before anything is generated: an answer is never passed off as
constrained when it was not.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import InvalidRequestError

__all__ = ["response_grammar", "schema_grammar"]


def response_grammar(response_format: dict[str, Any] | None) -> str | None:
    """The GBNF grammar ``response_format`` asks for (None: free text)."""
    if not response_format or response_format.get("type") == "text":
        return None
    from llama_cpp.llama_grammar import JSON_GBNF

    if response_format["type"] == "json_object":
        return str(JSON_GBNF)
    return schema_grammar(response_format["json_schema"]["schema"], param="response_format")


def schema_grammar(schema: dict[str, Any], *, param: str) -> str:
    """The GBNF grammar (rule ``root``) of JSON text matching ``schema``; a schema the converter
    cannot handle is an InvalidRequestError naming ``param``."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        grammar = str(json_schema_to_gbnf(json.dumps(schema)))
    except Exception as exc:  # noqa: BLE001 - the converter raises bare exceptions for what it cannot handle
        raise InvalidRequestError(f"invalid '{param}': the JSON schema cannot be turned into a grammar "
                                  f"({type(exc).__name__}: {exc}); simplify it", param=param) from exc
    return grammar.replace(_LOOSE_CHAR, _JSON_CHAR)


#: The converter's string character rule, and JSON's (no raw control characters).
_LOOSE_CHAR = 'char ::= [^"\\\\]'
_JSON_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F]'

