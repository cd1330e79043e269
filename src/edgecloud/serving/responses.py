"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat path.

This module owns :class:`ResponsesRequest` and :class:`ResponseStore`, and the translation both
ways: :func:`chat_request` turns a Responses request (``input`` as text or items, ``instructions``,
function ``tools``, ``tool_choice``, ``text.format``, ``max_output_tokens``, and
``previous_response_id`` within this server's memory) into the
:class:`~edgecloud.types.ChatRequest` every backend answers; :class:`ResponseBuilder` turns the
answer's chunks back into a ``response`` object, or into the Responses stream's events
(``response.created``, ``response.output_item.added``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ``response.completed`` ...). So the OpenAI Agents
SDK's default model class, which speaks this API, runs against ``edgecloud serve`` unchanged.

Served: messages (``role`` + ``content`` as text or ``input_text`` / ``output_text`` parts),
``function_call`` and ``function_call_output`` items, function tools, ``prompt_cache_key`` (the session whose saved KV the
answer continues). Accepted and ignored:
``store``, ``metadata``, ``truncation``, ``reasoning``, ``user``, ``service_tier``, ``safety_identifier``, ``prompt_cache_retention``, ``include`` (empty, or
output-text logprobs). Anything else this server cannot do (other tool types, image or file
parts, ``background``, ``conversation``, stored ``prompt`` templates) is a 400 naming the field.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import OrderedDict
from typing import Any

from pydantic import Field

from ..errors import InvalidRequestError
from ..tools.spec import ToolCallDelta
from ..types import ChatCompletion, ChatCompletionChunk, ChatRequest, Text, Usage, _Validated, now

__all__ = ["ResponseBuilder", "ResponseStore", "ResponsesRequest", "chat_request"]

#: Items of ``input`` this server reads (a bare ``role`` + ``content`` is a message too).
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_TEXT_PARTS = ("input_text", "output_text", "text")
_INCLUDABLE = ("message.output_text.logprobs",)


class ResponsesRequest(_Validated):
    """A ``POST /v1/responses`` body (the fields this server serves or accepts)."""

    model: Text | None = None
    input: str | list[Any]
    instructions: Text | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, gt=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    previous_response_id: Text | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    # accepted, ignored
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    user: Text | None = None
    service_tier: Text | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Text | None = None
    safety_identifier: Text | None = None
    # refused by name
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None


class ResponseStore:
    """What ``previous_response_id`` continues: each stored response's whole conversation (its
    input messages and its output), least recently used out past ``max_responses``."""

    def __init__(self, max_responses: int = 1024) -> None:
        self.max_responses = max_responses
        self._held: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, response_id: str) -> list[dict[str, Any]]:
        with self._lock:
            messages = self._held.get(response_id)
            if messages is None:
                raise InvalidRequestError(f"invalid 'previous_response_id': no response {response_id!r} is held by "
                                          "this server (it keeps the most recent ones in memory; send the whole "
                                          "input instead)", param="previous_response_id")
            self._held.move_to_end(response_id)
            return list(messages)

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        with self._lock:
            self._held[response_id] = messages
            while len(self._held) > self.max_responses:
                self._held.popitem(last=False)


def _refuse(body: ResponsesRequest) -> None:
    for name, value, why in (
        ("background", body.background, "background responses are not supported here; leave 'background' out"),
        ("conversation", body.conversation, "conversations are not stored here; use previous_response_id or send "
                                            "the whole input"),
        ("prompt", body.prompt, "stored prompt templates are not available here; send 'instructions' and 'input'"),
    ):
        if value:
            raise InvalidRequestError(f"invalid '{name}': {why}", param=name)
    for i, item in enumerate(body.include or []):
        if item not in _INCLUDABLE:
            raise InvalidRequestError(f"invalid 'include[{i}]': {item!r} is not served here (only "
                                      f"{', '.join(_INCLUDABLE)})", param=f"include[{i}]")


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"invalid '{where}[{j}]': these models read text only; content parts of "
                                          f"type {kind!r} are not supported (send input_text)", param=f"{where}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(f"invalid '{where}': send a string or a list of input_text parts", param=where)


