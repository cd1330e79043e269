"""The torch engine as a :class:`~edgecloud.backend.Backend`: what ``edgecloud serve`` runs.

This module owns :class:`TorchEngineBackend`. It turns a :class:`~edgecloud.types.ChatRequest`
(or a :class:`~edgecloud.cloud.completions.CompletionRequest`) into OpenAI-shaped chunks:
the GGUF's chat template and llama.cpp's tokenizer (:class:`~edgecloud.engine.Tokenizer`),
the continuous-batching :class:`~edgecloud.cloud.scheduler.Scheduler` for generation (many
requests share each forward pass; shared prompt prefixes are reused), and
:class:`~edgecloud.runtime.text_stream.TextStream` for UTF-8-safe deltas and stop strings.

Requests run concurrently: ``stream`` (sync, any thread) and ``astream`` (async, no extra
thread) both submit to the scheduler and consume its tokens. Closing either iterator
cancels the sequence and frees its KV at the scheduler's next step. A request whose prompt
plus ``max_tokens`` does not fit the context fails with
:class:`~edgecloud.errors.ContextOverflowError` before anything runs; a full waiting queue
fails with :class:`~edgecloud.errors.RateLimitedError` (HTTP 429); options the engine does
not implement (logprobs, presence/frequency penalties) fail with
:class:`~edgecloud.errors.InvalidRequestError` naming the field.

On a CPU with float32 weights the linear layers are switched to oneDNN's prepacked matmuls
(:func:`~edgecloud.engine.pack_linears`), which keep small decode batches cheap.

The request-to-chunks pieces (:class:`Answer`, :class:`ChatChunks`, :func:`reject_unsupported`,
:func:`sampling_params`) do not depend on the scheduler; the torch edge backend
(:mod:`edgecloud.edge.torch`) streams its single-sequence loop through them too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Protocol

from ..engine.model import DEFAULT_N_CTX
from ..store.catalogue import DEFAULT_MODEL
from ..backend import Backend
from ..runtime.sampling import SamplingParams, sampling_params
from ..runtime.text_stream import TextStream
from ..errors import BackendUnavailableError, ConfigError, ContextOverflowError, InvalidRequestError
from ..observability.server_metrics import ServerMetrics
from ..types import (
    ChatCompletionChunk,
    ChatRequest,
    ChoiceDelta,
    ChunkChoice,
    FinishReason,
    RouteInfo,
    Usage,
    new_completion_id,
    now,
)
from .completions import Completion, CompletionChoice, CompletionRequest, new_text_completion_id
from .speculative import LlamaDraftProposer, NgramProposer, Proposer, SpecConfig, Speculator
from .scheduler import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PREFIX_CACHE_BYTES,
    Scheduler,
    Sequence,
)

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_N_CTX",
    "Answer",
    "ChatChunks",
    "Outcome",
    "TorchEngineBackend",
    "reject_unsupported",
    "sampling_params",
]



class Outcome(Protocol):
    """How a sequence ended: the scheduler's :class:`Sequence`, or any loop that tracks the same two facts."""

    finish_reason: str | None
    cached_tokens: int


def reject_unsupported(request: ChatRequest) -> None:
    """InvalidRequestError naming the first option the torch engine does not implement."""
    if request.logprobs:
        raise InvalidRequestError("logprobs are not supported by the torch engine yet", param="logprobs")
    for field in ("presence_penalty", "frequency_penalty"):
        if getattr(request, field):
            raise InvalidRequestError(f"{field} is not supported by the torch engine yet", param=field)


