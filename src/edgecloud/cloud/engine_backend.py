"""The torch engine as a :class:`~edgecloud.backend.Backend`: what ``edgecloud serve`` runs.

This module owns :class:`TorchEngineBackend`. It turns a :class:`~edgecloud.types.ChatRequest`
(or a :class:`~edgecloud.runtime.completions.CompletionRequest`) into OpenAI-shaped chunks:
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

Chunks come from :class:`~edgecloud.runtime.chunks.AnswerChunks`, the one chunk builder every
runtime uses; ``/v1/completions`` reshapes the same chunks as ``text_completion`` objects.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from ..engine.model import DEFAULT_N_CTX
from ..store.catalogue import DEFAULT_MODEL
from ..backend import Backend
from ..runtime.sampling import SamplingParams, sampling_params
from ..runtime.chunks import AnswerChunks
from ..errors import BackendUnavailableError, ConfigError, ContextOverflowError, InvalidRequestError
from ..observability.server_metrics import ServerMetrics
from ..types import (
    ChatCompletionChunk,
    ChatRequest,
    FinishReason,
    RouteInfo,
)
from ..runtime.completions import Completion, CompletionChoice, CompletionRequest, new_text_completion_id
from .speculative import LlamaDraftProposer, NgramProposer, Proposer, SpecConfig, Speculator
from .scheduler import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PREFIX_CACHE_BYTES,
    Scheduler,
    Sequence,
)

__all__ = ["DEFAULT_MODEL", "DEFAULT_N_CTX", "TorchEngineBackend"]



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
        #: Times a dead scheduler loop was replaced in-process.
        self.restarts = 0

    # ------------------------------------------------------------------ lifecycle

    @property
    def loaded(self) -> bool:
        """True once the weights are in memory."""
        return self._scheduler is not None

    @property
    def scheduler(self) -> Scheduler:
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
                        self._start_scheduler()
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
            self._start_scheduler()
        except BaseException:
            tokenizer.close()
            raise

    def _start_scheduler(self) -> None:
        """A new scheduler over the loaded model (at load, and to replace a loop that died)."""
        speculator = self._speculator(self._tokenizer.vocab_size)
        self._scheduler = Scheduler(
            self._transformer,
            eog_ids=self._tokenizer.eog_ids,
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
    ) -> tuple[Sequence, AnswerChunks, int]:
        scheduler = self.scheduler
        tokenizer = self._tokenizer
        if isinstance(request, ChatRequest):
            for option in ("logprobs", "presence_penalty", "frequency_penalty"):
                if getattr(request, option):
                    raise InvalidRequestError(f"{option} is not supported by the torch engine yet", param=option)
            prompt = tokenizer.encode_chat(request.message_dicts(), continue_final=request.continue_final_message)
        else:
            # add_bos: llama.cpp adds the BOS token only where the model's vocabulary asks for one.
            prompt = tokenizer.encode(request.text, add_bos=True)
        params = self._params(request, prompt)
        seq = scheduler.submit(prompt, params, loop=loop)
        answer = AnswerChunks(request, self.model_name, self._route(),
                              piece=lambda token: tokenizer.token_to_piece(token, special=False), is_eog=tokenizer.is_eog)
        return seq, answer, len(prompt)

    @staticmethod
    def _finish(seq: Sequence, answer: AnswerChunks, prompt_tokens: int) -> Iterator[ChatCompletionChunk]:
        reason: FinishReason = "length" if seq.finish_reason == "length" else "stop"
        return answer.finish(prompt_tokens, seq.cached_tokens, reason=reason, speculative=seq.spec_summary)

    def _route(self) -> RouteInfo:
        return RouteInfo(target="cloud", backend=self.name, reason=f"torch engine ({self.precision}, {self.device})")

    # ------------------------------------------------------------------ streams

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
                for chunk in answer.push(token):
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
                for chunk in answer.push(token):
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
            choices=[CompletionChoice(text=choice.delta.content or "", finish_reason=choice.finish_reason)],
            usage=chunk.usage, route=chunk.route if choice.finish_reason is not None else None,
        )]
