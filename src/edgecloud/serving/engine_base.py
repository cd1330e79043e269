"""A batching engine as a :class:`~edgecloud.backend.Backend`: what every ``edgecloud serve`` engine shares.

This module owns :class:`BatchedEngineBackend`, the base of the torch engine's
:class:`~edgecloud.serving.engine_backend.TorchEngineBackend` and the llama.cpp engine's
:class:`~edgecloud.serving.llamacpp_engine.LlamaCppEngineBackend`. Both submit each request to a
:class:`~edgecloud.serving.batching.BatchScheduler` and turn its token ids into OpenAI-shaped
chunks with :class:`~edgecloud.runtime.chunks.AnswerChunks`; what differs (loading the model,
tokenizing, the scheduler) is theirs.

Shared here:

- lazy, locked loading (:meth:`~BatchedEngineBackend.load` or the first request), and a
  scheduler loop that died replaced in-process by the next request or ``/health`` probe
  (the weights stay loaded), counted in :attr:`~BatchedEngineBackend.restarts`;
- ``stream`` (sync, any thread) and ``astream`` (async, no extra thread: the scheduler feeds
  the event loop), and the same for ``/v1/completions`` (``stream_completion`` /
  ``astream_completion``, the same chunks reshaped as ``text_completion`` objects); closing
  any of them cancels the sequence, which frees its slot at the scheduler's next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from abc import abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

from ..backend import Backend
from ..errors import BackendUnavailableError, ConfigError, ContextOverflowError, InvalidRequestError
from ..observability.server_metrics import ServerMetrics
from ..runtime.chunks import AnswerChunks
from ..runtime.completions import Completion, CompletionChoice, CompletionRequest, new_text_completion_id
from ..runtime.sampling import SamplingParams, sampling_params
from ..types import ChatCompletionChunk, ChatRequest, FinishReason
from .batching import BatchScheduler, BatchSequence, in_fresh_thread
from .speculative import LlamaDraftProposer, NgramProposer, Proposer, SpecConfig, Speculator

__all__ = ["BatchedEngineBackend", "served_name"]


def served_name(model: str | Path) -> str:
    """The name a server answers to for ``model``: the catalogue name, or a file's stem."""
    return Path(model).stem if isinstance(model, Path) or str(model).endswith(".gguf") else str(model)


