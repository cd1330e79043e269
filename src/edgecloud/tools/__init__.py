"""Tool calls: OpenAI's function tools on every runtime edgecloud ships.

This package owns what a tool-bearing request needs beyond plain chat:

- :mod:`.spec`: the request shapes (``tools``, ``tool_choice``, assistant ``tool_calls``,
  ``tool`` messages) and their validation (a parameter schema that is not JSON Schema, a
  ``tool_choice`` naming an unknown function, a tool result without its call are refused by
  name);
- :mod:`.prompt`: the conversation as a chat template sees it (arguments as objects, as the
  Hugging Face templates expect), and a tools block for templates that have none;
- :mod:`.parse`: the model's ``<tool_call>{...}</tool_call>`` output, streamed, turned into
  OpenAI ``tool_calls`` deltas (each call whole, in one delta: a call is never split between
  chunks, so never between the edge and the cloud either).

The grammar a call is held to is the runtime's (:mod:`edgecloud.runtime.tool_grammar`): this
package is plain Python below ``runtime/``, with no model or llama.cpp dependency.
"""

from __future__ import annotations

from .spec import ToolCall, ToolChoice, ToolSpec, check_tool_history, resolve_tool_choice

__all__ = ["ToolCall", "ToolChoice", "ToolSpec", "check_tool_history", "resolve_tool_choice"]
