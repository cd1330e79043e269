"""Rendering a conversation with the chat template stored in a GGUF file.

This module owns :class:`ChatTemplate`: the jinja2 template from a model's
``tokenizer.chat_template`` metadata, rendered exactly as llama-cpp-python's
``Jinja2ChatFormatter`` and Hugging Face ``transformers`` render it (sandboxed environment,
``trim_blocks`` / ``lstrip_blocks``, ``loopcontrols``, a pass-through ``{% generation %}`` tag,
``tojson`` without ASCII escaping, ``raise_exception`` and ``strftime_now`` helpers, and the
model's ``bos_token`` / ``eos_token`` strings). It has no llama.cpp dependency so every
runtime that needs "the same prompt llama.cpp would see" (the torch engine, the ONNX
backend) can share it.

It also finds the *conversation-independent prefix* of a template (the tokens every chat
starts with, typically a default system prompt), which the llama.cpp backend pre-computes
at load time so even the first question skips it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import InvalidRequestError
from ..tools.prompt import plain_tool_messages, template_renders_tools

__all__ = ["ChatTemplate", "CHATML_TEMPLATE", "common_prefix_len"]

#: Used when a GGUF file carries no template (base models): plain ChatML.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: Two user turns that share nothing; the tokens both renderings start with are the
#: template's fixed prefix.
_PROBES = ("Hi", "7 + 5 = ?")


class _IgnoreGenerationTags(jinja2.ext.Extension):
    """Pass-through for Hugging Face's ``{% generation %}`` chat-template tag."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise InvalidRequestError(f"the model's chat template rejected the conversation: {message}", param="messages")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source or CHATML_TEMPLATE
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = ImmutableSandboxedEnvironment(
            loader=jinja2.BaseLoader(),
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_IgnoreGenerationTags, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        #: Whether the template renders ``tools`` and tool messages itself (else they are rewritten
        #: into plain turns: :func:`~edgecloud.tools.prompt.plain_tool_messages`).
        self.renders_tools = template_renders_tools(self.source)
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"the model's chat template does not compile: {exc}") from exc

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, str], *, bos_token: str, eos_token: str) -> "ChatTemplate":
        """The template named ``tokenizer.chat_template`` in GGUF metadata (ChatML if absent)."""
        return cls(metadata.get("tokenizer.chat_template"), bos_token=bos_token, eos_token=eos_token)

    def render(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for ``messages`` (``{"role", "content"}`` dicts, with ``tool_calls`` /
        ``tool_call_id`` where a conversation has them) offering ``tools`` (OpenAI's shape)."""
        has_tool_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
        if (tools or has_tool_turns) and not self.renders_tools:
            messages, tools = plain_tool_messages(messages, tools), None
        try:
            return self._template.render(
                messages=list(messages),
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                raise_exception=_raise_exception,
                add_generation_prompt=add_generation_prompt,
                functions=None,
                function_call=None,
                tools=list(tools) if tools else None,
                tool_choice=None,
                strftime_now=_strftime_now,
            )
        except InvalidRequestError:
            raise
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(
                f"the model's chat template failed on this conversation: {exc}", param="messages"
            ) from exc

    def prompt(
        self, messages: Sequence[dict[str, Any]], *, continue_final: bool = False,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """The text a model is given: a new assistant turn opened, or, with ``continue_final``,
        the last (assistant) message left open so generation continues it (vLLM's
        ``continue_final_message``): the conversation is rendered as it is and cut right
        after that message's text, dropping the end-of-turn the template adds.
        """
        if not continue_final:
            return self.render(messages, add_generation_prompt=True, tools=tools)
        partial = messages[-1]["content"] if messages else ""
        if not messages or messages[-1]["role"] != "assistant" or not partial:
            raise InvalidRequestError(
                "continue_final_message needs a non-empty assistant message last", param="messages"
            )
        text = self.render(messages, add_generation_prompt=False, tools=tools)
        end = text.rfind(partial)
        if end < 0:  # the template rewrote the message (e.g. stripped it): match it stripped
            partial = partial.strip()
            end = text.rfind(partial)
        if end < 0:
            raise InvalidRequestError(
                "this model's chat template does not keep the assistant text verbatim, so it cannot be continued",
                param="messages",
            )
        return text[: end + len(partial)]

    def fixed_prefix_tokens(self, tokenize: Callable[[str], list[int]]) -> list[int]:
        """Tokens every single-user-turn conversation starts with (e.g. a default system prompt)."""
        return self.next_turn_prefix_tokens(tokenize, [])

    def next_turn_prefix_tokens(
        self, tokenize: Callable[[str], list[int]], history: Sequence[dict[str, str]]
    ) -> list[int]:
        """Tokens the prompt of the next user turn after ``history`` is sure to start with.

        Found as the common prefix of two renderings that differ only in that user's text, so
        it is exact for this tokenizer whatever the template does around the content.
        """
        rendered = [
            tokenize(self.render([*history, {"role": "user", "content": probe}])) for probe in _PROBES
        ]
        return rendered[0][: common_prefix_len(rendered[0], rendered[1])]