def _messages(items: list[Any]) -> list[dict[str, Any]]:
    """Chat messages from ``input`` items: consecutive function calls join one assistant turn."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidRequestError(f"invalid 'input[{i}]': an item is an object", param=f"input[{i}]")
        kind = item.get("type", "message")
        if kind not in _ITEM_TYPES:
            raise InvalidRequestError(f"invalid 'input[{i}].type': {kind!r} items are not served here (use "
                                      f"{', '.join(_ITEM_TYPES)})", param=f"input[{i}].type")
        if kind == "message":
            role = item.get("role")
            out.append({"role": role, "content": _text_of(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"input[{i}].output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
    return out


def _tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidRequestError(f"invalid 'tools[{i}].type': only function tools are served here, not "
                                      f"{kind!r}", param=f"tools[{i}].type")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "answer"), "schema": fmt.get("schema")}}
    return {"type": fmt.get("type")}


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[ChatRequest, list[dict[str, Any]]]:
    """The chat request that answers ``body`` after ``history`` (a previous response's conversation),
    and the conversation it continues (to store with the answer)."""
    _refuse(body)
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    conversation = history + _messages(items)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = {
        "messages": system + conversation, "tools": _tools(body.tools), "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "response_format": _format(body.text),
        "logprobs": bool(body.include and body.top_logprobs is not None) or None, "top_logprobs": body.top_logprobs,
        "prompt_cache_key": body.prompt_cache_key,
    }
    try:
        request = ChatRequest(**{k: v for k, v in fields.items() if v is not None})
    except InvalidRequestError as exc:
        param = exc.param or "input"
        renamed = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
        head, _, rest = param.partition(".")
        head_name = renamed.get(head.split("[")[0], head.split("[")[0])
        raise InvalidRequestError(str(exc), param=head_name + head[len(head.split("[")[0]):] +
                                  (f".{rest}" if rest else "")) from exc
    return request, conversation


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """The ``response`` object of one answer, and its stream's events, from the answer's chunks."""

    def __init__(self, body: ResponsesRequest, model: str, previous: str | None) -> None:
        self.body, self.model, self.previous = body, model, previous
        self.id, self.created = _new_id("resp"), now()
        self._sequence = 0
        self._message_id = _new_id("msg")
        self._text: list[str] = []
        self._opened = False
        self._calls: dict[int, dict[str, Any]] = {}  # function_call items by the chat call's index
        self._call_outputs: dict[int, int] = {}  # their output_index

    def response(self, status: str = "completed", output: list[dict[str, Any]] | None = None,
                 usage: Usage | None = None, finish: str | None = None) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output or [], "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": b.instructions, "metadata": b.metadata or {}, "previous_response_id": self.previous,
            "parallel_tool_calls": b.parallel_tool_calls is not False, "temperature": b.temperature, "top_p": b.top_p,
            "tool_choice": b.tool_choice or "auto", "tools": b.tools or [], "max_output_tokens": b.max_output_tokens,
            "store": b.store is not False, "text": b.text or {"format": {"type": "text"}},
            "truncation": b.truncation or "disabled",
            "usage": None if usage is None else {
                "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens_details": {"reasoning_tokens": 0}},
        }

    def _message(self, status: str) -> dict[str, Any]:
        part = {"type": "output_text", "text": "".join(self._text), "annotations": [], "logprobs": []}
        return {"type": "message", "id": self._message_id, "status": status, "role": "assistant",
                "content": [part] if status == "completed" or self._text else []}

    def completed(self, answer: ChatCompletion) -> dict[str, Any]:
        """The whole ``response`` of a finished (non-streamed) answer."""
        choice = answer.choices[0]
        output: list[dict[str, Any]] = []
        if choice.message.content:
            self._text = [choice.message.content]
            output.append(self._message("completed"))
        output += [self._call_item(call.id, call.function.name, call.function.arguments, "completed")
                   for call in choice.message.tool_calls or []]
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        return self.response(status, output, answer.usage, choice.finish_reason)

    def output_messages(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        """The response's output as chat messages (what a later ``previous_response_id`` continues)."""
        text = "".join(p["text"] for item in response["output"] if item["type"] == "message" for p in item["content"])
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in response["output"] if item["type"] == "function_call"]
        return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]

    @staticmethod
    def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {"type": "function_call", "id": _new_id("fc"), "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}

    # ------------------------------------------------------------------ streamed events

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence, **fields}

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.response("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def chunk(self, chunk: ChatCompletionChunk) -> list[dict[str, Any]]:
        """The events one chat chunk makes: text deltas, and each tool call (with its arguments)."""
        events: list[dict[str, Any]] = []
        for choice in chunk.choices:
            text = choice.delta.content or ""
            if text:
                if not self._opened:
                    self._opened = True
                    events.append(self._event("response.output_item.added", output_index=0,
                                              item=self._message("in_progress")))
                    events.append(self._event("response.content_part.added", item_id=self._message_id,
                                              output_index=0, content_index=0,
                                              part={"type": "output_text", "text": "", "annotations": []}))
                self._text.append(text)
                events.append(self._event("response.output_text.delta", item_id=self._message_id, output_index=0,
                                          content_index=0, delta=text, logprobs=[]))
            for piece in choice.delta.tool_calls or []:
                events += self._call_piece(piece)
        return events

    def _call_piece(self, piece: ToolCallDelta) -> list[dict[str, Any]]:
        """Events of one piece of a tool call: the item opens with the piece that has the call's id
        (closing the call before it), its arguments arrive as deltas, it closes when the next call
        opens or the answer ends."""
        events: list[dict[str, Any]] = []
        function = piece.function
        item = self._calls.get(piece.index)
        if item is None:
            if piece.id is None or function is None:
                return events  # not the opening piece of a call: nothing to attach it to
            events += self._close_calls()
            item = self._call_item(piece.id, function.name or "", "", "in_progress")
            self._calls[piece.index] = item
            self._call_outputs[piece.index] = len(self._calls) - 1 + (1 if self._opened else 0)
            events.append(self._event("response.output_item.added", output_index=self._call_outputs[piece.index],
                                      item=dict(item)))
        if function is not None and function.arguments:
            item["arguments"] += function.arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self._call_outputs[piece.index], delta=function.arguments))
        return events

    def _close_calls(self, status: str = "completed") -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for index, item in self._calls.items():
            if item["status"] == "in_progress":
                item["status"] = status
                where = self._call_outputs[index]
                events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=where, arguments=item["arguments"]))
                events.append(self._event("response.output_item.done", output_index=where, item=dict(item)))
        return events

    def finish(self, usage: Usage | None, finish: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events and the final ``response``."""
        # a call still open when the token budget ran out is cut off: incomplete, like the response
        events = self._close_calls("incomplete" if finish == "length" else "completed")
        output: list[dict[str, Any]] = []
        if self._opened:
            text = "".join(self._text)
            part = {"type": "output_text", "text": text, "annotations": []}
            events.append(self._event("response.output_text.done", item_id=self._message_id, output_index=0,
                                      content_index=0, text=text, logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=self._message_id, output_index=0,
                                      content_index=0, part=part))
            events.append(self._event("response.output_item.done", output_index=0, item=self._message("completed")))
            output.append(self._message("completed"))
        output += [self._calls[i] for i in sorted(self._calls)]
        status = "incomplete" if finish == "length" else "completed"
        final = self.response(status, output, usage, finish)
        events.append(self._event(f"response.{status}", response=final))
        return events, final


def sse_event(event: dict[str, Any]) -> bytes:
    """One server-sent event of the Responses stream (``event:`` names its type, as OpenAI sends it)."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