class Answer:
    """Turns one sequence's token ids into text deltas (stop strings held back) and a finish."""

    def __init__(self, tokenizer: Any, stop: list[str], prompt_tokens: int, max_new: int) -> None:
        self.tokenizer = tokenizer
        self.text = TextStream(stop)
        self.prompt_tokens = prompt_tokens
        self.max_new = max_new
        self.generated = 0

    def push(self, token: int) -> str:
        self.generated += 1
        return self.text.push(self.tokenizer.token_to_piece(token, special=False))

    @property
    def stopped(self) -> bool:
        return self.text.stopped

    def finish(self, seq: Outcome) -> tuple[str, FinishReason, Usage]:
        """The held-back tail, the finish reason and the usage."""
        reason: FinishReason = "length" if seq.finish_reason == "length" and not self.stopped else "stop"
        usage = Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.generated,
            total_tokens=self.prompt_tokens + self.generated,
            cached_tokens=seq.cached_tokens,
            speculative=getattr(seq, "spec_summary", None),
        )
        return self.text.flush(), reason, usage


class TorchEngineBackend(Backend):
    """A GGUF model served by the torch engine (fp32, bf16 or fp8 weights), many requests at once.

    ``model`` is a catalogue name (pulled and verified by :func:`edgecloud.store.resolve_model`)
    or a local ``.gguf`` path; ``precision`` is passed to ``Transformer.from_gguf``;
    ``n_ctx`` caps prompt + answer (default: the model's context, at most
    :data:`DEFAULT_N_CTX`); ``max_batch`` sequences decode together and up to ``max_queue``
    wait; ``pack`` switches float32 CPU layers to oneDNN's prepacked matmuls (default: when
    possible). Loading is lazy: :meth:`load` or the first request does it.
    """

    name = "torch-engine"
    target = "cloud"
    supports_logprobs = False
    supports_seed = True
    supports_stop = True

    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        *,
        precision: str = "fp32",
        n_ctx: int | None = None,
        device: str = "cpu",
        max_batch: int = DEFAULT_MAX_BATCH,
        max_queue: int = DEFAULT_MAX_QUEUE,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        pack: bool | None = None,
        fp8_skip: tuple[str, ...] = (),
        speculative: SpecConfig | None = None,
        draft_model: str | Path | None = None,
    ) -> None:
        from ..engine import PRECISIONS

        if precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
        if n_ctx is not None and n_ctx < 16:
            raise ConfigError(f"n_ctx must be at least 16 tokens, got {n_ctx}")
        if max_batch < 1:
            raise ConfigError(f"max_batch must be at least 1, got {max_batch}")
        if max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {max_queue}")
        self.speculative = speculative or SpecConfig()
        if self.speculative.mode in ("draft", "auto") and draft_model is None:
            raise ConfigError(f"speculative mode {self.speculative.mode!r} needs a draft model (--draft-model)")
        self.draft_model = draft_model
        self.model = model
        self.model_name = Path(model).stem if isinstance(model, Path) or str(model).endswith(".gguf") else str(model)
        self.precision = precision
        self.device = device
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefix_cache_bytes = prefix_cache_bytes
        self.pack = pack
        self.fp8_skip = tuple(fp8_skip)
        self._n_ctx_request = n_ctx
        self.n_ctx = 0
        self.model_path: Path | None = None
        #: Prometheus metrics of this engine (``GET /metrics`` renders them).
        self.metrics = ServerMetrics(self.model_name)
        self.packed_layers: list[str] = []
        self._transformer: Any = None
        self._tokenizer: Any = None
        self._scheduler: Scheduler | None = None
        self._load_lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    @property
    def loaded(self) -> bool:
        """True once the weights are in memory."""
        return self._scheduler is not None

    @property
    def scheduler(self) -> Scheduler:
        """The running scheduler (loads the model first if needed)."""
        self.load()
        assert self._scheduler is not None
        return self._scheduler

    def load(self) -> None:
        """Resolve and load the model and start the scheduler now (otherwise the first request does it)."""
        if self._scheduler is not None:
            return
        with self._load_lock:
            if self._closed:
                raise BackendUnavailableError(f"the {self.name} backend is closed; create a new one", cause="closed")
            if self._scheduler is None:
                self._load()

    def _load(self) -> None:
        from ..store import resolve_model
        from ..engine import Tokenizer, Transformer, pack_linears

        path = resolve_model(self.model, pull=True, progress=False)
        kwargs: dict[str, Any] = {"fp8_skip": self.fp8_skip} if self.fp8_skip else {}
        try:
            transformer = Transformer.from_gguf(path, precision=self.precision, device=self.device, **kwargs)
        except (RuntimeError, OSError) as exc:
            raise BackendUnavailableError(f"the torch engine could not load {path}: {exc}") from exc
        if self.pack is not False and self.device == "cpu":
            self.packed_layers = pack_linears(transformer)
        tokenizer = Tokenizer(path)
        limit = transformer.args.context_length
        self.n_ctx = min(self._n_ctx_request, limit) if self._n_ctx_request else min(DEFAULT_N_CTX, limit)
        self.model_path = path
        self._transformer, self._tokenizer = transformer, tokenizer
        try:
            speculator = self._speculator(tokenizer.vocab_size)
        except BaseException:
            tokenizer.close()
            raise
        self._scheduler = Scheduler(
            transformer,
            eog_ids=tokenizer.eog_ids,
            max_batch=self.max_batch,
            max_queue=self.max_queue,
            prefix_cache_bytes=self.prefix_cache_bytes,
            max_context=self.n_ctx,
            metrics=self.metrics,
            speculator=speculator,
        )

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
                self.draft_model, target_vocab=target_vocab, max_seqs=self.max_batch, ctx_per_seq=self.n_ctx
            )
        return Speculator(config, proposers, metrics=self.metrics)

    def close(self) -> None:
        """Stop the scheduler (open streams end with BackendUnavailableError) and free the model."""
        with self._load_lock:
            self._closed = True
            scheduler, self._scheduler = self._scheduler, None
            tokenizer, self._tokenizer, self._transformer = self._tokenizer, None, None
        if scheduler is not None:
            scheduler.close()
        if tokenizer is not None:
            tokenizer.close()

    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt tokens this backend evaluates for ``messages``."""
        self.load()
        return self._tokenizer.encode_chat(messages)

    # ------------------------------------------------------------------ requests

    def _params(self, request: ChatRequest | CompletionRequest, prompt: list[int]) -> SamplingParams:
        if len(prompt) + 1 > self.n_ctx:
            raise ContextOverflowError(len(prompt), self.n_ctx, detail=" (with at least 1 token of room for the answer)")
        if request.max_tokens is not None and len(prompt) + request.max_tokens > self.n_ctx:
            raise ContextOverflowError(
                len(prompt), self.n_ctx, detail=f" and {request.max_tokens} max_tokens were requested"
            )
        params = sampling_params(request, request.max_tokens or self.n_ctx - len(prompt))
        options = getattr(request, "speculative", None)
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

    def _submit(
        self, request: ChatRequest | CompletionRequest, loop: asyncio.AbstractEventLoop | None
    ) -> tuple[Sequence, Answer]:
        scheduler = self.scheduler
        if isinstance(request, ChatRequest):
            reject_unsupported(request)
            prompt = self._tokenizer.encode_chat(request.message_dicts(), continue_final=request.continue_final_message)
        else:
            # add_bos: llama.cpp adds the BOS token only where the model's vocabulary asks for one.
            prompt = self._tokenizer.encode(request.text, add_bos=True)
        params = self._params(request, prompt)
        seq = scheduler.submit(prompt, params, loop=loop)
        return seq, Answer(self._tokenizer, request.stop_sequences, len(prompt), params.max_new_tokens)

    def _route(self) -> RouteInfo:
        return RouteInfo(target="cloud", backend=self.name, reason=f"torch engine ({self.precision}, {self.device})")

    # ------------------------------------------------------------------ streams

    def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        """Yield the answer as OpenAI-shaped chunks; closing the iterator cancels the sequence."""
        return self._iterate(request, ChatChunks)

    async def astream(self, request: ChatRequest) -> AsyncIterator[ChatCompletionChunk]:
        """Async twin of :meth:`stream`, fed by the scheduler without a worker thread."""
        async for chunk in self._aiterate(request, ChatChunks):
            yield chunk

    def stream_completion(self, request: CompletionRequest) -> Iterator[Completion]:
        """``/v1/completions``: the prompt continued as is, as ``text_completion`` chunks."""
        return self._iterate(request, _TextChunks)

    async def astream_completion(self, request: CompletionRequest) -> AsyncIterator[Completion]:
        """Async twin of :meth:`stream_completion`."""
        async for chunk in self._aiterate(request, _TextChunks):
            yield chunk

    def _iterate(self, request: ChatRequest | CompletionRequest, chunks: type[_Chunks]) -> Iterator[Any]:
        seq, answer = self._submit(request, None)
        out = chunks(self.model_name, self._route(), answer)
        try:
            yield from out.start()
            for token in seq:
                yield from out.push(token)
                if answer.stopped:
                    break
            yield from out.finish(seq)
        finally:
            seq.cancel()

    async def _aiterate(self, request: ChatRequest | CompletionRequest, chunks: type[_Chunks]) -> AsyncIterator[Any]:
        await asyncio.to_thread(self.load)
        seq, answer = self._submit(request, asyncio.get_running_loop())
        out = chunks(self.model_name, self._route(), answer)
        try:
            for chunk in out.start():
                yield chunk
            async for token in seq:
                for chunk in out.push(token):
                    yield chunk
                if answer.stopped:
                    break
            for chunk in out.finish(seq):
                yield chunk
        finally:
            seq.cancel()


class _Chunks:
    """Builds one answer's response objects from its token ids (one subclass per response shape)."""

    def __init__(self, model_name: str, route: RouteInfo, answer: Answer) -> None:
        self.model, self.route, self.answer = model_name, route, answer
        self.created = now()

    def start(self) -> list[Any]:
        return []

    def push(self, token: int) -> list[Any]:
        delta = self.answer.push(token)
        return [self.delta(delta)] if delta else []

    def delta(self, text: str) -> Any:
        raise NotImplementedError

    def finish(self, seq: Outcome) -> list[Any]:
        raise NotImplementedError


