"""The torch engine as a :class:`~edgecloud.backend.Backend`: what ``edgecloud serve`` runs.

This module owns :class:`TorchEngineBackend`. It turns a :class:`~edgecloud.types.ChatRequest`
into OpenAI-shaped chunks with the engine of :mod:`edgecloud.cloud.engine`: the GGUF's chat
template and llama.cpp's tokenizer (:class:`~edgecloud.cloud.engine.Tokenizer`), a fresh KV
cache sized for the request, :func:`~edgecloud.cloud.engine.generate` for sampling
(temperature, top-p, seed), and :class:`~edgecloud.edge.text_stream.TextStream` for
UTF-8-safe deltas and stop strings.

Requests run one at a time (a lock held while a stream is open); the continuous-batching
scheduler replaces this behind the same interface. A request whose prompt plus
``max_tokens`` does not fit the context fails with
:class:`~edgecloud.errors.ContextOverflowError` before anything runs; options the engine
does not implement (logprobs, presence/frequency penalties) fail with
:class:`~edgecloud.errors.InvalidRequestError` naming the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..backend import SerialBackend
from ..edge.text_stream import TextStream
from ..errors import (
    BackendError,
    BackendUnavailableError,
    ConfigError,
    ContextOverflowError,
    EdgeCloudError,
    InvalidRequestError,
)
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

__all__ = ["DEFAULT_MODEL", "DEFAULT_N_CTX", "TorchEngineBackend"]

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct-q4"
#: Context served when neither ``n_ctx`` nor a smaller model limit says otherwise; every
#: request allocates its own KV cache, so this bounds the memory one request can take.
DEFAULT_N_CTX = 4096
#: OpenAI's defaults when a request leaves them out.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0


class TorchEngineBackend(SerialBackend):
    """A GGUF model served by the torch engine (fp32, bf16 or fp8 weights).

    ``model`` is a catalogue name (pulled and verified by :func:`edgecloud.store.resolve_model`)
    or a local ``.gguf`` path; ``precision`` is passed to ``Transformer.from_gguf``;
    ``n_ctx`` caps prompt + answer (default: the model's context, at most
    :data:`DEFAULT_N_CTX`). Loading is lazy: :meth:`load` or the first request does it.
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
    ) -> None:
        from .engine import PRECISIONS

        if precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
        if n_ctx is not None and n_ctx < 16:
            raise ConfigError(f"n_ctx must be at least 16 tokens, got {n_ctx}")
        self.model = model
        self.model_name = Path(model).stem if isinstance(model, Path) or str(model).endswith(".gguf") else str(model)
        self.precision = precision
        self.device = device
        self._n_ctx_request = n_ctx
        self.n_ctx = 0
        self.model_path: Path | None = None
        self._transformer: Any = None
        self._tokenizer: Any = None
        super().__init__()

    # ------------------------------------------------------------------ lifecycle

    @property
    def loaded(self) -> bool:
        """True once the weights are in memory."""
        return self._transformer is not None

    def load(self) -> None:
        """Resolve and load the model now (otherwise the first request does it)."""
        with self._serving():
            self._ensure_loaded()

    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt tokens this backend evaluates for ``messages``."""
        with self._serving():
            self._ensure_loaded()
            return self._tokenizer.encode_chat(messages)

    def _free(self) -> None:
        tokenizer, self._tokenizer, self._transformer = self._tokenizer, None, None
        if tokenizer is not None:
            tokenizer.close()

    def _ensure_loaded(self) -> None:
        if self._transformer is not None:
            return
        from ..store import resolve_model
        from .engine import Tokenizer, Transformer

        path = resolve_model(self.model, pull=True, progress=False)
        try:
            transformer = Transformer.from_gguf(path, precision=self.precision, device=self.device)
        except (RuntimeError, OSError) as exc:
            raise BackendUnavailableError(f"the torch engine could not load {path}: {exc}") from exc
        self._tokenizer = Tokenizer(path)
        self._transformer = transformer
        self.model_path = path
        limit = transformer.args.context_length
        self.n_ctx = min(self._n_ctx_request, limit) if self._n_ctx_request else min(DEFAULT_N_CTX, limit)

    # ------------------------------------------------------------------ the stream

    def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        """Yield the answer as OpenAI-shaped chunks; closing the iterator stops generation."""
        return self._generate(request)

    def _check_supported(self, request: ChatRequest) -> None:
        if request.logprobs:
            raise InvalidRequestError("logprobs are not supported by the torch engine yet", param="logprobs")
        for field in ("presence_penalty", "frequency_penalty"):
            if getattr(request, field):
                raise InvalidRequestError(f"{field} is not supported by the torch engine yet", param=field)

    def _generate(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        self._check_supported(request)
        with self._serving():
            self._ensure_loaded()
            prompt = self._tokenizer.encode_chat(request.message_dicts())
            if len(prompt) + 1 > self.n_ctx:
                raise ContextOverflowError(
                    len(prompt), self.n_ctx, detail=" (with at least 1 token of room for the answer)"
                )
            if request.max_tokens is not None and len(prompt) + request.max_tokens > self.n_ctx:
                raise ContextOverflowError(
                    len(prompt), self.n_ctx, detail=f" and {request.max_tokens} max_tokens were requested"
                )
            max_new = request.max_tokens or self.n_ctx - len(prompt)
            try:
                yield from self._decode(request, prompt, max_new)
            except (GeneratorExit, EdgeCloudError):
                raise
            except Exception as exc:
                raise BackendError(f"the torch engine failed while generating: {exc}") from exc

    def _decode(self, request: ChatRequest, prompt: list[int], max_new: int) -> Iterator[ChatCompletionChunk]:
        from .engine import generate

        model, tokenizer = self._transformer, self._tokenizer
        completion_id, created = new_completion_id(), now()
        route = RouteInfo(target="cloud", backend=self.name, reason=f"torch engine ({self.precision}, {self.device})")

        def chunk(
            delta: ChoiceDelta, finish: FinishReason | None = None, usage: Usage | None = None
        ) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=completion_id,
                created=created,
                model=self.model_name,
                choices=[ChunkChoice(delta=delta, finish_reason=finish)],
                usage=usage,
                route=route if finish is not None else None,
            )

        yield ChatCompletionChunk(
            id=completion_id,
            created=created,
            model=self.model_name,
            choices=[ChunkChoice(delta=ChoiceDelta(role="assistant", content=""))],
            route=route,
        )
        temperature = DEFAULT_TEMPERATURE if request.temperature is None else request.temperature
        top_p = DEFAULT_TOP_P if request.top_p is None else request.top_p
        tokens = generate(
            model,
            tokenizer,
            prompt,
            max_new,
            temperature=temperature,
            top_p=top_p,
            seed=request.seed,
            cache=model.new_cache(len(prompt) + max_new),
        )
        text = TextStream(request.stop_sequences)
        generated = 0
        finish: FinishReason = "stop"
        try:
            for token in tokens:
                generated += 1
                delta = text.push(tokenizer.token_to_piece(token, special=False))
                if delta:
                    yield chunk(ChoiceDelta(content=delta))
                if text.stopped:
                    break
            else:
                finish = "length" if generated >= max_new else "stop"
        finally:
            close = getattr(tokens, "close", None)
            if close is not None:
                close()  # stops the engine's generator (and its KV cache) at once
        tail = text.flush()
        if tail:
            yield chunk(ChoiceDelta(content=tail))
        usage = Usage(prompt_tokens=len(prompt), completion_tokens=generated, total_tokens=len(prompt) + generated)
        yield chunk(ChoiceDelta(), finish=finish, usage=usage)
