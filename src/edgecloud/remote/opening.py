"""The cloud's own tokens, streamed by id in a token session: how it opens a verified answer.

This module owns :class:`TokenStream`: one streamed ``/v1/completions`` request whose prompt is
token ids, greedy, ``max_tokens`` long, that asks for the ids of what it generates
(``return_token_ids``, vLLM's field, which ``edgecloud serve`` takes too). Iterating it gives the
generated token ids as the server writes them; once exhausted it says how the generation ended
(``finish``: ``"stop"`` where the model ended the answer) and what it cost (``sent``, ``cached``,
``generated``). In a token session (:class:`~edgecloud.runtime.scoring.TokenSession`) only what
the server does not hold is sent, and a server that then holds the generated tokens too says so
on the last chunk (``edgecloud serve``): the session moves on, and the next check sends only what
follows them. A server that says nothing leaves the session as it was (the next check sends the
context whole; a prefix cache reads it).

An endpoint that streams text without the ids is remembered in its capabilities
(``stream_ids``) and refused with :class:`~edgecloud.errors.ExtensionUnsupportedError` before
any token is handed out; so is one that refuses the request's fields.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from ..capabilities import Capabilities
from ..errors import (BackendError, ContextOverflowError, EdgeCloudError, ExtensionUnsupportedError,
                      InvalidRequestError, SessionExpiredError)
from ..runtime.scoring import TokenSession
from ..types import FinishReason
from .wire import usage_counts

__all__ = ["TokenStream"]

#: POSTs a JSON body to a URL and returns the 2xx response, still streaming (the client's retries).
Post = Callable[[dict[str, Any], str], httpx.Response]


class TokenStream:
    """The cloud's greedy continuation of ``tokens``, up to ``max_tokens``, by token id (see the
    module docstring). ``close()`` closes the response (the server stops); reading it to its end
    closes it too."""

    def __init__(self, post: Post, capabilities: Capabilities, model: str, url: str, session: TokenSession | None,
                 tokens: list[int], max_tokens: int) -> None:
        if not tokens or max_tokens < 1:
            raise InvalidRequestError("a streamed generation continues at least one token, for at least one",
                                      param="max_tokens" if tokens else "prompt")
        self._post, self.capabilities, self.model, self.url = post, capabilities, model, url
        self.session, self.tokens, self.max_tokens = session, tokens, max_tokens
        #: How the generation ended (None while it runs, or where the stream broke).
        self.finish: FinishReason | None = None
        #: Prompt tokens the request carried (billed), of them read from the server's cache, and generated.
        self.sent = self.cached = self.generated = 0
        self._response: httpx.Response | None = None
        self._iterator: Iterator[int] | None = None

    def __iter__(self) -> Iterator[int]:
        if self._iterator is None:
            self._iterator = self._run()
        return self._iterator

    def close(self) -> None:
        """Close the response (from any thread: a reader blocked on it gets a BackendError)."""
        if self._response is not None:
            self._response.close()

    def _refused(self, said: str) -> ExtensionUnsupportedError:
        self.capabilities.refuse("stream_ids", said)
        return ExtensionUnsupportedError(f"{self.url} {said}", extension="stream_ids")

    def _run(self) -> Iterator[int]:
        capabilities = self.capabilities
        if not capabilities.may("stream_ids"):
            raise ExtensionUnsupportedError(f"{self.url} refused it earlier: {capabilities.why('stream_ids')}",
                                            extension="stream_ids")
        session = self.session
        base = min(session.base(len(self.tokens)), len(self.tokens) - 1) if session is not None else 0
        body: dict[str, Any] = {"model": self.model, "prompt": self.tokens[base:], "max_tokens": self.max_tokens,
                                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                                "return_token_ids": True}
        if session is not None:
            body["session"] = {"id": session.id, "base": base}
        try:
            self._response = self._post(body, self.url)
        except (ContextOverflowError, SessionExpiredError):
            raise  # the request's own trouble, not the fields'
        except InvalidRequestError as exc:  # (an outage is raised as it is)
            raise self._refused(f"refused a streamed generation by token id: {exc}") from exc
        try:
            for line in self._response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                yield from self._chunk(json.loads(data), base)
        except EdgeCloudError:
            raise  # typed where it happened (a refusal, an in-band error)
        except httpx.HTTPError as exc:
            raise BackendError(f"the generation from {self.url} broke after {self.generated} tokens: {exc}",
                               cause="disconnected") from exc
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise BackendError(f"{self.url} streamed a chunk that is not a text completion",
                               cause="malformed_stream") from exc
        finally:
            self._response.close()
        if self.finish is None:
            raise BackendError(f"the generation from {self.url} ended after {self.generated} tokens without a finish "
                               "reason", cause="malformed_stream")
        capabilities.allow("stream_ids")

    def _chunk(self, chunk: dict[str, Any], base: int) -> Iterator[int]:
        if "error" in chunk:  # reported in-band once the status line was sent
            error = chunk["error"] or {}
            raise BackendError(f"{self.url} failed mid-generation: {error.get('message', error)}", cause="server_error")
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            counts = usage_counts(usage)
            self.sent, self.cached = counts["prompt_tokens"], counts["cached_tokens"]
        for choice in chunk.get("choices") or ():
            ids = choice.get("token_ids")
            if ids is None and choice.get("text"):
                raise self._refused("streams text without the token ids it came from (return_token_ids)")
            for token in ids or ():
                self.generated += 1
                yield int(token)
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
        held = chunk.get("session")
        if self.session is not None and isinstance(held, dict) and isinstance(held.get("tokens"), int):
            self.session.supported = True
            self.session.held = int(held["tokens"])
            self.session.resumes = held.get("resumes") is True
