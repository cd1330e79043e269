"""Tools in the prompt, for chat templates that know nothing of them.

A template that renders ``tools`` itself (Qwen2.5's, Hermes-style) is given them as they are.
For one that does not (SmolLM2's plain ChatML, most base models), :func:`plain_tool_messages`
rewrites the conversation into messages such a template renders, in the same
``<tool_call>`` / ``<tool_response>`` format :mod:`edgecloud.tools.parse` reads back:

- a system message (the caller's own first, when it has one) gains a block listing the
  functions as JSON and saying how to call them;
- an assistant message's ``tool_calls`` become ``<tool_call>{"name", "arguments"}</tool_call>``
  lines after its text;
- a ``tool`` message becomes a user turn holding ``<tool_response>...</tool_response>``
  (consecutive results share one turn).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = ["OPEN", "CLOSE", "call_text", "plain_tool_messages", "template_renders_tools"]

#: The tags a call is written between (Hermes / Qwen2.5 format).
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def template_renders_tools(source: str) -> bool:
    """Whether a jinja chat template renders ``tools`` and tool messages itself."""
    return "tools" in source and "tool_call" in source


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it."""
    return f'{OPEN}\n{json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)}\n{CLOSE}'


def _tools_block(tools: Sequence[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou can call these functions to help with the user's request. Their signatures, "
            f"as JSON:\n<tools>\n{listed}\n</tools>\n\nTo call one, answer with a JSON object holding the "
            f'function name and its arguments between {OPEN} and {CLOSE} tags:\n{OPEN}\n'
            f'{{"name": <function-name>, "arguments": <arguments-object>}}\n{CLOSE}')


def plain_tool_messages(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``messages`` as plain ``{"role", "content"}`` turns, tools described in the system turn."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
            continue
        if role == "assistant" and message.get("tool_calls"):
            calls = [call_text(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
            content = "\n".join([content, *calls] if content else calls)
        out.append({"role": role, "content": content})
    for message in out:
        message.pop("_tool_results", None)
    if tools:
        block = _tools_block(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
