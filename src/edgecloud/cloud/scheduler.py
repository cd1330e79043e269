"""Continuous batching for the torch engine: sequences join and leave the batch at every token.

This module owns :class:`Scheduler`, :class:`SamplingParams` and :class:`Sequence` (one
request's handle: iterate it, sync or async, for its token ids; ``cancel()`` it).

One background thread owns the model. Each step it

1. admits waiting sequences while the running batch has room (``max_batch``), giving each a
   KV cache that starts with the longest prefix found in the prefix cache;
2. builds one flattened batch: a single token for every decoding sequence, plus a chunk of
   prompt for sequences still prefilling (at most ``max_prefill_tokens`` per step, so a
   long prompt never stalls the others for more than one chunk);
3. runs :meth:`~edgecloud.engine.Transformer.forward_batch` once (one matmul per
   layer for all rows; attention per sequence against its own cache);
4. samples each sequence's next token with its own parameters and generator, delivers it,
   and retires sequences that hit an end-of-generation token, their ``max_new_tokens``,
   or were cancelled. A retired sequence's KV goes to the prefix cache.

The waiting queue is bounded: :meth:`Scheduler.submit` raises
:class:`~edgecloud.errors.RateLimitedError` (HTTP 429, with a ``retry_after`` estimate) when it
is full, instead of letting latency grow without bound.

**Prefix cache.** Agents resend the same long prefix (system prompt, tools, the conversation
so far) turn after turn. A finished sequence's KV (prompt + answer) is kept in a byte-bounded
LRU (:class:`~edgecloud.runtime.prefix_cache.PrefixCache`); a new prompt sharing at least
``min_prefix`` tokens with an entry copies that prefix into its cache and prefills only the
rest. Copying (rather than sharing) keeps every sequence's cache private and costs a memory
copy of the prefix, far less than recomputing it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np
import torch

from ..runtime.prefix_cache import PrefixCache, SavedPrefix
from ..runtime.sampling import SamplingParams
from ..errors import BackendError, BackendUnavailableError, ContextOverflowError, InvalidRequestError, RateLimitedError
from ..observability.server_metrics import ServerMetrics
from ..engine import KVCache, Transformer, sample
from .speculative import Planned, SpecState, Speculator

__all__ = ["SamplingParams", "Scheduler", "Sequence"]

logger = logging.getLogger("edgecloud.scheduler")

DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_PREFILL_TOKENS = 512
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30
#: Shorter shared prefixes are recomputed: the copy and the lookup would cost about as much.
DEFAULT_MIN_PREFIX = 16
#: A new cache holds the prompt plus this many answer positions, then doubles as needed.
_INITIAL_ANSWER_ROOM = 256


class _End:
    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class Sequence:
    """One request in the scheduler. Iterate it (``for`` or ``async for``, matching how it was
    submitted) for its generated token ids; ``finish_reason`` is set when the iteration ends.
    """

    def __init__(
        self, seq_id: int, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop | None
    ) -> None:
        self.id = seq_id
        self.prompt = prompt
        self.params = params
        self.output: list[int] = []
        #: Prompt tokens whose KV came from the prefix cache.
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.arrival = time.perf_counter()
        self.last_token_at = 0.0
        self.cache: KVCache | None = None
        #: Speculation controller while running; its summary (the usage's ``speculative`` block) once finished.
        self.spec: SpecState | None = None
        self.spec_summary: dict[str, Any] | None = None
        self._cancelled = threading.Event()
        self._loop = loop
        self._sync_events: queue.SimpleQueue[Any] | None = None if loop else queue.SimpleQueue()
        self._async_events: asyncio.Queue[Any] | None = asyncio.Queue() if loop else None
        self._generator: torch.Generator | None = None
        if params.seed is not None:
            self._generator = torch.Generator().manual_seed(params.seed)
        self._scheduler: Scheduler | None = None

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._cancelled.is_set()

    @property
    def prefilling(self) -> bool:
        """Whether prompt tokens are still to be scored."""
        return self.cache is None or self.cache.length < len(self.prompt)

    def cancel(self) -> None:
        """Stop generating; the scheduler frees this sequence's KV at its next step. Safe to repeat."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            if self._scheduler is not None:
                self._scheduler._wake()

    def _emit(self, event: Any) -> None:
        if self._loop is not None:
            assert self._async_events is not None
            try:
                self._loop.call_soon_threadsafe(self._async_events.put_nowait, event)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening
                self._cancelled.set()
        else:
            assert self._sync_events is not None
            self._sync_events.put(event)

    def _handle(self, event: Any) -> int | None:
        if isinstance(event, _End):
            self.finish_reason = event.reason
            return None
        if isinstance(event, BaseException):
            raise event
        return int(event)

    def __iter__(self) -> Iterator[int]:
        if self._sync_events is None:
            raise TypeError("this sequence was submitted with an event loop; iterate it with 'async for'")
        while (token := self._handle(self._sync_events.get())) is not None:
            yield token

    async def __aiter__(self) -> AsyncIterator[int]:
        if self._async_events is None:
            raise TypeError("this sequence was submitted without an event loop; iterate it with 'for'")
        while (token := self._handle(await self._async_events.get())) is not None:
            yield token


