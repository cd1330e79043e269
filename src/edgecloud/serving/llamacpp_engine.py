"""The llama.cpp serving engine: ``edgecloud serve --engine llamacpp``, many requests per decode step.

This module owns :class:`LlamaCppEngineBackend`: a GGUF model served in its own quantization
(INT4 as shipped) by llama.cpp with continuous batching
(:class:`~edgecloud.serving.llamacpp_scheduler.LlamaCppScheduler`: slots with per-slot prefix
reuse, one ``llama_decode`` per step for every running sequence, a sampler chain per sequence,
speculative decoding). It answers what the edge's
:class:`~edgecloud.edge.llamacpp.LlamaCppBackend` answers (logprobs, ``logit_bias``, penalties,
seeds, ``response_format`` grammars, ``continue_final_message``), concurrently, plus
``/v1/completions`` (text or token-id prompts) and scoring (``echo`` + ``logprobs``, which the
verified collaboration mode uses). Lifecycle, queue (429 when full), cancellation on disconnect
and metrics are shared with the torch engine (:class:`~edgecloud.serving.engine_base.BatchedEngineBackend`).

Memory: the weights as the file has them, plus one KV stream of ``n_ctx`` positions per slot
(``max_batch`` slots), allocated at load.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailableError, ConfigError
from ..runtime.chunks import AnswerChunks
from ..runtime.completions import CompletionRequest
from ..runtime.llama_cpp import physical_cores
from ..runtime.llamacpp_sampler import make_sampler
from ..runtime.coupling import Coupling
from ..runtime.held import HeldGrammar, held_picker
from ..runtime.scoring import TokenScore, check_token_ids
from ..store.catalogue import DEFAULT_MODEL
from ..types import ChatRequest, RouteInfo
from .batching import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE, BatchSequence
from .engine_base import BatchedEngineBackend
from .llamacpp_scheduler import DEFAULT_MAX_PREFILL_TOKENS, LlamaCppScheduler, LlamaSequence
from .speculative import SpecConfig

__all__ = ["DEFAULT_SLOT_CTX", "LlamaCppEngineBackend"]

#: Positions per slot when ``n_ctx`` is not given (capped by the model's training context).
DEFAULT_SLOT_CTX = 4096


class LlamaCppEngineBackend(BatchedEngineBackend):
    """A GGUF model served by llama.cpp with continuous batching (see the module docstring).

    ``n_ctx`` is each request's room (prompt + answer; default :data:`DEFAULT_SLOT_CTX`, at most
    the model's training context); ``max_batch`` slots decode together and up to ``max_queue``
    requests wait; ``n_batch`` caps the tokens of one decode step; ``threads`` defaults to the
    physical cores. ``speculative`` / ``draft_model`` as for the torch engine.

    ``kv_ram_bytes`` keeps the prefixes slots drop (a session waiting for its next turn while
    other requests take its slot) in RAM, up to that size, and gives them back to the next
    request that starts with them; ``kv_disk_bytes`` lets that RAM tier spill to files under
    ``kv_dir`` (:mod:`edgecloud.runtime.kv_tiers`). Both 0: a dropped prefix is recomputed.
    """

    name = "llamacpp-engine"
    supports_logprobs = True
    supports_seed = True
    supports_stop = True
    applies_logit_bias = True
    applies_grammar = True

    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        *,
        n_ctx: int | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_queue: int = DEFAULT_MAX_QUEUE,
        n_batch: int = 512,
        threads: int | None = None,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        speculative: SpecConfig | None = None,
        draft_model: str | Path | None = None,
        kv_ram_bytes: int = 0,
        kv_disk_bytes: int = 0,
        kv_dir: str | Path | None = None,
        verbose: bool = False,
    ) -> None:
        super().__init__(model, n_ctx=n_ctx, max_batch=max_batch, max_queue=max_queue)
        if kv_ram_bytes < 0 or kv_disk_bytes < 0:
            raise ConfigError("kv_ram_bytes and kv_disk_bytes must be >= 0")
        if kv_disk_bytes and not kv_ram_bytes:
            raise ConfigError("the disk tier holds what the RAM tier evicts: give kv_ram_bytes too")
        if kv_disk_bytes and kv_dir is None:
            raise ConfigError("a disk tier needs kv_dir (the folder its states are written to)")
        self.kv_ram_bytes, self.kv_disk_bytes, self.kv_dir = kv_ram_bytes, kv_disk_bytes, kv_dir
        self._kv_store: Any = None
        if n_batch < max_batch + 1:
            raise ConfigError(f"n_batch must exceed max_batch ({max_batch}) so prompts make progress, got {n_batch}")
        if threads is not None and threads < 1:
            raise ConfigError(f"threads must be at least 1, got {threads}")
        self.n_batch = n_batch
        self.threads = threads or physical_cores()
        self._set_speculation(speculative, draft_model)
        self.max_prefill_tokens = max_prefill_tokens
        self.verbose = verbose
        self._context: Any = None
        self._tokenizer: Any = None

    # ------------------------------------------------------------------ lifecycle

    def _load(self) -> None:
        from ..runtime.llamacpp_batch import MultiSeqContext
        from ..runtime.tokenizer import Tokenizer
        from ..store import resolve_model

        path = resolve_model(self.model, pull=True, progress=False)
        trained = _trained_context(path)
        per_slot = min(self._n_ctx_request or DEFAULT_SLOT_CTX, trained) if trained else (
            self._n_ctx_request or DEFAULT_SLOT_CTX)
        try:
            context = MultiSeqContext(path, n_seq=self.max_batch, n_ctx=per_slot * self.max_batch,
                                      n_batch=self.n_batch, threads=self.threads, verbose=self.verbose)
        except (ValueError, RuntimeError, OSError) as exc:
            raise BackendUnavailableError(f"llama.cpp could not load {path}: {exc}", cause="load_error") from exc
        self._context = context
        self._tokenizer = Tokenizer(path, llm=context.llm)
        self.n_ctx = context.room
        self.model_path = path
        try:
            self._start_scheduler()
        except BaseException:
            self._close_runtime()
            raise

    def _start_scheduler(self) -> None:
        tokenizer = self._tokenizer
        self._scheduler = LlamaCppScheduler(
            self._context,
            eog_ids=tokenizer.eog_ids,
            piece=lambda token: tokenizer.token_to_piece(token, special=False),
            max_queue=self.max_queue,
            metrics=self.metrics,
            max_prefill_tokens=self.max_prefill_tokens,
            speculator=self._speculator(tokenizer.vocab_size),
            kv_store=self._make_kv_store(),
        )

    def _make_kv_store(self) -> Any:
        if not self.kv_ram_bytes:
            return None
        from ..runtime.kv_disk import DiskTier, StateKey
        from ..runtime.kv_tiers import SlotKVStore
        from ..store.cache import known_sha256

        events = self.metrics.on_kv_event if self.metrics is not None else None
        disk = None
        if self.kv_disk_bytes:
            import llama_cpp

            key = StateKey(model_sha256=known_sha256(self.model_path), n_ctx=self._context.room, kv_type="1/1",
                           runtime=f"llama-cpp-python {llama_cpp.__version__} engine")
            disk = DiskTier(self.kv_dir, key, self.kv_disk_bytes, events=events)  # type: ignore[arg-type]
        self._kv_store = SlotKVStore(self.kv_ram_bytes, disk, events=events)
        return self._kv_store

    def flush_kv(self) -> None:
        """Wait until the slot prefixes queued for the disk tier are written."""
        if self._kv_store is not None:
            self._kv_store.flush()

    def _close_runtime(self) -> None:
        store, self._kv_store = self._kv_store, None
        if store is not None:
            store.close()
        tokenizer, self._tokenizer = self._tokenizer, None
        context, self._context = self._context, None
        if tokenizer is not None:
            tokenizer.close()
        if context is not None:
            context.close()

    # ------------------------------------------------------------------ tokens

    def tokenize_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt tokens this backend evaluates for ``messages`` (with the ``tools`` offered)."""
        self.load()
        return self._tokenizer.encode_chat(messages, tools=tools)

    def tokenize_text(self, text: str) -> list[int]:
        """``text`` as this model's token ids (special tokens parsed, no BOS added)."""
        self.load()
        return self._tokenizer.encode(text)

    def token_bytes(self, token: int) -> bytes:
        """The bytes ``token`` stands for in an answer (control tokens as nothing)."""
        self.load()
        return self._tokenizer.token_to_piece(token, special=False)

    def score(self, tokens: list[int], *, start: int, top_n: int = 1, coupling: Coupling | None = None,
              grammar: HeldGrammar | None = None) -> tuple[list[TokenScore], TokenScore]:
        """How this model scores ``tokens[start:]`` given what precedes each, and its next token
        (greedy, or the pick: ``coupling``'s draw, held to ``grammar``; with the picks at every
        position): one pass over the positions the chosen slot does not hold (a verifier's k + 1)."""
        scores, nxt, _ = self.score_cached(tokens, start=start, top_n=top_n, coupling=coupling, grammar=grammar)
        return scores, nxt

    def score_cached(self, tokens: list[int], *, start: int, top_n: int = 1, coupling: Coupling | None = None,
                     grammar: HeldGrammar | None = None) -> tuple[list[TokenScore], TokenScore, int]:
        """:meth:`score`, and how many leading ``tokens`` were read from a slot's KV (its prefix
        cache), not computed."""
        if not 1 <= start <= len(tokens):
            raise ConfigError(f"start must be in 1..{len(tokens)}, got {start}")
        scheduler = self.scheduler
        check_token_ids(tokens, self._tokenizer.vocab_size, self.n_ctx - 1)
        held = held_picker(self._tokenizer.grammar_mask, grammar, coupling, tokens, start)
        try:
            return scheduler.score(list(tokens), start, top_n, coupling, held)  # type: ignore[attr-defined]
        finally:
            if held is not None:
                held.close()

    # ------------------------------------------------------------------ requests

    def _submit(
        self, request: ChatRequest | CompletionRequest, loop: asyncio.AbstractEventLoop | None
    ) -> tuple[BatchSequence, AnswerChunks, int]:
        scheduler = self.scheduler
        tokenizer, context = self._tokenizer, self._context
        if isinstance(request, ChatRequest):
            prompt = tokenizer.encode_request(request)
        elif request.token_ids is not None:
            prompt = list(request.token_ids)
            check_token_ids(prompt, tokenizer.vocab_size, self.n_ctx - 1)
        else:
            # add_bos: llama.cpp adds the BOS token only where the model's vocabulary asks for one.
            prompt = tokenizer.encode(request.text, add_bos=True)
        params = self._params(request, prompt)
        answer = AnswerChunks(request, self.model_name, self._route(),
                              piece=lambda token: tokenizer.token_to_piece(token, special=False), is_eog=tokenizer.is_eog,
                              stream_calls=True)
        sampler = make_sampler(context._lib, context.vocab, context.n_vocab, params, coupled=True)

        def setup(seq: LlamaSequence) -> None:
            seq.sampler, seq.top_n = sampler, answer.top_n

        try:
            seq = scheduler.submit(prompt, params, loop=loop, setup=setup)  # type: ignore[arg-type]
        except BaseException:
            if sampler is not None:
                sampler.close()
            raise
        return seq, answer, len(prompt)

    def describe(self) -> str:
        return f"llama.cpp engine serving {self.model_name}: {self.max_batch} slots of {self.n_ctx} tokens"

    def _route(self) -> RouteInfo:
        return RouteInfo(target="cloud", backend=self.name,
                         reason=f"llama.cpp engine ({self.max_batch} slots, {self.threads} threads)")


def _trained_context(path: Path) -> int:
    """The model's training context from its GGUF header (0 when the file does not say)."""
    from ..runtime.gguf import read_gguf_spec

    try:
        return int(read_gguf_spec(path).n_ctx_train or 0)
    except Exception:  # noqa: BLE001 - a header llama.cpp can still load; fall back to the default
        return 0