class BatchedEngineBackend(Backend):
    """Base of a serving engine: one model, a continuous-batching scheduler, many requests at once.

    ``n_ctx`` caps prompt + answer per request; ``max_batch`` sequences decode together and up
    to ``max_queue`` wait (429 beyond). Subclasses implement :meth:`_load` (which ends by
    calling :meth:`_start_scheduler`), :meth:`_start_scheduler`, :meth:`_submit`, and
    :meth:`_close_runtime`.
    """

    target = "cloud"

    def __init__(self, model: str | Path, *, n_ctx: int | None, max_batch: int, max_queue: int) -> None:
        if n_ctx is not None and n_ctx < 16:
            raise ConfigError(f"n_ctx must be at least 16 tokens, got {n_ctx}")
        if max_batch < 1:
            raise ConfigError(f"max_batch must be at least 1, got {max_batch}")
        if max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {max_queue}")
        self.model = model
        self.model_name = served_name(model)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self._n_ctx_request = n_ctx
        self.n_ctx = 0
        self.model_path: Path | None = None
        #: Prometheus metrics of this engine (``GET /metrics`` renders them).
        self.metrics = ServerMetrics(self.model_name)
        self._scheduler: BatchScheduler[Any] | None = None
        self._load_lock = threading.Lock()
        self._closed = False
        #: Times a dead scheduler loop was replaced in-process.
        self.restarts = 0

    # ------------------------------------------------------------------ what an engine implements

    @abstractmethod
    def _load(self) -> None:
        """Resolve and load the model, set :attr:`n_ctx` and :attr:`model_path`, then :meth:`_start_scheduler`."""

    @abstractmethod
    def _start_scheduler(self) -> None:
        """A new scheduler over the loaded model in ``self._scheduler`` (at load, and to replace a dead loop)."""

    @abstractmethod
    def _submit(
        self, request: ChatRequest | CompletionRequest, loop: asyncio.AbstractEventLoop | None
    ) -> tuple[BatchSequence, AnswerChunks, int]:
        """Tokenize and submit ``request``: its sequence, the chunk builder, and the prompt's token count."""

    #: Whether the engine applies ``logit_bias`` / holds decoding to a ``response_format`` grammar
    #: (:func:`~edgecloud.runtime.sampling.sampling_params` refuses them by name otherwise).
    applies_logit_bias: ClassVar[bool] = False
    applies_grammar: ClassVar[bool] = False
    #: The server's speculation settings (requests may only narrow them) and the draft model.
    speculative: SpecConfig = SpecConfig()
    draft_model: str | Path | None = None
    #: llama.cpp threads of a draft model (0: the physical cores).
    threads: int = 0

    def _set_speculation(self, config: SpecConfig | None, draft_model: str | Path | None) -> None:
        self.speculative = config or SpecConfig()
        if self.speculative.mode in ("draft", "auto") and draft_model is None:
            raise ConfigError(f"speculative mode {self.speculative.mode!r} needs a draft model (--draft-model)")
        self.draft_model = draft_model

    def _speculator(self, target_vocab: int) -> Speculator | None:
        """The proposers ``speculative`` asks for (a draft model's vocabulary is checked against the target's)."""
        config = self.speculative
        if config.mode == "off":
            return None
        proposers: dict[str, Proposer] = {}
        if config.allows("ngram"):
            proposers["ngram"] = NgramProposer()
        if config.allows("draft"):
            assert self.draft_model is not None
            proposers["draft"] = LlamaDraftProposer(
                self.draft_model, target_vocab=target_vocab, max_seqs=self.max_batch, ctx_per_seq=self.n_ctx,
                threads=self.threads,
            )
        return Speculator(config, proposers, metrics=self.metrics)

    def _params(self, request: ChatRequest | CompletionRequest, prompt: list[int]) -> SamplingParams:
        """The sequence's sampling settings: the answer's budget within the context (a prompt plus
        ``max_tokens`` beyond it is refused, as OpenAI does), the request's options, and its
        speculation limits checked against the server's."""
        if len(prompt) + 1 > self.n_ctx:
            raise ContextOverflowError(len(prompt), self.n_ctx, detail=" (with at least 1 token of room for the answer)")
        if request.max_tokens is not None and len(prompt) + request.max_tokens > self.n_ctx:
            raise ContextOverflowError(
                len(prompt), self.n_ctx, detail=f" and {request.max_tokens} max_tokens were requested"
            )
        params = sampling_params(request, request.max_tokens or self.n_ctx - len(prompt),
                                 logit_bias=self.applies_logit_bias, grammar=self.applies_grammar)
        options = request.speculative if isinstance(request, ChatRequest) else None
        if options is None:
            return params
        if options.mode is not None and not self.speculative.allows(options.mode):
            raise InvalidRequestError(
                f"speculative.mode={options.mode!r} is not available on this server (it runs "
                f"--spec {self.speculative.mode}); use 'off' or leave it out",
                param="speculative.mode",
            )
        if options.k_max is not None and options.k_max > self.speculative.k_max:
            raise InvalidRequestError(
                f"speculative.k_max={options.k_max} exceeds this server's --spec-k-max {self.speculative.k_max}",
                param="speculative.k_max",
            )
        return dataclasses.replace(params, spec_mode=options.mode, spec_k_max=options.k_max)

    def _close_runtime(self) -> None:
        """Free what the engine holds besides the scheduler (tokenizer, model)."""

    def _push(self, seq: BatchSequence, answer: AnswerChunks, token: int) -> list[ChatCompletionChunk]:
        """The chunks for ``seq``'s next ``token``, with its logprob when the request asked."""
        if answer.top_n is None:
            return answer.push(token)
        index = answer.generated
        return answer.push(token, logprob=seq.logprobs[index] if index < len(seq.logprobs) else None)

    # ------------------------------------------------------------------ lifecycle

    @property
    def loaded(self) -> bool:
        """True once the weights are in memory."""
        return self._scheduler is not None

    @property
    def scheduler(self) -> BatchScheduler[Any]:
        """The running scheduler (loads the model first if needed; restarts a dead loop)."""
        self.load()
        scheduler = self._scheduler
        assert scheduler is not None
        if not scheduler.alive:
            with self._load_lock:
                if self._closed:
                    raise BackendUnavailableError(f"the {self.name} backend is closed; create a new one", cause="closed")
                if self._scheduler is scheduler:  # nobody restarted it meanwhile
                    try:
                        in_fresh_thread(self._start_scheduler)
                    except Exception as exc:
                        raise BackendUnavailableError(
                            f"{scheduler.failure or 'the scheduler stopped'}; restarting it failed: "
                            f"{type(exc).__name__}: {exc}", cause="runtime_error",
                        ) from exc
                    self.restarts += 1
            assert self._scheduler is not None
            return self._scheduler
        return scheduler

    def health(self) -> str | None:
        """None when a request could be served now, else why not.

        A scheduler loop that died is restarted here (in-process: the weights stay loaded), so a
        health probe brings the engine back as a request would; only a restart that fails, or
        a closed backend, reports unhealthy.
        """
        if self._closed:
            return f"the {self.name} backend is closed"
        if self._scheduler is None:
            return None  # loaded on the first request (``edgecloud serve`` loads it before serving)
        try:
            scheduler = self.scheduler
        except Exception as exc:  # noqa: BLE001 - reported, not raised: this is a probe
            return f"the engine cannot serve: {type(exc).__name__}: {exc}"
        return None if scheduler.alive else (scheduler.failure or "the scheduler is not running")

    def load(self) -> None:
        """Resolve and load the model and start the scheduler now (otherwise the first request does it)."""
        if self._scheduler is not None:
            return
        with self._load_lock:
            if self._closed:
                raise BackendUnavailableError(f"the {self.name} backend is closed; create a new one", cause="closed")
            if self._scheduler is None:
                in_fresh_thread(self._load)  # see in_fresh_thread: the caller's thread keeps no OpenMP pool

    def close(self) -> None:
        """Stop the scheduler (open streams end with BackendUnavailableError) and free the model."""
        with self._load_lock:
            self._closed = True
            scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            scheduler.close()
        with self._load_lock:
            self._close_runtime()

    # ------------------------------------------------------------------ streams

    def _finish(self, seq: BatchSequence, answer: AnswerChunks, prompt_tokens: int) -> Iterator[ChatCompletionChunk]:
        reason: FinishReason = "length" if seq.finish_reason == "length" else "stop"
        return answer.finish(prompt_tokens, seq.cached_tokens, reason=reason, speculative=seq.spec_summary)

    def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        """Yield the answer as OpenAI-shaped chunks; closing the iterator cancels the sequence."""
        return self._iterate(request, _as_chat)

    async def astream(self, request: ChatRequest) -> AsyncIterator[ChatCompletionChunk]:
        """Async twin of :meth:`stream`, fed by the scheduler without a worker thread."""
        async for chunk in self._aiterate(request, _as_chat):
            yield chunk

    def stream_completion(self, request: CompletionRequest) -> Iterator[Completion]:
        """``/v1/completions``: the prompt continued as is, as ``text_completion`` chunks."""
        return self._iterate(request, _TextShape())

    async def astream_completion(self, request: CompletionRequest) -> AsyncIterator[Completion]:
        """Async twin of :meth:`stream_completion`."""
        async for chunk in self._aiterate(request, _TextShape()):
            yield chunk

    def _iterate(self, request: ChatRequest | CompletionRequest, shape: _Shape) -> Iterator[Any]:
        seq, answer, prompt_tokens = self._submit(request, None)
        try:
            yield from shape(answer.start())
            for token in seq:
                for chunk in self._push(seq, answer, token):
                    yield from shape(chunk)
                if answer.done:
                    break
            for chunk in self._finish(seq, answer, prompt_tokens):
                yield from shape(chunk)
        finally:
            seq.cancel()

    async def _aiterate(self, request: ChatRequest | CompletionRequest, shape: _Shape) -> AsyncIterator[Any]:
        await asyncio.to_thread(self.load)
        # tokenizing a megabyte prompt takes seconds: never on the event loop (/health would stall)
        seq, answer, prompt_tokens = await asyncio.to_thread(self._submit, request, asyncio.get_running_loop())
        try:
            for out in shape(answer.start()):
                yield out
            async for token in seq:
                for chunk in self._push(seq, answer, token):
                    for out in shape(chunk):
                        yield out
                if answer.done:
                    break
            for chunk in self._finish(seq, answer, prompt_tokens):
                for out in shape(chunk):
                    yield out
        finally:
            seq.cancel()


#: How an answer's chat chunks are handed out: as they are, or reshaped for /v1/completions.
_Shape = Callable[[ChatCompletionChunk], list[Any]]


def _as_chat(chunk: ChatCompletionChunk) -> list[ChatCompletionChunk]:
    return [chunk]


class _TextShape:
    """The same answer as ``text_completion`` objects: no role chunk; text pieces, then the last
    one with the finish reason, usage and route."""

    def __init__(self) -> None:
        self.id = new_text_completion_id()

    def __call__(self, chunk: ChatCompletionChunk) -> list[Completion]:
        choice = chunk.choices[0]
        if choice.delta.role and not choice.delta.content:
            return []
        return [Completion(
            id=self.id, created=chunk.created, model=chunk.model,
            choices=[CompletionChoice(text=choice.delta.content or "", finish_reason=choice.finish_reason,
                                      token_ids=chunk._token_ids)],
            usage=chunk.usage, route=chunk.route if choice.finish_reason is not None else None,
        )]
