"""The legacy text-completion shapes served on ``POST /v1/completions``.

This module owns :class:`CompletionRequest` (validated like
:class:`~edgecloud.types.ChatRequest`: a bad field raises
:class:`~edgecloud.errors.InvalidRequestError` naming it), :class:`Completion` and
:class:`CompletionChunk`, mirroring the ``openai`` client's ``Completion`` type. The prompt
is raw text (no chat template) or a list of token ids, one prompt per request; options no
engine implements (``n``/``best_of`` > 1, ``suffix``, penalties) are refused with a 400 that
says so rather than silently ignored.

**Scoring** (``echo`` with ``logprobs``): the prompt comes back with each token's logprob and
its ``logprobs`` best alternatives, then at most one greedy token (``max_tokens`` 0 or 1):
what a verifier needs to check a draft in one forward pass (the verified collaboration mode).
``return_tokens_as_token_ids`` (vLLM's extension) names tokens ``"token_id:<id>"``;
``score_from`` (edgecloud's extension) scores only prompt positions from that index on (the
others are ``null``, as the first one always is), so a server with a prefix cache recomputes
only what is new (``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens it read
from a slot's KV, as for chat answers). Served by backends implementing :class:`ScoringBackend`
(the llama.cpp runtime); vLLM answers the same request without ``score_from`` (it scores every position).

**Sessions** (edgecloud's extension, token-id prompts only): ``session: {"id", "base"}`` says the
prompt follows the first ``base`` tokens the server holds for that session
(:mod:`edgecloud.serving.sessions`), so a collaborating client sends each token once. Then
``score_from`` indexes the whole context (held + sent), the echoed ``logprobs`` cover only the
positions this request sent (and the generated token), ``usage.prompt_tokens`` counts only the
sent tokens, ``usage.context_tokens`` the held ones, and the response's ``session`` says what the
server holds afterwards. With ``session.keep_verified`` (and ``max_tokens`` 1) the request is a
check of drafted tokens: the server keeps only the drafts its own choices agree with, then its
own token there (its correction at the first disagreement, or the token after a block it agreed
with whole), and says so in ``verified: {"accepted", "token"}``. That token is what the request
generated (``usage.completion_tokens`` 1), so, as in plain generation, it is never sent back nor
billed again as input: the next check sends only its new drafts.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, Field, field_validator, model_validator

from ..errors import InvalidRequestError
from .coupling import SCHEME, Coupling
from .held import GRAMMAR_FIELDS, HeldGrammar
from .sampling import sampling_params
from .scoring import TokenScore
from .speculative import accept_prefix
from ..types import Envelope, FinishReason, RouteInfo, StreamOptions, Text, Usage, SEED_MIN, SEED_MAX, _Validated, check_bias, check_stop, check_text, now

__all__ = [
    "SessionInfo",
    "SessionRef",
    "VerifiedInfo",
    "Completion",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionRequest",
    "CompletionLogprobs",
    "CompletionsBackend",
    "CachedScoringBackend",
    "ScoringBackend",
    "new_text_completion_id",
    "scored_completion",
]

#: OpenAI's default ``max_tokens`` for /v1/completions.
DEFAULT_COMPLETION_TOKENS = 16
_SESSION_ID = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"


class SessionRef(_Validated):
    """edgecloud's token sessions: the prompt's token ids follow the first ``base`` tokens the
    server holds for session ``id`` (``base`` 0: the prompt is the whole context; the server
    starts holding it). See :mod:`edgecloud.serving.sessions`."""

    id: str = Field(pattern=_SESSION_ID)
    base: int = Field(default=0, ge=0)
    #: Hold the drafts the server agrees with and its own token after them (see the module docstring).
    keep_verified: bool = False


class VerifiedInfo(BaseModel):
    """What a ``keep_verified`` check kept (a response's ``verified``): the scored tokens the
    server's own choices agree with, from ``score_from`` on, and its token after them."""

    accepted: int
    token: int
    #: Where the scored tokens start in the context (``score_from``): not part of the answer.
    at: int = Field(default=0, exclude=True)

    def held(self, context: list[int]) -> list[int]:
        """What the session holds after the check of ``context``: the tokens before the drafts,
        the drafts kept, then the server's own token."""
        return context[:self.at + self.accepted] + [self.token]


class SessionInfo(BaseModel):
    """What the server holds for a session after answering (a response's ``session``)."""

    id: str
    tokens: int
    #: The server continues a session from what it holds with no new token ids (``prompt: []``):
    #: a check without drafts asks for the token after them (its KV is computed then, as its own
    #: generation would), and nothing is sent twice or billed as input again.
    resumes: bool = False


class CompletionRequest(_Validated):
    """A text completion request (``prompt`` is continued as is)."""

    model: Text | None = None
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(default=DEFAULT_COMPLETION_TOKENS, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    #: vLLM's extension: sample among the k most likely tokens only (0 or -1: all).
    top_k: int | None = Field(default=None, ge=-1)
    #: vLLM's extension: sample among tokens at least this fraction as likely as the top one.
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    #: vLLM's extension: tokens in ``logprobs`` are named ``"token_id:<id>"``.
    return_tokens_as_token_ids: bool = False
    #: edgecloud's extension: with ``echo``, score only prompt positions >= this index.
    score_from: int | None = Field(default=None, ge=1)
    suffix: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: Text | None = None
    #: vLLM's extension: keep generating past end-of-generation tokens.
    ignore_eos: bool = False
    #: vLLM's extension: each choice names the token ids it generated (``token_ids``; streamed:
    #: those of each chunk's text). In a session the server then holds them too, and says so.
    return_token_ids: bool = False
    #: edgecloud's extension: continue a token session (the prompt must be token ids).
    session: SessionRef | None = None
    #: edgecloud's extension: with ``echo``, pick each scored position's token with this shared-noise
    #: sampler (:data:`edgecloud.runtime.coupling.SCHEME`; ``seed`` and the sampling fields say how).
    coupling: str | None = None
    #: Token id (as a string) -> bias added to its logit (with ``coupling``).
    logit_bias: dict[str, float] | None = None
    #: edgecloud's extension: with ``echo``, hold each scored position's pick to the grammar a chat
    #: request with these fields (``tools``, ``tool_choice``, ``response_format``) is held to
    #: (:mod:`edgecloud.runtime.held`), from sequence position ``grammar_from`` (the answer's start) on.
    grammar: dict[str, Any] | None = None
    grammar_from: int | None = Field(default=None, ge=0)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list):
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return prompt  # token ids (checked against the vocabulary by the runtime; none: see _supported)
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise ValueError("send one prompt: a string or a list of token ids (lists of prompts are not supported)")
            return [check_text(prompt[0])]
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt must not be empty")
        return check_text(prompt)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, stop: Any) -> Any:
        return check_stop(stop)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        return check_bias(bias)

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        unsupported = {
            "n": self.n not in (None, 1),
            "best_of": self.best_of not in (None, 1),
            "suffix": self.suffix is not None,
            "presence_penalty": bool(self.presence_penalty),
            "frequency_penalty": bool(self.frequency_penalty),
        }
        for field, bad in unsupported.items():
            if bad:
                raise InvalidRequestError(f"'{field}' is not supported by this server; leave it out", param=field)
        if self.prompt == [] and (self.session is None or self.session.base == 0):
            raise InvalidRequestError("prompt must not be empty: send text or token ids (an empty list continues "
                                      "only a token session from the tokens it holds, session.base > 0)",
                                      param="prompt")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens=0 only makes sense with echo=true (scoring the prompt)", param="max_tokens")
        if self.score_from is not None and not self.echo:
            raise InvalidRequestError("score_from needs echo=true and logprobs", param="score_from")
        if self.coupling is not None:
            if not self.scoring:
                raise InvalidRequestError("coupling picks the scored positions' tokens: send it with echo=true and "
                                          "logprobs (a scoring request)", param="coupling")
            if self.coupling != SCHEME:
                raise InvalidRequestError(f"unknown coupling {self.coupling!r}; this server samples with {SCHEME!r}",
                                          param="coupling")
            if self.seed is None and self.temperature != 0.0:
                raise InvalidRequestError("a coupled check needs the answer's seed (both sides draw the same noise "
                                          "from it); set seed", param="seed")
        if self.grammar is not None:
            if not self.scoring:
                raise InvalidRequestError("grammar holds the scored positions' picks: send it with echo=true and "
                                          "logprobs (a scoring request)", param="grammar")
            if self.grammar_from is None:
                raise InvalidRequestError("a grammar-held check needs grammar_from (where the answer starts)",
                                          param="grammar_from")
            unknown = sorted(set(self.grammar) - set(GRAMMAR_FIELDS))
            if unknown:
                raise InvalidRequestError(f"grammar takes {', '.join(GRAMMAR_FIELDS)}; not {', '.join(unknown)}",
                                          param="grammar")
        elif self.grammar_from is not None:
            raise InvalidRequestError("grammar_from goes with grammar", param="grammar")
        if self.coupling is None and self.logit_bias and self.scoring:
            raise InvalidRequestError("logit_bias in a scoring request needs coupling (the picks it changes)",
                                      param="logit_bias")
        if self.session is not None and self.token_ids is None:
            raise InvalidRequestError("a session continues token ids: send the prompt as a list of token ids",
                                      param="session")
        return self

    @property
    def scoring(self) -> bool:
        """An ``echo`` request with ``logprobs``: the prompt is scored (see the module docstring)."""
        return self.echo and self.logprobs is not None

    @property
    def token_ids(self) -> list[int] | None:
        """The prompt as token ids, when it was sent that way."""
        if isinstance(self.prompt, list) and (not self.prompt or isinstance(self.prompt[0], int)):
            return self.prompt  # type: ignore[return-value]
        return None

    @property
    def text(self) -> str:
        """The prompt text (refused when the prompt was sent as token ids)."""
        if self.token_ids is not None:
            raise InvalidRequestError("this runtime takes the prompt as text, not token ids", param="prompt")
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]  # type: ignore[return-value]

    @property
    def stop_sequences(self) -> list[str]:
        """``stop`` as a list (possibly empty)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionLogprobs(BaseModel):
    """The legacy per-token logprobs (``null`` where a position was not scored)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)
    #: edgecloud's extension (a coupled scoring request): the model's own pick at each echoed
    #: position, by token id (``null`` where a position was not scored).
    picks: list[int | None] | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str = ""
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    #: The generated token ids (``return_token_ids``; streamed: those of this chunk).
    token_ids: list[int] | None = None


