"""The torch engine as a :class:`~edgecloud.backend.Backend`: ``edgecloud serve --engine torch``.

This module owns :class:`TorchEngineBackend`. It turns a :class:`~edgecloud.types.ChatRequest`
(or a :class:`~edgecloud.runtime.completions.CompletionRequest`) into OpenAI-shaped chunks:
the GGUF's chat template and llama.cpp's tokenizer (:class:`~edgecloud.engine.Tokenizer`),
the continuous-batching :class:`~edgecloud.serving.scheduler.Scheduler` for generation (many
requests share each forward pass; shared prompt prefixes are reused), and
:class:`~edgecloud.runtime.text_stream.TextStream` for UTF-8-safe deltas and stop strings.
Lifecycle and the streams are :class:`~edgecloud.serving.engine_base.BatchedEngineBackend`'s.

A request whose prompt plus ``max_tokens`` does not fit the context fails with
:class:`~edgecloud.errors.ContextOverflowError` before anything runs; a full waiting queue
fails with :class:`~edgecloud.errors.RateLimitedError` (HTTP 429); structured output and tool
calls are held to their grammar (llama.cpp's grammar engine masking the torch logits), and
penalties, ``logit_bias`` and logprobs are applied and reported per sequence as the llama.cpp engine does (such
sequences pick their token on the host, a token a step, without drafts); what the engine does
not implement (scoring with ``echo``) fails with
:class:`~edgecloud.errors.InvalidRequestError` naming the field.

On a CPU with float32 weights the linear layers are switched to oneDNN's prepacked matmuls
(:func:`~edgecloud.engine.pack_linears`), which keep small decode batches cheap.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ..engine.model import DEFAULT_N_CTX
from ..store.catalogue import DEFAULT_MODEL
from ..runtime.chunks import AnswerChunks
from ..runtime.coupling import Coupling
from ..runtime.held import HeldGrammar, held_picker
from ..runtime.scoring import TokenScore, check_token_ids, score_rows
from ..runtime.sampling import check_logit_bias
from ..errors import BackendUnavailableError, ConfigError
from ..types import ChatRequest, RouteInfo
from ..runtime.completions import CompletionRequest
from .batching import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE
from .engine_base import BatchedEngineBackend
from .speculative import SpecConfig
from .scheduler import DEFAULT_PREFIX_CACHE_BYTES, Scheduler, Sequence

__all__ = ["DEFAULT_MODEL", "DEFAULT_N_CTX", "TorchEngineBackend"]


class TorchEngineBackend(BatchedEngineBackend):
    """A GGUF model served by the torch engine (fp32, bf16 or fp8 weights), many requests at once.

    ``model`` is a catalogue name (pulled and verified by :func:`edgecloud.store.resolve_model`)
    or a local ``.gguf`` path; ``precision`` is passed to ``Transformer.from_gguf``;
    ``n_ctx`` caps prompt + answer (default: the model's context, at most
    :data:`DEFAULT_N_CTX`); ``max_batch`` sequences decode together and up to ``max_queue``
    wait; ``pack`` switches float32 CPU layers to oneDNN's prepacked matmuls (default: when
    possible). Loading is lazy: :meth:`load` or the first request does it.
    """

    name = "torch-engine"
    #: ``response_format`` and tool calls are held to llama.cpp's grammar engine over the torch
    #: logits (:class:`~edgecloud.runtime.grammar_mask.GrammarMask`), the same grammars as the llama.cpp engine.
    applies_logit_bias = True
    applies_grammar = True
    supports_logprobs = True
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

        if precision != "auto" and precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {precision!r}; use auto or one of {', '.join(PRECISIONS)}")
        super().__init__(model, n_ctx=n_ctx, max_batch=max_batch, max_queue=max_queue)
        self._set_speculation(speculative, draft_model)
        #: The precision asked for; after loading, the one serving (``auto`` resolved).
        self.precision = precision
        self.device = device
        #: Why the engine serves at this precision (said at start-up), once loaded.
        self.precision_reason = f"precision={precision}"
        #: The FP8 self-check's figures when ``auto`` considered FP8 (see :mod:`edgecloud.serving.fp8_check`).
        self.fp8_check: Any = None
        self.prefix_cache_bytes = prefix_cache_bytes
        self.pack = pack
        self.fp8_skip = tuple(fp8_skip)
        self.packed_layers: list[str] = []
        self._transformer: Any = None
        self._tokenizer: Any = None

    # ------------------------------------------------------------------ lifecycle

    def _load(self) -> None:
        from ..store import resolve_model
        from ..engine import Tokenizer, fuse_projections, pack_linears

        path = resolve_model(self.model, pull=True, progress=False)
        tokenizer = Tokenizer(path)
        try:
            transformer = self._load_weights(path, tokenizer)
        except BaseException:
            tokenizer.close()
            raise
        if self.pack is not False and self.device == "cpu":
            fuse_projections(transformer)
            self.packed_layers = pack_linears(transformer)
        limit = transformer.args.context_length
        self.n_ctx = min(self._n_ctx_request, limit) if self._n_ctx_request else min(DEFAULT_N_CTX, limit)
        self.model_path = path
        self._transformer, self._tokenizer = transformer, tokenizer
        try:
            self._start_scheduler()
        except BaseException:
            self._close_runtime()
            raise

    def _load_weights(self, path: Path, tokenizer: Any) -> Any:
        """The model at the precision asked for; ``auto`` resolved first (FP8 only after the self-check)."""
        from ..engine import Transformer

        precision = self.precision
        if precision == "auto":
            from .engine_choice import choose_precision

            self.device, precision, self.precision_reason = choose_precision("auto")

        def load(precision: str) -> Any:
            kwargs: dict[str, Any] = {"fp8_skip": self.fp8_skip} if self.fp8_skip and precision == "fp8" else {}
            try:
                return Transformer.from_gguf(path, precision=precision, device=self.device, **kwargs)
            except (RuntimeError, OSError) as exc:
                raise BackendUnavailableError(f"the torch engine could not load {path}: {exc}") from exc

        if precision != "fp8-checked":
            self.precision = precision
            return load(precision)
        from .fp8_check import fp8_self_check

        transformer = load("bf16")
        self.fp8_check = fp8_self_check(transformer, tokenizer, keep=self.fp8_skip)
        if self.fp8_check.passed:
            self.precision, self.precision_reason = "fp8", f"{self.precision_reason}: {self.fp8_check.describe()}"
            return transformer
        self.precision = "bf16"
        self.precision_reason = f"{self.precision_reason}: serving bf16, {self.fp8_check.describe()}"
        del transformer
        return load("bf16")

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
            piece=lambda token: self._tokenizer.token_to_piece(token, special=False),
        )

    def _close_runtime(self) -> None:
        tokenizer, self._tokenizer, self._transformer = self._tokenizer, None, None
        if tokenizer is not None:
            tokenizer.close()

    def tokenize_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt tokens this backend evaluates for ``messages`` (with the ``tools`` offered)."""
        self.load()
        return self._tokenizer.encode_chat(messages, tools=tools)

    def tokenize_text(self, text: str) -> list[int]:
        """``text`` as this model's token ids (special tokens parsed, no BOS added)."""
        self.load()
        return list(self._tokenizer.encode(text))

    def token_bytes(self, token: int) -> bytes:
        """The bytes ``token`` stands for in an answer (control tokens as nothing)."""
        self.load()
        return bytes(self._tokenizer.token_to_piece(token, special=False))

    def score(self, tokens: list[int], *, start: int, top_n: int = 1, coupling: Coupling | None = None,
              grammar: HeldGrammar | None = None) -> tuple[list[TokenScore], TokenScore]:
        """How the model scores ``tokens[start:]`` given what precedes each, and its next token (greedy,
        or the pick: ``coupling``'s draw, held to ``grammar``; with the picks at every position):
        one forward pass over the sequence (logits kept for the scored rows only), run between the
        scheduler's steps, so ``/v1/completions`` scoring (checked and verified mode) works on this
        engine too."""
        if not 1 <= start <= len(tokens):
            raise ConfigError(f"start must be in 1..{len(tokens)}, got {start}")
        scheduler = self.scheduler
        check_token_ids(tokens, self._tokenizer.vocab_size, self.n_ctx - 1)
        model = self._transformer
        import torch

        held = held_picker(self._tokenizer.grammar_mask, grammar, coupling, tokens, start)  # bad input fails first
        with scheduler.step_lock, torch.inference_mode():
            cache = model.new_cache(len(tokens) + 1)
            ids = torch.tensor(tokens, dtype=torch.long, device=model.device)
            rows = model.forward_batch([(ids, None, cache)], keep=[len(tokens) - start + 1])[0]
        if self.metrics is not None:
            self.metrics.on_forward()
        logits = rows.float().cpu().numpy()
        try:
            return score_rows(list(logits), tokens, start, top_n, coupling, held)  # row i predicts tokens[start + i]
        finally:
            if held is not None:
                held.close()

    # ------------------------------------------------------------------ requests

    def _submit(
        self, request: ChatRequest | CompletionRequest, loop: asyncio.AbstractEventLoop | None
    ) -> tuple[Sequence, AnswerChunks, int]:
        scheduler = self.scheduler
        tokenizer = self._tokenizer
        if isinstance(request, ChatRequest):
            prompt = tokenizer.encode_request(request)
        else:
            # add_bos: llama.cpp adds the BOS token only where the model's vocabulary asks for one.
            prompt = tokenizer.encode(request.text, add_bos=True)
        params = self._params(request, prompt)
        check_logit_bias(params, tokenizer.vocab_size)
        grammar = tokenizer.grammar_mask(params) if params.grammar is not None else None  # a bad one: 400, here
        answer = AnswerChunks(request, self.model_name, self._route(),
                              piece=lambda token: tokenizer.token_to_piece(token, special=False), is_eog=tokenizer.is_eog,
                              stream_calls=True)

        def setup(seq: Sequence) -> None:
            seq.grammar, seq.top_n = grammar, answer.top_n

        seq = scheduler.submit(prompt, params, loop=loop, setup=setup)
        return seq, answer, len(prompt)

    def describe(self) -> str:
        return f"torch engine serving {self.model_name} in {self.precision} on {self.device} ({self.precision_reason})"

    def _route(self) -> RouteInfo:
        return RouteInfo(target="cloud", backend=self.name, reason=f"torch engine ({self.precision}, {self.device})")
