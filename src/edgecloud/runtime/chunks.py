"""One answer decoded token by token, as the OpenAI-shaped chunks every edge runtime streams.

This module owns :class:`AnswerChunks`, the part of a decode loop that does not depend on the
runtime: the role chunk, end-of-generation ids (unless ``ignore_eos``), text deltas through
:class:`~edgecloud.runtime.text_stream.TextStream` (whole UTF-8 characters, stop strings held
back and never emitted), logprobs per token when asked (:func:`token_logprob`, a log-softmax of
the runtime's logits), tool calls read from the text when the request offers tools
(:class:`~edgecloud.tools.parse.ToolCallParser`, ``finish_reason: "tool_calls"``: where the
runtime holds calls to their grammar, ``stream_calls``, each call's arguments stream in pieces after
a first delta with its id and name, as OpenAI sends them; elsewhere each call comes whole in one delta), and the finish chunk with the reason, usage and route. Every runtime
that decodes token by token hands each new token here: llama.cpp, ONNX Runtime, Core ML, the
torch edge backend and the cloud's torch engine (whose ``/v1/completions`` reshapes the same
chunks as ``text_completion`` objects).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from .stats import RuntimeStats
from ..types import (
    ChatCompletionChunk,
    ChatRequest,
    ChoiceDelta,
    ChoiceLogprobs,
    ChunkChoice,
    FinishReason,
    RouteInfo,
    TokenLogprob,
    TopLogprob,
    Usage,
    new_completion_id,
    now,
)
from ..errors import ContextOverflowError
from ..tools.parse import ToolCallParser
from .text_stream import TextStream

__all__ = ["AnswerChunks", "answer_budget", "log_partition", "token_logprob", "top_tokens"]


def answer_budget(
    prompt_tokens: int, n_ctx: int, max_tokens: int | None,
    detail: str = " (with at least 1 token of room for the answer)",
) -> int:
    """Tokens the answer may take: ``max_tokens`` capped by the context left after the prompt.

    Raises :class:`~edgecloud.errors.ContextOverflowError` when the prompt leaves no room at all.
    """
    if prompt_tokens + 1 > n_ctx:
        raise ContextOverflowError(prompt_tokens, n_ctx, detail=detail)
    room = n_ctx - prompt_tokens
    return min(max_tokens, room) if max_tokens else room


def log_partition(logits: npt.NDArray[np.single]) -> float:
    """``log(sum(exp(logits)))``, computed stably: a token's logprob is its logit minus this."""
    peak = float(logits.max())
    return peak + float(np.log(np.exp(logits - peak, dtype=np.float32).sum(dtype=np.float64)))


def top_tokens(logits: npt.NDArray[np.single], top_n: int, log_z: float) -> list[tuple[int, float]]:
    """The ``top_n`` most likely token ids under ``logits`` with their logprobs, best first
    (``log_z``: :func:`log_partition` of the same logits)."""
    if not top_n:
        return []
    best = np.argpartition(logits, -top_n)[-top_n:]
    best = best[np.argsort(-logits[best], kind="stable")]
    return [(int(t), min(0.0, float(logits[t]) - log_z)) for t in best.tolist()]


def token_logprob(
    logits: npt.NDArray[np.single], token: int, top_n: int, piece: Callable[[int], bytes]
) -> TokenLogprob:
    """Logprob of ``token`` (and the ``top_n`` most likely alternatives, best first) under the
    distribution ``logits`` defines; ``piece`` gives a token's bytes."""
    log_z = log_partition(logits)
    tops: list[TopLogprob] = []
    for alt, logprob in top_tokens(logits, top_n, log_z):
        alt_piece = piece(alt)
        tops.append(TopLogprob(token=alt_piece.decode("utf-8", errors="replace"), logprob=logprob,
                               bytes=list(alt_piece)))
    chosen = piece(token)
    return TokenLogprob(
        token=chosen.decode("utf-8", errors="replace"),
        logprob=min(0.0, float(logits[token]) - log_z),
        bytes=list(chosen),
        top_logprobs=tops,
    )