class Completion(Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None
    route: RouteInfo | None = None
    #: edgecloud's extension: what the server holds for the request's session afterwards.
    session: SessionInfo | None = None
    #: edgecloud's extension: the sampler a coupled scoring request's picks were drawn with.
    coupling: str | None = None
    #: edgecloud's extension: the picks were held to the request's grammar.
    grammar: bool | None = None
    #: edgecloud's extension: what a ``keep_verified`` check kept in the session.
    verified: VerifiedInfo | None = None


#: Streamed pieces have the same shape as the whole answer (as OpenAI sends them).
CompletionChunk = Completion


def new_text_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex[:24]}"


@runtime_checkable
class CompletionsBackend(Protocol):
    """A backend that also continues raw text (``POST /v1/completions``): the torch engine does."""

    def astream_completion(self, request: CompletionRequest) -> AsyncIterator[Completion]:
        """The prompt continued as is, as ``text_completion`` chunks."""
        ...


@runtime_checkable
class ScoringBackend(Protocol):
    """A backend that scores a given continuation (``echo`` + ``logprobs``): the llama.cpp runtime does."""

    def tokenize_text(self, text: str) -> list[int]:
        """``text`` as this model's token ids (special tokens parsed)."""
        ...

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for."""
        ...

    def score(self, tokens: list[int], *, start: int, top_n: int = 1, coupling: Coupling | None = None,
              grammar: HeldGrammar | None = None) -> tuple[list[TokenScore], TokenScore]:
        """Scores of ``tokens[start:]`` and the next token (greedy, or the pick: ``coupling``'s draw,
        held to ``grammar``)."""
        ...


@runtime_checkable
class CachedScoringBackend(ScoringBackend, Protocol):
    """A scoring backend with a prefix cache, that says how much of a scored prompt it read from it."""

    def score_cached(self, tokens: list[int], *, start: int, top_n: int = 1, coupling: Coupling | None = None,
                     grammar: HeldGrammar | None = None) -> tuple[list[TokenScore], TokenScore, int]:
        """:meth:`score`, and how many leading ``tokens`` were read from the cache (not computed)."""
        ...


def scored_completion(backend: ScoringBackend, request: CompletionRequest, model: str,
                      context: list[int] | None = None, held: int = 0) -> Completion:
    """The answer to a scoring request (``echo`` + ``logprobs``; see the module docstring).

    ``context``: the whole prompt when the request continues a session (``held`` of its tokens
    were held by the server, not sent): positions before ``held`` are not echoed."""
    if not request.scoring:
        raise InvalidRequestError("echo needs logprobs here (a scoring request); set logprobs=0..20", param="echo")
    if (request.max_tokens or 0) > 1:
        raise InvalidRequestError("with echo, max_tokens may be 0 (score only) or 1 (and the greedy next token)",
                                  param="max_tokens")
    keeps = request.session is not None and request.session.keep_verified
    if keeps and not request.max_tokens:
        raise InvalidRequestError("session.keep_verified holds the server's own token after the drafts it agrees "
                                  "with: set max_tokens=1", param="max_tokens")
    coupling = sampling_params(request, 1, logit_bias=True).coupling() if request.coupling is not None else None
    grammar = HeldGrammar(request.grammar, request.grammar_from or 0) if request.grammar is not None else None
    if coupling is None and request.temperature not in (None, 0.0):
        raise InvalidRequestError("scoring is greedy: leave temperature out or set it to 0 (or send coupling, "
                                  "with the seed, for sampled picks)", param="temperature")
    tokens = context if context is not None else request.token_ids
    if tokens is None:
        tokens = backend.tokenize_text(request.text)
    start = request.score_from or 1
    if start > len(tokens):
        raise InvalidRequestError(f"score_from={start} is past the prompt's {len(tokens)} tokens", param="score_from")
    top_n, as_ids = request.logprobs or 0, request.return_tokens_as_token_ids
    picked = coupling is not None or grammar is not None
    if isinstance(backend, CachedScoringBackend):
        scores, nxt, reused = backend.score_cached(tokens, start=start, top_n=top_n, coupling=coupling, grammar=grammar)
    else:
        (scores, nxt), reused = backend.score(tokens, start=start, top_n=top_n, coupling=coupling, grammar=grammar), 0
    generated = [nxt] if request.max_tokens else []
    verified = None
    if keeps:
        accepted = accept_prefix(tokens[start:], [s.choice for s in scores])
        verified = VerifiedInfo(accepted=accepted, token=scores[accepted].choice if accepted < len(scores) else nxt.token,
                                at=start)
    echoed = tokens + [g.token for g in generated]
    known: dict[int, bytes] = {}  # each distinct token's bytes, asked of the runtime once

    def piece(token: int) -> bytes:
        if token not in known:
            known[token] = backend.token_bytes(token)
        return known[token]

    def name(token: int) -> str:
        return f"token_id:{token}" if as_ids else piece(token).decode("utf-8", errors="replace")

    token_logprobs: list[float | None] = [None] * start + [s.logprob for s in scores] + [s.logprob for s in generated]
    tops: list[dict[str, float] | None] = [None] * start
    for score in [*scores, *generated]:
        tops.append({name(t): lp for t, lp in score.top})
    echoed, token_logprobs, tops = echoed[held:], token_logprobs[held:], tops[held:]  # what this request sent
    pieces = [piece(t) for t in echoed]
    offsets, at = [], 0
    for raw in pieces:
        offsets.append(at)
        at += len(raw.decode("utf-8", errors="replace"))
    picks: list[int | None] | None = None
    if picked:
        picks = ([None] * start + [s.pick for s in [*scores, *generated]])[held:]
    logprobs = CompletionLogprobs(tokens=[name(t) for t in echoed], token_logprobs=token_logprobs, top_logprobs=tops,
                                  text_offset=offsets, picks=picks)
    n_in, n_out = len(tokens) - held, len(generated)
    return Completion(
        id=new_text_completion_id(), created=now(), model=model,
        choices=[CompletionChoice(text=b"".join(pieces).decode("utf-8", errors="replace"), logprobs=logprobs,
                                  finish_reason="length")],
        usage=Usage(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out,
                    cached_tokens=min(n_in, max(0, reused - held)),  # of the sent tokens (the held ones are context)
                    context_tokens=held if context is not None else None),
        coupling=request.coupling,
        grammar=True if grammar is not None else None,
        verified=verified,
    )