class Scheduler:
    """Runs many sequences through one :class:`~edgecloud.engine.Transformer` at once."""

    def __init__(
        self,
        model: Transformer,
        *,
        eog_ids: Seq[int] = (),
        max_batch: int = DEFAULT_MAX_BATCH,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        min_prefix: int = DEFAULT_MIN_PREFIX,
        max_context: int | None = None,
        metrics: ServerMetrics | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be at least 1, got {max_prefill_tokens}")
        self.model = model
        self.eog_ids = frozenset(eog_ids)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_prefill_tokens = max_prefill_tokens
        self.min_prefix = max(1, min_prefix)
        self.max_context = max_context or model.args.context_length
        self.metrics = metrics
        #: Speculative decoding (None: plain decoding); owned by the scheduler thread once running.
        self.speculator = speculator
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._cond = threading.Condition()
        self._closed = False
        self._ids = itertools.count(1)
        #: Steps run and rows they carried (for benchmarks and logs).
        self.steps = 0
        self.rows = 0
        #: Engine failures survived (a sequence or a step) or not (the loop), and why the loop died.
        self.failures = 0
        self.failure: str | None = None
        self._step_seconds = 0.05  # running mean, for Retry-After estimates
        self._thread = threading.Thread(target=self._run, name="edgecloud-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public

    @property
    def num_running(self) -> int:
        """Sequences in the running batch."""
        return len(self._running)

    @property
    def alive(self) -> bool:
        """True while the loop runs and takes requests (False once closed or dead)."""
        return self._thread.is_alive() and not self._closed

    @property
    def num_waiting(self) -> int:
        """Sequences queued for a batch slot."""
        return len(self._waiting)

    def submit(
        self, prompt: Seq[int], params: SamplingParams, *, loop: asyncio.AbstractEventLoop | None = None
    ) -> Sequence:
        """Queue ``prompt`` for generation; iterate the returned :class:`Sequence` for its tokens.

        Pass the running ``loop`` to consume it with ``async for``. Raises
        :class:`~edgecloud.errors.RateLimitedError` when the waiting queue is full and
        :class:`~edgecloud.errors.ContextOverflowError` when prompt + ``max_new_tokens``
        exceed the context.
        """
        if not prompt:
            raise InvalidRequestError("the prompt has no tokens", param="messages")
        if len(prompt) + params.max_new_tokens > self.max_context:
            raise ContextOverflowError(
                len(prompt), self.max_context, detail=f" and {params.max_new_tokens} max_tokens were requested"
            )
        seq = Sequence(next(self._ids), list(prompt), params, loop)
        seq._scheduler = self
        with self._cond:
            if self._closed:
                raise BackendUnavailableError("the scheduler is shut down; the server is stopping")
            # Capacity is the batch plus the queue: a waiting sequence takes the next free slot.
            if len(self._waiting) + len(self._running) >= self.max_batch + self.max_queue:
                raise RateLimitedError(
                    f"the server is at capacity ({len(self._running)} running, {len(self._waiting)} waiting, "
                    f"queue limit {self.max_queue}); retry later",
                    retry_after=self._retry_after(),
                )
            self._waiting.append(seq)
            self._publish_queue()
            self._cond.notify()
        return seq

    def close(self) -> None:
        """Stop the loop; sequences still queued or running end with BackendUnavailableError."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the loop

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _publish_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue(len(self._running), len(self._waiting))

    def _retry_after(self) -> float:
        """Seconds until a slot is likely free: one average answer's worth of steps, at least 1 s."""
        tokens = np.mean([s.params.max_new_tokens - len(s.output) for s in self._running]) if self._running else 64
        return max(1.0, round(float(tokens) * self._step_seconds, 1))

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while self._next_step():
                    pass
        except BaseException as exc:
            logger.exception("scheduler loop failed")
            self.failure = f"the engine's scheduler failed: {type(exc).__name__}: {exc}"
            self._on_failure("scheduler")
            self._fail_all(BackendError(self.failure, cause="runtime_error"))
            if not isinstance(exc, Exception):
                raise
            return  # recorded in ``failure``; the backend starts a new loop (TorchEngineBackend.health)
        self._fail_all(BackendUnavailableError("the server is shutting down; the request was not finished"))
        if self.speculator is not None:
            self.speculator.close()

    def _next_step(self) -> bool:
        with self._cond:
            self._publish_queue()
            while not self._closed and not self._waiting and not self._running:
                self._cond.wait()
            if self._closed:
                return False
            for seq in [s for s in self._waiting if s.cancelled]:
                self._waiting.remove(seq)
                self._finish(seq, "cancelled")
            # Into the batch under the lock, so submit() never sees a sequence in neither list.
            admitted = []
            while self._waiting and len(self._running) < self.max_batch:
                admitted.append(self._waiting.popleft())
                self._running.append(admitted[-1])
        for seq in admitted:
            try:
                self._admit(seq)
            except Exception as exc:  # this sequence fails alone
                logger.exception("admitting sequence %d failed", seq.id)
                self._on_failure("sequence")
                self._retire(seq, "error", BackendError(
                    f"the torch engine could not start this request: {type(exc).__name__}: {exc}", cause="runtime_error"))
        for seq in [s for s in self._running if s.cancelled]:
            self._retire(seq, "cancelled")
        with self._cond:
            self._publish_queue()
        if self._running:
            self._step()
        return True

    def _admit(self, seq: Sequence) -> None:
        entry, shared = self.prefix_cache.best_match(seq.prompt)
        # A full-prompt hit still re-scores the last prompt token: its logits give the first answer token.
        shared = min(shared, len(seq.prompt) - 1)
        capacity = min(len(seq.prompt) + min(seq.params.max_new_tokens, _INITIAL_ANSWER_ROOM), self.max_context)
        try:
            seq.cache = self.model.new_cache(capacity)
        except RuntimeError as exc:  # out of memory
            error = BackendError(f"could not allocate a KV cache of {capacity} positions: {exc}", cause="out_of_memory")
            self._retire(seq, "error", error)
            return
        if entry is not None and shared >= self.min_prefix:
            state: KVCache = entry.state
            seq.cache.k[:, :shared] = state.k[:, :shared]
            seq.cache.v[:, :shared] = state.v[:, :shared]
            seq.cache.length = shared
            seq.cached_tokens = shared
            self.prefix_cache.touch(entry)
        if self.speculator is not None:
            seq.spec = self.speculator.admit(seq.id, seq.params.spec_mode, seq.params.spec_k_max)
        if self.metrics is not None:
            self.metrics.on_admitted(len(seq.prompt), seq.cached_tokens)

    def _ensure_room(self, seq: Sequence, needed: int) -> None:
        cache = seq.cache
        assert cache is not None
        if needed <= cache.max_tokens:
            return
        grown = self.model.new_cache(min(max(needed, 2 * cache.max_tokens), self.max_context))
        grown.k[:, : cache.length] = cache.k[:, : cache.length]
        grown.v[:, : cache.length] = cache.v[:, : cache.length]
        grown.length = cache.length
        seq.cache = grown

    def _step(self) -> None:
        batch: list[Sequence] = []
        chunks: list[list[int]] = []
        budget = self.max_prefill_tokens
        for seq in self._running:
            assert seq.cache is not None
            if seq.prefilling:
                if budget <= 0:
                    continue
                start = seq.cache.length
                chunk = seq.prompt[start : start + budget]
                budget -= len(chunk)
            else:
                chunk = [seq.output[-1]]
            batch.append(seq)
            chunks.append(chunk)
        prefill = any(seq.prefilling for seq in batch)
        planned = self._draft(batch, sum(len(c) for c in chunks)) if self.speculator is not None else {}
        inputs: list[tuple[torch.Tensor, None, KVCache]] = []
        keep: list[int] = []
        for seq, chunk in zip(batch, chunks):
            assert seq.cache is not None
            plan = planned.get(seq.id)
            if plan is not None:
                chunk = chunk + plan.proposal.tokens
            self._ensure_room(seq, seq.cache.length + len(chunk))
            inputs.append((torch.tensor(chunk, dtype=torch.long), None, seq.cache))
            keep.append(len(chunk) if plan is not None else 1)
        started = time.perf_counter()
        try:
            logits = self.model.forward_batch(inputs, keep=keep)
        except Exception as exc:
            logger.exception("engine step failed")
            self._on_failure("step")
            error = BackendError(f"the torch engine failed while generating: {exc}", cause="runtime_error")
            for seq in batch:
                self._retire(seq, "error", error)
            return
        finished_at = time.perf_counter()
        rows = sum(int(t.shape[0]) for t, _, _ in inputs)
        self.steps += 1
        self.rows += rows
        self._step_seconds = 0.9 * self._step_seconds + 0.1 * (finished_at - started)
        if self.speculator is not None:
            self.speculator.observe_step(rows, finished_at - started, prefill=prefill)
        decoding = sum(1 for seq in batch if not seq.prefilling)
        for seq, row in zip(batch, logits):
            if seq.prefilling or seq.cancelled:
                continue
            try:
                self._advance(seq, row, planned.get(seq.id), rows, decoding, finished_at)
            except Exception as exc:  # this sequence fails alone; the batch goes on
                logger.exception("sequence %d failed", seq.id)
                self._on_failure("sequence")
                if seq in self._running:
                    self._retire(seq, "error", BackendError(
                        f"the torch engine failed on this request: {type(exc).__name__}: {exc}", cause="runtime_error"))

    def _advance(self, seq: Sequence, row: torch.Tensor, plan: Planned | None, rows: int, decoding: int,
                 finished_at: float) -> None:
        """Sample (or verify a draft) from ``row`` and deliver the tokens of one sequence."""
        if plan is None:
            tokens = [sample(row[0], temperature=seq.params.temperature, top_p=seq.params.top_p,
                             generator=seq._generator)]
        else:
            assert self.speculator is not None and seq.cache is not None
            verdict = self.speculator.verify(
                seq.id, plan, row, temperature=seq.params.temperature, top_p=seq.params.top_p,
                generator=seq._generator, rows=rows, batch=decoding,
            )
            # keep the KV of the last delivered token and the accepted drafts; the rest was rejected
            seq.cache.truncate(seq.cache.length - len(plan.proposal.tokens) + verdict.accepted)
            tokens = verdict.tokens
        for token in tokens:
            if not self._deliver(seq, token, finished_at):
                break

    def _draft(self, batch: list[Sequence], rows: int) -> dict[int, Planned]:
        """Drafts for this step's decoding sequences, each capped by its remaining tokens and context."""
        assert self.speculator is not None
        wanted = []
        for seq in batch:
            if seq.prefilling or seq.spec is None or seq.cancelled:
                continue
            assert seq.cache is not None
            # the last draft position must leave room for the bonus token, within max_tokens and the context
            cap = min(seq.params.max_new_tokens - len(seq.output) - 1, self.max_context - seq.cache.length - 2)
            wanted.append((seq.id, seq.prompt + seq.output, seq.params.temperature, seq.params.top_p,
                           seq._generator, cap))
        return self.speculator.draft(wanted, rows) if wanted else {}

    def _deliver(self, seq: Sequence, token: int, at: float) -> bool:
        """Hand ``token`` to the consumer; False when the sequence ended (end of generation, max_tokens)."""
        if seq.params.stop_at_eog and token in self.eog_ids:
            self._retire(seq, "stop")
            return False
        first = not seq.output
        seq.output.append(token)
        if self.metrics is not None:
            self.metrics.on_token(first, at - (seq.arrival if first else seq.last_token_at))
        seq.last_token_at = at
        seq._emit(token)
        if len(seq.output) >= seq.params.max_new_tokens:
            self._retire(seq, "length")
            return False
        return True

    def _retire(self, seq: Sequence, reason: str, error: BaseException | None = None) -> None:
        """Take ``seq`` out of the batch, keep its KV as a prefix, and end its stream."""
        if seq in self._running:
            self._running.remove(seq)
        cache, seq.cache = seq.cache, None
        if cache is not None and error is None and cache.length >= self.min_prefix:
            self._remember(seq, cache)
        self._finish(seq, reason, error)

    def _remember(self, seq: Sequence, cache: KVCache) -> None:
        tokens = np.asarray((seq.prompt + seq.output)[: cache.length], dtype=np.intc)
        if cache.max_tokens > cache.length * 5 // 4:  # trim a mostly empty allocation
            trimmed = KVCache(cache.k[:, : cache.length].clone(), cache.v[:, : cache.length].clone())
            trimmed.length = cache.length
            cache = trimmed
        self.prefix_cache.put(SavedPrefix(tokens=tokens, state=cache, nbytes=cache.nbytes))

    def _finish(self, seq: Sequence, reason: str, error: BaseException | None = None) -> None:
        seq.finish_reason = reason
        if self.speculator is not None:
            state = self.speculator.release(seq.id)
            seq.spec = None
            seq.spec_summary = state.summary() if state is not None else None
        if self.metrics is not None:
            self.metrics.on_finished(reason, time.perf_counter() - seq.arrival)
        seq._emit(error if error is not None else _End(reason))

    def _on_failure(self, scope: str) -> None:
        self.failures += 1
        if self.metrics is not None:
            self.metrics.on_engine_failure(scope)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            self._closed = True
            pending = list(self._waiting) + list(self._running)
            self._waiting.clear()
            self._running.clear()
            self._publish_queue()
        for seq in pending:
            seq.cache = None
            self._finish(seq, "error", error)