class ChatChunks(_Chunks):
    """``chat.completion.chunk`` objects: a role chunk, text deltas, a finish chunk with usage and route."""

    def __init__(self, model_name: str, route: RouteInfo, answer: Answer) -> None:
        super().__init__(model_name, route, answer)
        self.id = new_completion_id()

    def _chunk(self, delta: ChoiceDelta, finish: FinishReason | None = None, **extra: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[ChunkChoice(delta=delta, finish_reason=finish)],
            **extra,
        )

    def start(self) -> list[Any]:
        return [self._chunk(ChoiceDelta(role="assistant", content=""), route=self.route)]

    def delta(self, text: str) -> ChatCompletionChunk:
        return self._chunk(ChoiceDelta(content=text))

    def finish(self, seq: Outcome) -> list[Any]:
        tail, reason, usage = self.answer.finish(seq)
        chunks: list[Any] = [self.delta(tail)] if tail else []
        chunks.append(self._chunk(ChoiceDelta(), reason, usage=usage, route=self.route))
        return chunks


class _TextChunks(_Chunks):
    """``text_completion`` objects: text pieces, then the last one with finish reason, usage and route."""

    def __init__(self, model_name: str, route: RouteInfo, answer: Answer) -> None:
        super().__init__(model_name, route, answer)
        self.id = new_text_completion_id()

    def delta(self, text: str, finish: FinishReason | None = None, **extra: Any) -> Completion:
        return Completion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[CompletionChoice(text=text, finish_reason=finish)],
            **extra,
        )

    def finish(self, seq: Outcome) -> list[Any]:
        tail, reason, usage = self.answer.finish(seq)
        return [self.delta(tail, reason, usage=usage, route=self.route)]
