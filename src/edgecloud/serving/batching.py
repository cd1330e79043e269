"""Continuous batching, the part every serving engine shares: request handles, the bounded queue, the loop.

This module owns :class:`BatchSequence` (one request's handle: iterate it, sync or async, for
its token ids; ``cancel()`` it) and :class:`BatchScheduler`, the base of the torch engine's
:class:`~edgecloud.serving.scheduler.Scheduler` and the llama.cpp engine's
:class:`~edgecloud.serving.llamacpp_engine.LlamaCppScheduler`. It imports no framework.

What the base does, so an engine only says how to admit a sequence and how to run one step:

- :meth:`BatchScheduler.submit` checks the context, then queues the sequence or, when the
  running batch plus the waiting queue are full, raises
  :class:`~edgecloud.errors.RateLimitedError` (HTTP 429) with a ``retry_after`` estimated from
  the measured step time and the tokens the running sequences still have to make;
- one background thread takes waiting sequences into the batch (under the lock, so
  ``submit`` never sees a sequence in neither list), drops cancelled ones, and calls the
  engine's :meth:`~BatchScheduler._admit` and :meth:`~BatchScheduler._step`;
- :meth:`~BatchScheduler._deliver` hands a token to its consumer (end-of-generation and
  ``max_new_tokens`` end the sequence) and :meth:`~BatchScheduler._retire` ends it, after the
  engine's :meth:`~BatchScheduler._release` has kept or freed its KV;
- an exception in admission or a step fails the sequences concerned, not the loop; if the
  loop itself dies, every open sequence ends with a typed :class:`~edgecloud.errors.BackendError`
  and :attr:`~BatchScheduler.failure` says why (the backend starts a new loop).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Generic, TypeVar

from ..errors import BackendError, BackendUnavailableError, ContextOverflowError, InvalidRequestError, RateLimitedError
from ..observability.server_metrics import ServerMetrics
from ..types import TokenLogprob
from ..runtime.sampling import SamplingParams

__all__ = ["BatchScheduler", "BatchSequence", "DEFAULT_MAX_BATCH", "DEFAULT_MAX_QUEUE", "in_fresh_thread"]

logger = logging.getLogger("edgecloud.scheduler")

DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_QUEUE = 64


T = TypeVar("T")


def in_fresh_thread(work: Callable[[], T]) -> T:
    """``work()`` run in a new thread that ends with it; its result (or its exception).

    Both engines compute with OpenMP (torch's and oneDNN's kernels, llama.cpp's ggml), and
    OpenMP keeps a pool of worker threads per thread that ever opened a parallel region. Loading
    a model opens many; when the serving process's main (or a long-lived worker) thread did the
    loading, its pool stayed, and the scheduler thread's own kernels ran 25-40 % slower on this
    project's 2-core machine (measured: oneDNN's bf16 linear 182 µs from a thread when no other
    thread had used OpenMP, 262 µs from a thread after the main thread had; a llama.cpp batch of
    8 decodes in 93 vs 112 ms per step). A thread that ends takes its pool with it, so engines
    load, and restart, through this.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = work()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="edgecloud-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]  # type: ignore[no-any-return]


