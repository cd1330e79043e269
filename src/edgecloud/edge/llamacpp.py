"""The llama.cpp edge backend: GGUF INT4 models on this device through llama-cpp-python.

This module owns :class:`LlamaCppBackend`. llama-cpp-python is used for what it does well
(loading a GGUF file, tokenizing, batched ``eval``); the rest is ours, because the
OpenAI-shaped stream and the edge's latency budget need it:

- the prompt is the GGUF's own chat template (:mod:`edgecloud.runtime.chat_template`), rendered
  and tokenized exactly as llama-cpp-python's ``Jinja2ChatFormatter`` does (special tokens
  parsed, no extra BOS);
- a token-by-token decode loop: greedy is an ``argmax`` over the logits (no sampler call),
  temperature / top-p / penalties / seed go through a llama.cpp sampler chain; each token
  then goes to :class:`~edgecloud.runtime.chunks.AnswerChunks` (end-of-generation, logprobs as a
  log-softmax of the same logits when asked, whole UTF-8 characters, stop strings held back);
- prefix KV reuse in tiers (:mod:`edgecloud.runtime.kv_tiers`): only the suffix after the
  longest common prefix with the tokens already in the llama.cpp context is evaluated; a
  conversation about to be overwritten is saved (llama.cpp's per-sequence state API) into a
  byte-bounded RAM LRU so alternating chats resume without recomputing; states evicted from
  RAM, and each answered context (always for a session, ``prompt_cache_key``; otherwise from
  a few hundred tokens), are written to the disk tier in the background, so the next turn
  after a restart loads its KV instead of recomputing it; the template's fixed prefix (default system prompt) is evaluated at load time, so even
  the first question skips it; and after an answer, idle time (while the user reads and
  types) is used to evaluate the next turn's header (end of the answer, the user-turn
  markers), so a chat's n-th turn prefills no more than its first.

Loading is lazy: the constructor validates its arguments and touches nothing; the model is
resolved, loaded and warmed by :meth:`LlamaCppBackend.load` or on the first request, so
building a client never blocks and a model that cannot load surfaces as
:class:`~edgecloud.errors.BackendUnavailableError` (or ``ModelIntegrityError``) where a
fallback policy can route around it. Requests are served one at a time (llama.cpp contexts
are not thread-safe); a second caller waits for the first stream to finish or be closed.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..backend import TemplatedBackend
from ..errors import BackendError, BackendUnavailableError, ConfigError, EdgeCloudError, ModelIntegrityError
from ..runtime.chat_template import ChatTemplate
from ..runtime.spec_control import SpecState
from ..runtime.chunks import AnswerChunks, answer_budget, log_partition
from ..runtime.gguf import read_gguf_spec
from ..runtime.hardware import cpu_signature
from ..runtime.llama_cpp import import_llama_cpp, physical_cores, token_piece
from ..runtime.llamacpp_sampler import make_sampler
from ..runtime.kv_disk import KVEvents, StateKey
from ..runtime.kv_tiers import KVTierCounts, LlamaKVTiers
from ..runtime.prefix_cache import PrefixCache, common_prefix_len_np
from ..runtime.sampling import SamplingParams, sampling_params
from ..runtime.coupling import Coupling, Picker
from ..runtime.grammar_mask import GrammarMask
from ..runtime.held import HeldGrammar, HeldPicker, held_picker
from ..runtime.scoring import TokenScore, check_token_ids, score_rows
from ..runtime.stats import RuntimeStats
from ..store.catalogue import DEFAULT_EDGE_MODEL, DEFAULT_MODEL
from ..types import ChatCompletionChunk, ChatRequest, RouteInfo
from .speculation import PROBE_FILLER, PROBE_LONG_CONTEXT, PROBE_TEXT, EdgeSpeculator, Probe, parse_edge_speculate, remembered_probe, spec_usage

if TYPE_CHECKING:
    from ..config import CacheSettings
from .memory import plan as plan_memory

__all__ = [
    "LlamaCppBackend",
    "LlamaCppStats",
    "DEFAULT_EDGE_MODEL",
    "DEFAULT_MODEL",
    "DEFAULT_PREFIX_CACHE_BYTES",
    "KV_CACHE_TYPES",
]

#: 256 MiB holds ~21k tokens of KV for the 0.5B model at f16 (12 KiB/token), i.e. a few dozen
#: saved conversations, at a fraction of the device memory the model itself takes.
DEFAULT_PREFIX_CACHE_BYTES = 256 * 1024 * 1024
#: After an answer, wait this long for a follow-up request before using the idle time to
#: evaluate the next turn's header; back-to-back requests never pay for it.
PREFETCH_GRACE_S = 0.1
#: Never prefetch more than this many tokens (a retokenized answer that diverged a lot).
PREFETCH_MAX_TOKENS = 256

#: KV cache element types accepted for ``kv_cache_type`` -> ggml type id (ggml.h, stable).
KV_CACHE_TYPES: dict[str, int] = {
    "f32": 0,
    "f16": 1,
    "bf16": 30,
    "q8_0": 8,
    "q5_1": 7,
    "q5_0": 6,
    "q4_1": 3,
    "q4_0": 2,
    "iq4_nl": 20,
}
_UNQUANTIZED_KV = {"f32", "f16", "bf16"}


@dataclass
class LlamaCppStats(RuntimeStats, KVTierCounts):
    """Counters since load: what was served and how much prefix reuse saved (restores and saves
    per tier: :class:`~edgecloud.runtime.kv_tiers.KVTierCounts`)."""

    #: Tokens of the next turn's header evaluated in idle time after an answer.
    prefetched_tokens: int = 0


def _ggml_type(value: Any) -> int:
    """A KV type given as a name ("q8_0") or a ggml id, as the id llama.cpp wants."""
    if isinstance(value, str):
        key = value.lower()
        if key not in KV_CACHE_TYPES:
            raise ConfigError(f"unknown KV cache type {value!r}; use one of {', '.join(KV_CACHE_TYPES)}")
        return KV_CACHE_TYPES[key]
    return int(value)


class LlamaCppBackend(TemplatedBackend):
    """A GGUF model served on this device by llama.cpp, with prefix KV reuse.

    ``model`` is a catalogue name (pulled and verified by :func:`edgecloud.store.resolve_model`)
    or a local ``.gguf`` path. ``n_ctx`` / ``kv_cache_type`` override the memory planner's
    choice for ``device``; ``n_threads`` defaults to the physical cores. ``prefix_cache_bytes``
    bounds the RAM LRU of saved KV states (0 disables the LRU; the live context is still reused);
    ``disk_cache_bytes`` the disk tier under ``cache_dir`` (0, the default here, disables it; the
    client's settings turn it on: ``[cache]``); ``kv_events(tier, event)`` hears of cache events;
    ``reuse_prefix=False`` turns all prefix reuse off (every request is evaluated from
    scratch, for benchmarks). ``flash_attn`` overrides the plan's attention kernel choice
    (a quantized KV cache always uses flash attention). ``speculate`` (``edge_speculate``:
    ``"auto"``, ``"ngram"``, ``"off"`` or a draft model) sets speculative decoding
    (:mod:`edgecloud.edge.speculation`); ``speculate_k`` fixes how many tokens each guess holds
    (default: chosen per step by the controller). llama.cpp's logging is silenced unless ``verbose``.
    """

    name = "llamacpp"
    target = "edge"
    supports_logprobs = True
    supports_seed = True
    supports_stop = True

    def __init__(
        self,
        model: str | Path = DEFAULT_EDGE_MODEL,
        *,
        n_ctx: int | None = None,
        device: str = "this",
        n_threads: int | None = None,
        kv_cache_type: str | None = None,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        disk_cache_bytes: int = 0,
        cache_dir: str | Path | None = None,
        kv_events: KVEvents | None = None,
        reuse_prefix: bool = True,
        flash_attn: bool | None = None,
        speculate: str | None = "auto",
        speculate_k: int | None = None,
        verbose: bool = False,
    ) -> None:
        if n_ctx is not None and n_ctx < 16:
            raise ConfigError(f"n_ctx must be at least 16 tokens, got {n_ctx}")
        if n_threads is not None and n_threads < 1:
            raise ConfigError(f"n_threads must be at least 1, got {n_threads}")
        if kv_cache_type is not None and kv_cache_type.lower() not in KV_CACHE_TYPES:
            raise ConfigError(f"unknown kv_cache_type {kv_cache_type!r}; use one of {', '.join(KV_CACHE_TYPES)}")
        if prefix_cache_bytes < 0 or disk_cache_bytes < 0:
            raise ConfigError("prefix_cache_bytes and disk_cache_bytes must be >= 0")
        if disk_cache_bytes > 0 and cache_dir is None:
            raise ConfigError("a disk tier needs cache_dir (the folder its states are written to)")
        self.model = model
        self.model_name = Path(model).stem if isinstance(model, Path) or str(model).endswith(".gguf") else str(model)
        self.device = device
        self.verbose = verbose
        self.reuse_prefix = reuse_prefix
        self._n_ctx_request = n_ctx
        self._n_threads = n_threads
        self._kv_cache_type = kv_cache_type.lower() if kv_cache_type else None
        self._flash_attn = flash_attn
        mode, draft = parse_edge_speculate(speculate)
        #: Speculative decoding (None: off; see :mod:`edgecloud.edge.speculation`).
        self.speculator = (EdgeSpeculator(draft_model=draft, make_draft=self._load_draft, fixed_k=speculate_k)
                           if mode != "off" else None)
        self._kv = LlamaKVTiers(prefix_cache_bytes if reuse_prefix else 0, disk_cache_bytes if reuse_prefix else 0,
                                cache_dir, events=kv_events)
        super().__init__()
        #: Requests started so far; a prefetch job is stale once this moves on.
        self._started = 0
        self._prefetch_job: tuple[int, list[dict[str, str]], str | None] | None = None
        self._prefetch_wake = threading.Condition()
        self._prefetch_thread: threading.Thread | None = None
        #: The last answer's session, until its context is queued for the disk tier.
        self._unsaved: tuple[str | None] | None = None
        self._llm: Any = None
        self._lib: Any = None
        self._template: ChatTemplate | None = None
        self._pieces: dict[int, bytes] = {}
        self._n_vocab = 0
        self.model_path: Path | None = None
        #: The keyword arguments ``llama_cpp.Llama`` was built with (after load).
        self.llama_kwargs: dict[str, Any] = {}
        self.n_ctx: int = 0
        self.stats = LlamaCppStats()

    @classmethod
    def create(cls, model: str, *, n_ctx: int | None = None, device: str = "this",
               cache: CacheSettings | None = None, kv_events: KVEvents | None = None,
               speculate: str | None = None) -> LlamaCppBackend:
        """From the client's settings, with the ``[cache]`` tiers (RAM and disk) and ``edge_speculate``."""
        if cache is None:
            return cls(model, n_ctx=n_ctx, device=device, kv_events=kv_events, speculate=speculate)
        return cls(model, n_ctx=n_ctx, device=device, prefix_cache_bytes=cache.ram_mib * 2**20,
                   disk_cache_bytes=cache.disk_mib * 2**20, cache_dir=cache.folder(), kv_events=kv_events,
                   speculate=speculate)

    # ------------------------------------------------------------------ lifecycle

    def _on_close(self) -> None:
        with self._prefetch_wake:
            self._prefetch_job = None
            self._prefetch_wake.notify_all()

    def _after_close(self) -> None:
        worker = self._prefetch_thread
        if worker is not None and worker is not threading.current_thread():
            worker.join()
        if self.speculator is not None:
            self.speculator.close()

    @property
    def loaded(self) -> bool:
        """True once the model is in memory."""
        return self._llm is not None

    @property
    def context_tokens(self) -> list[int]:
        """The tokens whose KV is currently in the llama.cpp context."""
        if self._llm is None:
            return []
        return self._llm.input_ids[: self._llm.n_tokens].tolist()

    def _load_draft(self, model: str) -> LlamaCppBackend:
        """The draft model for speculation: a second runtime with this one's context, one tokenizer."""
        path = Path(model).expanduser()
        draft = LlamaCppBackend(path if path.suffix == ".gguf" else model, n_ctx=self.n_ctx, device=self.device,
                                prefix_cache_bytes=0, speculate="off")
        draft.load()
        if draft.vocab_size != self.vocab_size:
            draft.close()
            raise ConfigError(f"the draft model {draft.model_name} has a vocabulary of {draft.vocab_size} tokens and "
                              f"{self.model_name} {self.vocab_size}: speculation needs one tokenizer (a smaller "
                              "model of the same family)")
        return draft

    @property
    def vocab_size(self) -> int:
        """Tokens in the model's vocabulary (0 before load)."""
        return self._n_vocab

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The RAM LRU of saved KV states (None when disabled)."""
        return self._kv.ram

    @property
    def kv_tiers(self) -> LlamaKVTiers:
        """The RAM and disk tiers of saved KV states."""
        return self._kv

    def flush_kv(self) -> None:
        """Wait until the states queued for the disk tier are written."""
        self._kv.flush()

    def save_session(self, session: str | None = None) -> int:
        """Write the live context's KV to the disk tier now, under ``session``, and wait for it (a
        mobile host calls this when the app goes to the background); the tokens saved."""
        with self._serving():
            if self._llm is None or self._llm.n_tokens == 0:
                return 0
            n = self._llm.n_tokens
            saved = self._kv.persist(session, min_tokens=1)
            self._unsaved = None
        self._kv.flush()
        return n if saved else 0

    def restore_session(self, session: str) -> int:
        """Load ``session``'s saved KV into the context now (loading the model if need be), so the
        next turn starts at once (a host calls this when the app comes back); the tokens restored."""
        with self._serving():
            self._ensure_loaded()
            return self._kv.restore_session(session)

    def clear_prefix_cache(self) -> None:
        """Forget every state saved in RAM and the live context (the next request starts cold
        unless the disk tier holds its prefix)."""
        with self._serving():
            self._kv.clear()
            if self._llm is not None:
                self._forget_context()

    def _free(self) -> None:
        if self._llm is not None and self._unsaved is not None:  # the last answer's context, before it goes
            self._kv.persist(self._unsaved[0])
        self._unsaved = None
        self._kv.close()
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.close()

    def _ensure_loaded(self) -> Any:
        if self._llm is not None:
            return self._llm
        lib = import_llama_cpp()
        from ..store import resolve_model

        path = resolve_model(self.model, pull=True)
        kwargs = self._plan_llama_kwargs(path)
        try:
            llm = lib.Llama(model_path=str(path), verbose=self.verbose, **kwargs)
        except (ValueError, RuntimeError, OSError) as exc:
            raise self._load_error(path, exc) from exc
        self._lib, self._llm, self.model_path, self.llama_kwargs = lib, llm, path, kwargs
        # llama.cpp pads the context to a multiple of 256 (n_ctx=1000 serves 1024), but
        # llama-cpp-python's token buffers keep the size asked for: the smaller one is the limit
        self.n_ctx = min(llm.n_ctx(), len(llm.input_ids))
        self._vocab = llm._model.vocab
        self._n_vocab = llm.n_vocab()
        bos, eos = llm.token_bos(), llm.token_eos()
        self._template = ChatTemplate.from_gguf_metadata(
            llm.metadata,
            bos_token=llm._model.token_get_text(bos) if bos != -1 else "",
            eos_token=llm._model.token_get_text(eos) if eos != -1 else "",
        )
        self._pieces = {}
        self.stats = LlamaCppStats()
        self._kv.counts = self.stats
        self._kv.attach(lib, llm, lambda: self._state_key(lib, path, kwargs))
        self._warm_fixed_prefix()
        if self.speculator is not None:
            try:
                self.speculator.calibrate(self._probe_rows)
                self.speculator.prepare()  # a draft model that cannot serve fails here, not mid-answer
            except EdgeCloudError:
                self._free()
                raise
        return llm

    def _state_key(self, lib: Any, path: Path, kwargs: dict[str, Any]) -> StateKey:
        """What a saved state must match to be loaded here (the disk tier refuses anything else)."""
        from ..store.cache import known_sha256

        kv_type = f"{kwargs.get('type_k', 1)}/{kwargs.get('type_v', 1)}"
        return StateKey(model_sha256=known_sha256(path), runtime=f"llama-cpp-python {lib.__version__}",
                        n_ctx=self.n_ctx, kv_type=kv_type)

    def _plan_llama_kwargs(self, path: Path) -> dict[str, Any]:
        """Context size, batch and KV settings: the memory plan, then explicit overrides."""
        plan = plan_memory(path, device=self.device, ctx=self._n_ctx_request, kv_cache_type=self._kv_cache_type)
        if not plan.fits:
            raise BackendUnavailableError(f"{self.model_name} does not fit this device: {plan.reason}", cause="out_of_memory")
        kwargs: dict[str, Any] = plan.llama_kwargs()
        kwargs["n_ctx"] = self._n_ctx_request or plan.n_ctx
        for key in ("type_k", "type_v"):
            if kwargs.get(key) is not None:
                kwargs[key] = _ggml_type(kwargs[key])
        if self._kv_cache_type is not None:
            kwargs["type_k"] = kwargs["type_v"] = _ggml_type(self._kv_cache_type)
        if self._flash_attn is not None:
            kwargs["flash_attn"] = self._flash_attn
        unquantized = {_ggml_type(name) for name in _UNQUANTIZED_KV}
        if kwargs.get("type_v") is not None and kwargs["type_v"] not in unquantized:
            kwargs["flash_attn"] = True  # llama.cpp needs it for a quantized V cache
        threads = self._n_threads or physical_cores()
        kwargs["n_threads"] = threads
        kwargs["n_threads_batch"] = threads
        return kwargs

    def _load_error(self, path: Path, exc: BaseException) -> EdgeCloudError:
        """A damaged file is the model's fault; anything else is the runtime's."""
        try:
            read_gguf_spec(path)
        except ModelIntegrityError as integrity:
            return integrity
        return BackendUnavailableError(f"llama.cpp could not load {path}: {exc}")

    def _warm_fixed_prefix(self) -> None:
        """Evaluate the template's fixed prefix now, so the first question reuses it."""
        if not self.reuse_prefix:
            return
        prefix = self._template.fixed_prefix_tokens(self._tokenize) if self._template else []
        if len(prefix) < 2:
            return
        self._forget_context()
        self._llm.eval(prefix)
        self._kv.save(pinned=True)

    def _probe_rows(self, limit: int) -> Probe:
        """How many rows one pass may verify with every row's logits bitwise equal to decoding
        the same tokens one at a time, and ``(rows, seconds)`` of the passes timed.

        llama.cpp's CPU kernels switch to matrix-matrix paths with other rounding from a few rows
        on, and (measured on an AVX2 CPU) the attention of two rows already rounds differently
        once the context holds about 250 tokens, so the rows are checked right after the fixed
        prefix and again after :data:`~edgecloud.edge.speculation.PROBE_LONG_CONTEXT` tokens. The
        answer is kept on disk per model, runtime, threads and CPU (the long probe costs a
        prefill), and the context is left as it was."""
        from ..store.cache import known_sha256

        assert self.model_path is not None
        key = "|".join([known_sha256(self.model_path), self._lib.__version__, str(self.llama_kwargs.get("n_threads")),
                        str(self.llama_kwargs.get("flash_attn")), str(self.llama_kwargs.get("type_k")),
                        str(limit), cpu_signature()])

        def measure() -> Probe:
            exact, timed = self._rows_exact_at(self._llm.n_tokens, limit)
            if exact > 1 and self.n_ctx > PROBE_LONG_CONTEXT + 2 * limit:
                llm = self._llm
                start = llm.n_tokens
                filler = self._tokenize(PROBE_FILLER) * 64
                try:
                    llm.eval(filler[: max(0, PROBE_LONG_CONTEXT - start)])
                    long_exact, _ = self._rows_exact_at(llm.n_tokens, exact)
                finally:
                    _cut(llm, start)
                exact = min(exact, long_exact)
            return exact, timed

        return remembered_probe(key, measure)

    def _rows_exact_at(self, start: int, limit: int) -> tuple[int, list[tuple[int, float]]]:
        """The most rows (up to ``limit``) one pass evaluates after position ``start`` with logits
        bitwise those of one row at a time, and the timed passes; the context is cut back to ``start``."""
        llm, lib = self._llm, self._lib
        probe = (self._tokenize(PROBE_TEXT) * 2)[:limit]
        if start + len(probe) >= self.n_ctx:
            return 1, []
        shape = (self._n_vocab,)
        single, timed = [], []
        exact = 1
        try:
            for token in probe:
                began = time.perf_counter()
                llm.eval([token])
                timed.append((1, time.perf_counter() - began))
                single.append(np.ctypeslib.as_array(lib.llama_get_logits_ith(llm.ctx, -1), shape=shape).copy())
            for rows in range(2, len(probe) + 1):
                _cut(llm, start)
                began = time.perf_counter()
                _eval_rows(llm, probe[:rows])
                timed.append((rows, time.perf_counter() - began))
                if not all(np.array_equal(np.ctypeslib.as_array(lib.llama_get_logits_ith(llm.ctx, i), shape=shape),
                                          single[i]) for i in range(rows)):
                    break
                exact = rows
        finally:
            _cut(llm, start)
        return exact, timed

    # ------------------------------------------------------------------ tokens and KV

    def _tokenize(self, text: str) -> list[int]:
        return self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def _encode_chat(
        self, messages: list[dict[str, Any]], *, continue_final: bool = False, tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        assert self._template is not None
        return self._tokenize(self._template.prompt(messages, continue_final=continue_final, tools=tools))

    def _piece(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = token_piece(self._lib, self._vocab, token)
        return piece

    def _forget_context(self) -> None:
        self._kv.forget()

    def _prefill(self, prompt: list[int], session: str | None = None) -> int:
        """Make the context hold ``prompt`` with logits for its last token; return reused count
        (from the live context, the RAM tier or the disk tier, whichever holds the most)."""
        llm = self._llm
        reuse = 0
        if self.reuse_prefix:
            reuse = self._kv.reuse(prompt, session)
            # At least one prompt token is evaluated: its logits pick the first answer token.
            reuse = min(reuse, len(prompt) - 1)
        if reuse <= 0 or not llm._ctx.kv_cache_seq_rm(0, reuse, -1):
            reuse = 0
            self._forget_context()
        llm.n_tokens = reuse
        llm.eval(prompt[reuse:])
        return reuse

    def _schedule_prefetch(self, history: list[dict[str, str]], session: str | None = None) -> None:
        """After an answer: evaluate the next user turn's header while the user reads and types,
        then queue the context for the disk tier (a ``session``'s always).

        Runs on a worker thread once the stream has released the context, and only when no
        other request started within :data:`PREFETCH_GRACE_S`; so a chat's n-th turn costs
        the same prefill as its first (just the user's text and the assistant header).
        """
        if not self.reuse_prefix:
            return
        self._unsaved = (session,)
        with self._prefetch_wake:
            self._prefetch_job = (self._started, history, session)
            self._prefetch_wake.notify_all()
        if self._prefetch_thread is None:
            self._prefetch_thread = threading.Thread(
                target=self._prefetch_worker, name="llamacpp-prefetch", daemon=True
            )
            self._prefetch_thread.start()

    def _prefetch_worker(self) -> None:
        while True:
            with self._prefetch_wake:
                while self._prefetch_job is None and not self._closed:
                    self._prefetch_wake.wait()
                if self._closed:
                    return
                # give a follow-up request the chance to arrive first
                self._prefetch_wake.wait(PREFETCH_GRACE_S)
                job, self._prefetch_job = self._prefetch_job, None
            if job is None:
                continue
            started, history, session = job
            with self._lock:
                if self._closed or self._llm is None or started != self._started:
                    continue
                try:
                    self._extend_context(history)
                except Exception:  # noqa: BLE001 - an optimisation; the next request re-evaluates
                    self._forget_context()
                    continue
                self._kv.persist(session)
                self._unsaved = None

    def _extend_context(self, history: list[dict[str, str]]) -> None:
        assert self._template is not None
        try:
            target = self._template.next_turn_prefix_tokens(self._tokenize, history)
        except EdgeCloudError:
            return
        llm = self._llm
        keep = common_prefix_len_np(llm.input_ids[: llm.n_tokens], np.asarray(target, dtype=np.intc))
        todo = len(target) - keep
        if todo <= 0 or todo > PREFETCH_MAX_TOKENS or len(target) >= self.n_ctx:
            return
        if not llm._ctx.kv_cache_seq_rm(0, keep, -1):
            return
        llm.n_tokens = keep
        llm.eval(target[keep:])
        self.stats.prefetched_tokens += todo

    # ------------------------------------------------------------------ drafting and scoring

    def tokenize_text(self, text: str) -> list[int]:
        """``text`` as this model's token ids (special tokens parsed, no BOS added)."""
        with self._serving():
            self._ensure_loaded()
            return self._tokenize(text)

    def _loaded_vocab(self) -> Any:
        """The vocabulary, loading the model first if need be. Reading it needs no lock (it never
        changes once loaded), so a caller may ask while it holds an open :meth:`greedy` stream."""
        if self._llm is None:
            with self._serving():
                self._ensure_loaded()
        return self._vocab

    def token_bytes(self, token: int) -> bytes:
        """The bytes ``token`` stands for in an answer (control tokens as nothing)."""
        self._loaded_vocab()
        return self._piece(token)

    def is_end(self, token: int) -> bool:
        """Whether ``token`` ends generation (end of turn / end of text)."""
        return bool(self._lib.llama_vocab_is_eog(self._loaded_vocab(), token))

    def draft(self, tokens: list[int], k: int, picker: Picker | None = None, *, until_below: float = 0.0,
              at_least: int = 1) -> list[int]:
        """The next ``k`` tokens after ``tokens`` (fewer when one ends generation; it is included):
        greedy, or ``picker``'s picks; ``until_below``: the draft also ends after a token whose
        probability (the model's, of its own pick) is below this, once it holds ``at_least``. The
        context keeps ``tokens`` and the draft, so the next call that shares a prefix with them
        evaluates only what is new."""
        if k < 1:
            raise ConfigError(f"k must be >= 1, got {k}")
        out: list[int] = []
        for token, probability in self.greedy(tokens, k, picker):
            out.append(token)
            if len(out) >= k or (probability < until_below and len(out) >= at_least):
                break
        return out

    def greedy(self, tokens: list[int], limit: int, picker: Picker | None = None) -> Iterator[tuple[int, float]]:
        """The continuation of ``tokens``, one ``(token, probability)`` at a time (the model's
        probability of its own choice: how sure it is): greedy, or ``picker``'s pick at each
        position (a coupled draw, a grammar-held pick). At most ``limit`` tokens, ending with an end-of-generation token when one
        comes. The runtime is held while the iterator is open; the context keeps what was
        decoded, so a later call sharing the prefix evaluates only what is new."""
        if limit < 1:
            raise ConfigError(f"limit must be >= 1, got {limit}")
        with self._serving():
            llm = self._ensure_loaded()
            check_token_ids(tokens, self._n_vocab, self.n_ctx - 1)
            self._started += 1
            self._prefill(tokens)
            ctx, lib, n_vocab = llm.ctx, self._lib, self._n_vocab
            room = min(limit, self.n_ctx - len(tokens))
            for n in range(1, room + 1):
                logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
                token = int(logits.argmax()) if picker is None else picker.pick(logits, len(tokens) + n - 1)
                yield token, math.exp(float(logits[token]) - log_partition(logits))
                if n == room or lib.llama_vocab_is_eog(self._vocab, token):
                    return
                llm.eval([token])

    def score(self, tokens: list[int], *, start: int, top_n: int = 1, coupling: Coupling | None = None,
              grammar: HeldGrammar | None = None) -> tuple[list[TokenScore], TokenScore]:
        """How this model scores ``tokens[start:]`` given what precedes each, in one forward pass
        over the new positions, and its next token after all of them (greedy, or the pick:
        ``coupling``'s draw, held to ``grammar``; with the picks at every position).

        Returns one :class:`~edgecloud.runtime.scoring.TokenScore` per scored position (the
        token's logprob and the ``top_n`` best alternatives) and the score of the token that
        would follow. ``tokens[:start]`` reuses the context's KV where it can (the prefix
        cache), so scoring a growing answer costs only its new tokens.
        """
        if not 1 <= start <= len(tokens):
            raise ConfigError(f"start must be in 1..{len(tokens)}, got {start}")
        with self._serving():
            llm = self._ensure_loaded()
            check_token_ids(tokens, self._n_vocab, self.n_ctx - 1)
            self._started += 1
            held = held_picker(self._grammar_mask, grammar, coupling, tokens, start)
            self._prefill(tokens[:start])
            ctx, lib, n_vocab = llm.ctx, self._lib, self._n_vocab
            scores: list[TokenScore] = []
            pending = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
            rest = tokens[start:]
            for first in range(0, len(rest), max(1, llm.n_batch)):  # scored a batch at a time (bounded memory)
                batch = rest[first: first + llm.n_batch]
                _eval_rows(llm, batch)
                rows = [pending] + [np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, row), shape=(n_vocab,))
                                    for row in range(len(batch) - 1)]
                done, last = score_rows(rows, tokens, start + first, top_n, coupling, held)
                scores += [*done, last]
                pending = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, len(batch) - 1), shape=(n_vocab,)).copy()
            return scores, score_rows([pending], tokens, len(tokens), top_n, coupling, held)[1]

    def _grammar_mask(self, params: SamplingParams) -> GrammarMask:
        """A grammar state for ``params.grammar`` over this model's vocabulary."""
        return GrammarMask(self._lib, self._vocab, self._n_vocab, params)

    def hold(self, grammar: HeldGrammar, coupling: Coupling | None = None) -> HeldPicker:
        """A picker held to ``grammar`` from the answer's start (verified mode's drafts under a
        tool-call or JSON grammar: fork it to draft ahead)."""
        with self._serving():
            self._ensure_loaded()
            return HeldPicker(self._grammar_mask(grammar.params()), coupling)

    # ------------------------------------------------------------------ sampling

    def _make_sampler(self, params: SamplingParams) -> Any:
        """A llama.cpp sampler chain, or None for plain greedy (argmax in numpy)."""
        return make_sampler(self._lib, self._vocab, self._n_vocab, params)

    # ------------------------------------------------------------------ the stream

    def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        """Yield the answer as OpenAI-shaped chunks; closing the iterator stops generation."""
        return self._generate(request)

    def _generate(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        with self._serving():
            llm = self._ensure_loaded()
            self._started += 1
            messages = request.message_dicts()
            prompt = self._encode_chat(messages, continue_final=request.continue_final_message, tools=request.tool_dicts())
            max_new = answer_budget(len(prompt), self.n_ctx, request.max_tokens)
            sampler = self._make_sampler(sampling_params(request, max_new, logit_bias=True, grammar=True))
            try:
                yield from self._decode(llm, request, messages, prompt, max_new, sampler)
            except (GeneratorExit, EdgeCloudError):
                raise
            except Exception as exc:
                self._forget_context()
                raise BackendError(f"llama.cpp failed while generating: {exc}", cause="runtime_error") from exc
            finally:
                if sampler is not None:
                    sampler.close()

    def _decode(
        self,
        llm: Any,
        request: ChatRequest,
        messages: list[dict[str, str]],
        prompt: list[int],
        max_new: int,
        sampler: Any,
    ) -> Iterator[ChatCompletionChunk]:
        lib, vocab, ctx, n_vocab = self._lib, self._vocab, llm.ctx, self._n_vocab
        want_logits = sampler is None or request.logprobs
        cached = self._prefill(prompt, request.prompt_cache_key)
        stats = self.stats
        stats.started(len(prompt), cached)
        route = RouteInfo(target="edge", backend=self.name, reason=f"on device ({self.device}) with llama.cpp")
        answer = AnswerChunks(request, self.model_name, route, self._piece, lambda t: lib.llama_vocab_is_eog(vocab, t),
                              stats, stream_calls=True)
        yield answer.start()

        def choose(row: int) -> tuple[int, Any]:
            """The token for batch row ``row`` (-1: the last), with its logits when they are needed."""
            logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, row), shape=(n_vocab,)) if want_logits else None
            return (int(logits.argmax()) if sampler is None else sampler.sample(llm._ctx, row)), logits

        spec = self.speculator if self.speculator is not None and self.speculator.disabled is None else None
        state: SpecState | None = spec.state() if spec is not None else None
        pending = choose(-1)
        written = list(prompt)  # the context the guesses continue: the prompt, then every emitted token
        while True:
            token, logits = pending
            written.append(token)
            yield from answer.push(token, logits)
            if answer.done or answer.generated >= max_new:
                break
            guess: list[int] = []
            if spec is not None and state is not None:
                # room for the token, the guess and the token after it, within max_tokens and the context
                cap = min(max_new - answer.generated - 1, self.n_ctx - llm.n_tokens - 2)
                proposer, guess = spec.propose(state, written, cap)
            started = time.perf_counter()
            if not guess:
                llm.eval([token])
                if spec is not None:
                    spec.observe(1, time.perf_counter() - started)
                pending = choose(-1)
                continue
            n_past = llm.n_tokens
            _eval_rows(llm, [token, *guess])
            assert spec is not None and state is not None
            spec.observe(len(guess) + 1, time.perf_counter() - started)
            accepted = 0
            for row in range(len(guess) + 1):
                pending = choose(row)
                if row == len(guess) or pending[0] != guess[row]:
                    break
                accepted += 1  # the model writes the guessed token itself: emit it
                written.append(pending[0])
                yield from answer.push(*pending)
                if answer.done or answer.generated >= max_new:
                    break
            spec.record(state, proposer, len(guess), accepted)
            _cut(llm, n_past + 1 + accepted)  # the token, then the accepted part of the guess
            if answer.done or answer.generated >= max_new:
                break
        finish = list(answer.finish(len(prompt), cached, speculative=spec_usage(state)))
        # queued now, run once this stream has released the context
        if request.continue_final_message:  # the answer extends the last (assistant) message
            history = [*messages[:-1], {"role": "assistant", "content": messages[-1]["content"] + answer.text}]
        else:
            history = [*messages, {"role": "assistant", "content": answer.text}]
        self._schedule_prefetch(history, request.prompt_cache_key)
        yield from finish


def _eval_rows(llm: Any, tokens: list[int]) -> None:
    """Evaluate ``tokens`` after the context in one ``llama_decode`` with logits for every row
    (row ``i``: the distribution after ``tokens[i]``); the context then holds them."""
    n_past = llm.n_tokens
    llm._batch.set_batch(batch=tokens, n_past=n_past, logits_all=True)
    llm._ctx.decode(llm._batch)
    llm.input_ids[n_past: n_past + len(tokens)] = tokens
    llm.n_tokens += len(tokens)


def _cut(llm: Any, n: int) -> None:
    """Drop the context's positions from ``n`` on (KV cells and token record)."""
    llm._ctx.kv_cache_seq_rm(0, n, -1)
    llm.n_tokens = n
