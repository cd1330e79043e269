"""The grammar a tool call is held to, so an emitted call always parses and fits its schema.

This module owns :func:`tool_grammar`. A call is ``<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>``
where ``N`` is one of the allowed functions and ``A`` matches that function's parameter schema
(llama-cpp-python's JSON-schema converter, as for ``response_format``); with
``parallel_tool_calls`` several calls may follow one another. ``tool_choice``:

- ``required`` or a named function: the answer *is* calls, from its first token;
- ``auto``: the model writes text freely; from the moment it opens ``<tool_call>``, the rest
  is held to the grammar (llama.cpp's lazy grammar, triggered by that text);
- ``none``: no grammar.

A tool's ``$defs`` / ``definitions`` (what pydantic writes for nested models and lists of them)
are hoisted to the top of the call's schema, namespaced per tool, and its ``$ref``s rewritten
(:func:`hoist_definitions`). A schema the converter cannot handle is an
:class:`~edgecloud.errors.InvalidRequestError` naming the tool, before anything is generated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..tools.prompt import CLOSE, OPEN
from .structured import schema_grammar

__all__ = ["TAG_TRIGGER", "ToolGrammar", "bare_trigger", "hoist_definitions", "tool_grammar"]


@dataclass(frozen=True)
class ToolGrammar:
    """A GBNF grammar (rule ``root``) and, for ``auto``, the patterns that switch it on: regular
    expressions the whole output so far must match, group 1 where the constrained text starts."""

    grammar: str
    triggers: tuple[str, ...] = ()


#: The output reaches an opening tag (anything may come before it).
TAG_TRIGGER = r"[\s\S]*?(" + re.escape(OPEN) + r"[\s\S]*)"


def bare_trigger(names: list[str]) -> str:
    """The answer opens with a JSON object whose first key, "name", is one of ``names``, fenced
    or not, or after a slipped second opening brace (held to the grammar from the real one on;
    a model calling a function nobody declared is writing text, and stays free)."""
    alternatives = "|".join(re.escape(n) for n in names)
    return r'\s*(?:```(?:json)?\s*)?\{?\s*(\{\s*"name"\s*:\s*"(?:' + alternatives + r')"[\s\S]*)'


def _gbnf(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


#: JSON whitespace inside a call: what models write (one space, or a newline and an indent).
_SPACE = 'space ::= | " " | "\\n" [ \\t]{0,20}'


_REF_PREFIXES = ("#/$defs/", "#/definitions/")


def hoist_definitions(schema: dict[str, Any], namespace: str, into: dict[str, Any]) -> dict[str, Any]:
    """``schema`` without its ``$defs`` / ``definitions``: they move into ``into`` under names
    prefixed with ``namespace`` (so two tools' ``User`` stay apart), and every ``$ref`` to them,
    nested or recursive, is rewritten to the new place (``#/$defs/<namespace>User``). Pydantic
    writes nested models this way; once the schema is nested under a call's ``arguments``, a
    reference to ``#/$defs`` would no longer point at the top of the document."""
    local = {**schema.get("definitions", {}), **schema.get("$defs", {})}

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items() if k not in ("$defs", "definitions")}
            ref = node.get("$ref")
            if isinstance(ref, str):
                for prefix in _REF_PREFIXES:
                    if ref.startswith(prefix) and ref[len(prefix):].split("/")[0] in local:
                        out["$ref"] = "#/$defs/" + namespace + ref[len(prefix):]
            return out
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        return node

    for name, definition in local.items():
        into[namespace + name] = rewrite(definition)
    return rewrite(schema)  # type: ignore[no-any-return]


def tool_grammar(request: Any) -> ToolGrammar | None:
    """The grammar ``request``'s tools and ``tool_choice`` ask for (None: free text)."""
    choice = request.tool_mode
    if choice.mode == "none":
        return None
    alternatives = []
    definitions: dict[str, Any] = {}
    for i, tool in enumerate(request.tools):
        if tool in choice.allowed(request.tools):
            arguments = hoist_definitions(tool.function.arguments_schema, f"tool{i}_", definitions)
            alternatives.append((i, {
                "type": "object",
                "properties": {"name": {"const": tool.function.name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }))
    schema = alternatives[0][1] if len(alternatives) == 1 else {"anyOf": [a for _, a in alternatives]}
    if definitions:
        schema = {**schema, "$defs": definitions}
    param = f"tools[{alternatives[0][0]}].function.parameters" if len(alternatives) == 1 else "tools"
    body = schema_grammar(schema, param=param)
    body = re.sub(r"^root ::=", "tool-call-body ::=", body, count=1, flags=re.M)
    body = re.sub(r"^space ::= .*$", _SPACE, body, count=1, flags=re.M)
    call = f'{_gbnf(OPEN)} [ \\n]{{0,2}} tool-call-body [ \\n]{{0,2}} {_gbnf(CLOSE)}'
    more = f' ( [ \\n]{{0,2}} {call} )*' if choice.parallel else ""
    if choice.mode == "auto":
        # switched on by the opening tag, or by a bare JSON call opening the answer (small models
        # often write one, fenced or not: bare_trigger); the text from the trigger on is held to this
        root = f'root ::= {call}{more} | tool-call-body ( "```" )?\n'
        names = [t.function.name for t in choice.allowed(request.tools)]
        return ToolGrammar(root + body, triggers=(TAG_TRIGGER, bare_trigger(names)))
    return ToolGrammar(f"root ::= {call}{more}\n" + body)