class _End:
    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class BatchSequence:
    """One request in a scheduler. Iterate it (``for`` or ``async for``, matching how it was
    submitted) for its generated token ids; ``finish_reason`` is set when the iteration ends.
    """

    def __init__(
        self, seq_id: int, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop | None
    ) -> None:
        self.id = seq_id
        self.prompt = prompt
        self.params = params
        self.output: list[int] = []
        #: Prompt tokens whose KV was reused (a prefix cache, a slot that held them).
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.arrival = time.perf_counter()
        self.last_token_at = 0.0
        #: Speculation summary for the usage's ``speculative`` block, once finished (engines that speculate).
        self.spec_summary: dict[str, Any] | None = None
        #: Alternatives per token for logprobs (None: no logprobs), set by the engine.
        self.top_n: int | None = None
        #: One per delivered token when ``top_n`` is set (appended before the token is handed over).
        self.logprobs: list[TokenLogprob] = []
        self._cancelled = threading.Event()
        self._loop = loop
        self._sync_events: queue.SimpleQueue[Any] | None = None if loop else queue.SimpleQueue()
        self._async_events: asyncio.Queue[Any] | None = asyncio.Queue() if loop else None
        self._scheduler: BatchScheduler[Any] | None = None

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._cancelled.is_set()

    @property
    def prefilling(self) -> bool:
        """Whether prompt tokens are still to be evaluated (the engine's subclass knows)."""
        raise NotImplementedError

    @property
    def remaining(self) -> int:
        """Tokens this sequence may still generate."""
        return self.params.max_new_tokens - len(self.output)

    def cancel(self) -> None:
        """Stop generating; the scheduler frees this sequence's slot at its next step. Safe to repeat."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            if self._scheduler is not None:
                self._scheduler._wake()

    def _emit(self, event: Any) -> None:
        scheduler = self._scheduler
        if scheduler is not None and self._loop is not None and scheduler._outbox is not None:
            scheduler._outbox.append((self, event))  # handed over with the rest of the step's events
            return
        self._send(event)

    def _send(self, event: Any) -> None:
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


S = TypeVar("S", bound=BatchSequence)


class BatchScheduler(ABC, Generic[S]):
    """Runs many sequences through one model at once (the engine implements admission and a step).

    ``max_batch`` sequences run together and up to ``max_queue`` more wait; prompt plus
    ``max_new_tokens`` must fit ``max_context``. Subclasses call :meth:`_start` at the end of
    their ``__init__`` (the loop reads their fields).
    """

    #: What :meth:`submit` makes for a request (the engine's subclass of :class:`BatchSequence`).
    sequence_class: type[BatchSequence] = BatchSequence
    #: Thread name of the loop.
    thread_name = "edgecloud-scheduler"
    #: Longest wait for event loops to run their consumers after a step (see :meth:`_hand_over`).
    handoff_timeout = 0.02

    def __init__(
        self,
        *,
        eog_ids: Seq[int],
        max_batch: int,
        max_queue: int,
        max_context: int,
        metrics: ServerMetrics | None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.eog_ids = frozenset(eog_ids)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_context = max_context
        self.metrics = metrics
        #: Held while a step runs: out-of-band work on the model (a scoring pass) takes it to run
        #: between steps, never beside one.
        self.step_lock = threading.Lock()
        self._waiting: deque[S] = deque()
        self._running: list[S] = []
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
        #: Events of async consumers produced during a step, handed over after it (see :meth:`_hand_over`).
        self._outbox: list[tuple[BatchSequence, Any]] | None = None
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)

    def _start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------------ public

    @property
    def num_running(self) -> int:
        """Sequences in the running batch."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Sequences queued for a batch slot."""
        return len(self._waiting)

    @property
    def alive(self) -> bool:
        """True while the loop runs and takes requests (False once closed or dead)."""
        return self._thread.is_alive() and not self._closed

    def submit(
        self,
        prompt: Seq[int],
        params: SamplingParams,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        setup: Callable[[S], None] | None = None,
    ) -> S:
        """Queue ``prompt`` for generation; iterate the returned sequence for its tokens.

        Pass the running ``loop`` to consume it with ``async for``; ``setup`` is called with the
        new sequence before the loop can see it (an engine attaches per-request state). Raises
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
        seq: S = self.sequence_class(next(self._ids), list(prompt), params, loop)  # type: ignore[assignment]
        seq._scheduler = self
        if setup is not None:
            setup(seq)
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
        if self._thread is not threading.current_thread() and self._thread.is_alive():
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ what an engine implements

    @abstractmethod
    def _admit(self, seq: S) -> None:
        """Give ``seq`` (just taken into the batch) its KV: reuse what a prefix cache or slot holds."""

    @abstractmethod
    def _step(self) -> None:
        """One forward pass for the running batch, then sample and :meth:`_deliver` each sequence's tokens."""

    def _release(self, seq: S, error: BaseException | None) -> None:
        """``seq`` leaves the batch: keep its KV for reuse (``error`` is None) or free it."""

    def _on_stop(self) -> None:
        """The loop ended (closed or dead): release what the engine holds besides the model."""

    def _loop_context(self) -> AbstractContextManager[Any]:
        """A context the whole loop runs in (the torch engine's ``inference_mode``)."""
        return nullcontext()

    # ------------------------------------------------------------------ the loop

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _publish_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue(len(self._running), len(self._waiting))

    def _retry_after(self) -> float:
        """Seconds until a slot is likely free: one average answer's worth of steps, at least 1 s."""
        running = self._running
        tokens = sum(s.remaining for s in running) / len(running) if running else 64
        return max(1.0, round(float(tokens) * self._step_seconds, 1))

    def _observe_step(self, seconds: float, rows: int) -> None:
        if self.metrics is not None:
            self.metrics.on_forward()
        self.steps += 1
        self.rows += rows
        self._step_seconds = 0.9 * self._step_seconds + 0.1 * seconds

    def _run(self) -> None:
        try:
            with self._loop_context():
                while self._next_step():
                    pass
        except BaseException as exc:
            logger.exception("scheduler loop failed")
            self.failure = f"the engine's scheduler failed: {type(exc).__name__}: {exc}"
            self._on_failure("scheduler")
            self._fail_all(BackendError(self.failure, cause="runtime_error"))
            self._on_stop()
            if not isinstance(exc, Exception):
                raise
            return  # recorded in ``failure``; the backend starts a new loop (BatchedEngineBackend.scheduler)
        self._fail_all(BackendUnavailableError("the server is shutting down; the request was not finished"))
        self._on_stop()

    def _has_work(self) -> bool:
        """Whether the loop has anything to do (an engine with out-of-band work adds its own)."""
        return bool(self._waiting or self._running)

    def _between_steps(self) -> None:
        """Out-of-band work the engine runs in the loop thread before admitting (llama.cpp: scoring)."""

    def _next_step(self) -> bool:
        with self._cond:
            self._publish_queue()
            while not self._closed and not self._has_work():
                self._cond.wait()
            if self._closed:
                return False
            for seq in [s for s in self._waiting if s.cancelled]:
                self._waiting.remove(seq)
                self._finish(seq, "cancelled")
        self._between_steps()
        with self._cond:
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
                    f"the engine could not start this request: {type(exc).__name__}: {exc}", cause="runtime_error"))
        for seq in [s for s in self._running if s.cancelled]:
            self._retire(seq, "cancelled")
        with self._cond:
            self._publish_queue()
        if self._running:
            self._outbox = []
            try:
                with self.step_lock:
                    self._step()
            finally:
                outbox, self._outbox = self._outbox, None
                self._hand_over(outbox)
        return True

    def _hand_over(self, events: list[tuple[BatchSequence, Any]]) -> None:
        """Give a step's events to their event loops, one wake-up per loop, and wait (at most
        :attr:`handoff_timeout`) until each loop has run its consumers.

        Why wait: the engine's kernels keep every core busy, and a consumer woken in the middle
        of the next step (building its chunk, writing to its socket) preempts one of the
        kernel's threads, which then holds up every barrier of the step. Measured on this
        project's 2-core machine: the llama.cpp engine's 8 streams ran at 44-64 tokens/s with a
        wake-up per token during the steps, against 86-93 with nobody woken; the consumers'
        own work is well under a millisecond per step, so handing over between steps costs
        almost nothing.
        """
        if not events:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[BatchSequence, Any]]] = {}
        for seq, event in events:
            assert seq._loop is not None
            by_loop.setdefault(seq._loop, []).append((seq, event))
        done: list[threading.Event] = []
        for loop, items in by_loop.items():
            ran = threading.Event()

            def deliver(items: list[tuple[BatchSequence, Any]] = items, ran: threading.Event = ran,
                        loop: asyncio.AbstractEventLoop = loop) -> None:
                for seq, event in items:
                    assert seq._async_events is not None
                    seq._async_events.put_nowait(event)
                loop.call_soon(ran.set)  # after the consumers this woke have run their step

            try:
                loop.call_soon_threadsafe(deliver)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening
                for seq, _ in items:
                    seq._cancelled.set()
                continue
            done.append(ran)
        deadline = time.monotonic() + self.handoff_timeout
        for ran in done:
            ran.wait(max(0.0, deadline - time.monotonic()))

    def _deliver(self, seq: S, token: int, at: float) -> bool:
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

    def _retire(self, seq: S, reason: str, error: BaseException | None = None) -> None:
        """Take ``seq`` out of the batch, let the engine keep or free its KV, and end its stream."""
        if seq in self._running:
            self._running.remove(seq)
        self._release(seq, error)
        self._finish(seq, reason, error)

    def _finish(self, seq: S, reason: str, error: BaseException | None = None) -> None:
        seq.finish_reason = reason
        if self.metrics is not None:
            self.metrics.on_finished(reason, time.perf_counter() - seq.arrival)
        seq._emit(error if error is not None else _End(reason))

    def _fail_step(self, batch: Seq[S], exc: Exception, what: str) -> None:
        """A forward pass failed: every sequence it carried ends with a typed error; the loop goes on."""
        logger.exception("engine step failed")
        self._on_failure("step")
        error = BackendError(f"the {what} failed while generating: {exc}", cause="runtime_error")
        for seq in batch:
            if seq in self._running:
                self._retire(seq, "error", error)

    def _fail_sequence(self, seq: S, exc: Exception, what: str) -> None:
        """One sequence failed after its forward pass (sampling, verification): it ends alone."""
        logger.exception("sequence %d failed", seq.id)
        self._on_failure("sequence")
        if seq in self._running:
            self._retire(seq, "error", BackendError(
                f"the {what} failed on this request: {type(exc).__name__}: {exc}", cause="runtime_error"))

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
            self._release(seq, error)
            self._finish(seq, "error", error)