class AnswerChunks:
    """Chunks of one answer: :meth:`start`, then :meth:`push` each sampled token until :attr:`done`
    (or the token budget runs out), then :meth:`finish`.

    ``piece`` gives a token's bytes (control tokens as nothing), ``is_eog`` whether generation
    ends at a token; ``route`` goes on the first and the last chunk. ``stream_calls``: stream each
    tool call's arguments as they are written (for runtimes that hold calls to their grammar, so
    the pieces join into the call's JSON).
    """

    def __init__(
        self,
        request: ChatRequest | Any,
        model: str,
        route: RouteInfo,
        piece: Callable[[int], bytes],
        is_eog: Callable[[int], bool],
        stats: RuntimeStats | None = None,
        *,
        stream_calls: bool = False,
    ) -> None:
        self.id, self.created, self.model, self.route = new_completion_id(), now(), model, route
        self._stats = stats
        self._piece, self._is_eog = piece, is_eog
        self._ignore_eos = request.ignore_eos
        self._want_logprobs = bool(request.logprobs)
        chat = request if isinstance(request, ChatRequest) else None
        #: A text completion's ``return_token_ids``: each chunk names the token ids its text came from.
        self._want_ids = chat is None and bool(request.return_token_ids)
        self._ids: list[int] = []
        self._top_n = (chat.top_logprobs or 0) if chat is not None and request.logprobs else 0
        self._text = TextStream(request.stop_sequences)
        mode = chat.tool_mode if chat is not None else None
        self._tools = (ToolCallParser((t.function.name for t in request.tools), stream=stream_calls)
                       if mode is not None and mode.mode != "none" else None)
        self._pending: list[TokenLogprob] = []
        self._parts: list[str] = []
        #: Tokens of the answer so far (end-of-generation tokens are not counted).
        self.generated = 0
        #: True once an end-of-generation token or a stop string ended the answer.
        self.done = False
        self.finish_reason = "length"

    @property
    def text(self) -> str:
        """The answer text emitted so far."""
        return "".join(self._parts)

    def _chunk(self, delta: ChoiceDelta, finish: Any = None, usage: Usage | None = None) -> ChatCompletionChunk:
        logprobs = None
        if self._want_logprobs and (self._pending or finish is not None):
            logprobs = ChoiceLogprobs(content=list(self._pending))
            self._pending.clear()
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[ChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)],
            usage=usage,
            route=self.route if finish is not None or delta.role else None,
        )
        if self._want_ids and (self._ids or finish is not None):  # (tokens whose text is held back wait for it)
            chunk._token_ids, self._ids = self._ids, []
        return chunk

    def start(self) -> ChatCompletionChunk:
        """The role chunk (with the route)."""
        return self._chunk(ChoiceDelta(role="assistant", content=""))

    @property
    def top_n(self) -> int | None:
        """Alternatives per token the request asked for with its logprobs (None: no logprobs)."""
        return self._top_n if self._want_logprobs else None

    def push(
        self, token: int, logits: npt.NDArray[np.single] | None = None, *, logprob: TokenLogprob | None = None
    ) -> list[ChatCompletionChunk]:
        """Take the next sampled token (``logits``: the distribution it came from, for logprobs; or
        ``logprob``, already computed where the logits were); returns the chunks to send now (none
        while text is held back). :attr:`generated` counts it before anything is sent, so a
        caller's counters (and ``stats``, given at construction) are right even if the stream is closed."""
        if not self._ignore_eos and self._is_eog(token):
            self.finish_reason, self.done = "stop", True
            return []
        self.generated += 1
        if self._want_ids:
            self._ids.append(token)
        if self._stats is not None:
            self._stats.completion_tokens += 1
        if self._want_logprobs:
            if logprob is None:
                assert logits is not None, "logprobs need the logits the token was sampled from"
                logprob = token_logprob(logits, token, self._top_n, self._piece)
            self._pending.append(logprob)
        delta = self._text.push(self._piece(token))
        if self._text.stopped:
            self.finish_reason, self.done = "stop", True
        return self._emit(delta, final=False)

    def _emit(self, delta: str, *, final: bool) -> list[ChatCompletionChunk]:
        """Chunks for new answer text: the text, and the tool calls it completes."""
        calls: list[Any] = []
        if self._tools is not None:
            delta, calls = self._tools.push(delta)
            if final:
                tail, more = self._tools.flush()
                delta, calls = delta + tail, calls + more
        out = []
        if delta:
            self._parts.append(delta)
            out.append(self._chunk(ChoiceDelta(content=delta)))
        # one tool-call delta per chunk, as OpenAI streams them (clients read ``tool_calls[0]``)
        out += [self._chunk(ChoiceDelta(tool_calls=[delta]))
                for delta in (self._tools.deltas(calls) if self._tools is not None else [])]
        return out

    def finish(
        self, prompt_tokens: int, cached_tokens: int, *, reason: FinishReason | None = None,
        speculative: dict[str, Any] | None = None,
    ) -> Iterator[ChatCompletionChunk]:
        """The held-back text, then the finish chunk with usage and route.

        ``reason`` is how the runtime ended the sequence when it stopped it itself (a scheduler
        that saw the end-of-generation token); an end seen here (:attr:`done`) takes precedence.
        """
        yield from self._emit(self._text.flush(), final=True)
        if reason is not None and not self.done:
            self.finish_reason = reason
        if self._tools is not None and self._tools.calls and self.finish_reason == "stop":
            self.finish_reason = "tool_calls"
        usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=self.generated,
            total_tokens=prompt_tokens + self.generated,
            cached_tokens=cached_tokens,
            speculative=speculative,
        )
        yield self._chunk(ChoiceDelta(), finish=self.finish_reason, usage=usage)
