"""The parts of verified mode's rounds: the edge's drafted line, a check in flight, a check's cost.

This module owns what :mod:`.verified` builds its rounds from: :class:`DraftLine` (the edge's
greedy line past the written answer, drafted on while checks are out), :class:`Flight` (one check
sent, its answer to come), :class:`Opening` (the cloud's own first tokens, streamed by id while
the edge drafts), :class:`RoundCost` (what a check costs on the user's clock, fitted
over an answer's checks), :func:`shares_cpu` (whether a cloud computes on this process's CPUs, so
the sides take turns), and :class:`EdgeFailed` (the edge's own failure, handed to the failover).
"""

from __future__ import annotations

import ipaddress
import queue
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ..backend import Drafter, GeneratedTokens, close_stream
from ..fallback import Attempt
from ..runtime.coupling import Picker
from ..runtime.hardware import cpu_budget
from ..runtime.scoring import Scored, TokenSession
from ..runtime.speculative import expected_tokens

__all__ = ["DraftLine", "EdgeFailed", "Flight", "Opening", "RoundCost", "edge_stream", "on_edge", "shares_cpu"]

T = TypeVar("T")


class EdgeFailed(Exception):
    """The edge runtime failed mid-answer (``error``): the cloud finishes the answer."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def on_edge(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return call(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the edge's own failure, handed to the failover
        raise EdgeFailed(exc) from exc


def edge_stream(tokens: Iterator[tuple[int, float]]) -> Iterator[tuple[int, float]]:
    try:
        yield from tokens
    except Exception as exc:  # noqa: BLE001 - the edge's own failure, handed to the failover
        raise EdgeFailed(exc) from exc


class Opening:
    """The cloud's first tokens of an answer (``tokens``, streamed by id), read on a worker of
    ``pool`` while the edge drafts: :meth:`next` waits for the next token; None once the stream
    ended, its failure raised."""

    def __init__(self, attempt: Attempt, tokens: GeneratedTokens, pool: Executor) -> None:
        self.attempt, self.tokens, self.started = attempt, tokens, time.perf_counter()
        self._arrived: queue.SimpleQueue[int | BaseException | None] = queue.SimpleQueue()
        self.delivered = 0
        pool.submit(self._read)

    def _read(self) -> None:
        try:
            for token in self.tokens:
                self._arrived.put(token)
            self._arrived.put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the answer's thread
            self._arrived.put(exc)

    def ready(self) -> bool:
        """Whether :meth:`next` would answer at once."""
        return not self._arrived.empty()

    def next(self) -> int | None:
        item = self._arrived.get()
        if isinstance(item, BaseException):
            raise item
        self.delivered += item is not None
        return item

    def abort(self) -> None:
        """Stop reading (the server stops generating)."""
        self.tokens.close()


@dataclass
class Flight:
    """One check sent: ``block`` drafted after the context it was sent with, its answer to come."""

    attempt: Attempt
    block: list[int]
    future: Future[Scored]
    started: float
    #: Tokens of context before the block.
    at: int
    #: The session view the check was sent in (a check sent ahead has its own: :meth:`TokenSession.ahead`).
    session: TokenSession

    @property
    def ahead(self) -> bool:
        """Whether it was sent before the check ahead of it landed (on the bet that one is kept whole)."""
        return not self.session.resend

    @property
    def known(self) -> int:
        """Leading tokens of the block already written when it lands: a check sent ahead starts with
        the token it bet the cloud would write after the check before it."""
        return 1 if self.ahead else 0

    def drop(self) -> None:
        """Nobody will read this check's answer (it is dropped when it lands): its breaker trial is given back."""
        self.future.cancel()
        self.attempt.breaker.release()


class RoundCost:
    """What one check costs on the user's clock as the line ``fixed + per_token * tokens``, fitted
    by decayed least squares over the checks of this answer (prior: ``fixed`` 0.1 s, 10 ms a token).
    A server computes a batch of drafted tokens at a cost that grows with the batch (on a CPU,
    almost as fast as decoding them one by one), so the block a check carries is chosen by it."""

    def __init__(self, decay: float = 0.85) -> None:
        self.decay = decay
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        for tokens in (2, 8):  # the prior, as two checks
            self.observe(tokens, 0.1 + 0.01 * tokens)

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self._n, self._x, self._y = d * self._n + 1, d * self._x + tokens, d * self._y + seconds
        self._xx, self._xy = d * self._xx + tokens * tokens, d * self._xy + tokens * seconds

    def line(self) -> tuple[float, float]:
        """``(fixed, per_token)`` seconds, neither below zero."""
        mean_x, mean_y = self._x / self._n, self._y / self._n
        var = self._xx / self._n - mean_x * mean_x
        slope = (self._xy / self._n - mean_x * mean_y) / var if var > 1e-9 else 0.0
        slope = max(0.0, slope)
        return max(0.0, mean_y - slope * mean_x), slope

    def block(self, alpha: float, k_min: int, k_max: int) -> int:
        """The block size with the most tokens per second of checks while the edge drafts during
        them; of those within 5 % of the best, the longest (fewer checks, fewer passes, at little
        cost to the user's clock)."""
        fixed, per_token = self.line()
        rates = {k: expected_tokens(alpha, k) / max(1e-6, fixed + (k + 1) * per_token) for k in range(k_min, k_max + 1)}
        best = max(rates.values())
        return max(k for k, rate in rates.items() if rate >= 0.95 * best)


def _loopback(url: str) -> bool:
    host = (urlsplit(url).hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def shares_cpu(url: str) -> bool:
    """Whether a cloud at ``url`` computes on this process's CPUs: it is on this machine (a
    loopback address) and this process may use every CPU (not pinned to some of them, as an app
    and its server on separate cores are). Two llama.cpp processes computing at once on the same
    cores slow each other far more than twofold (their threads wait for each other at every
    operation), so pipelined rounds then keep the edge idle while a check is computed."""
    if not _loopback(url):
        return False
    budget = cpu_budget()
    return budget.allowed >= budget.logical


class DraftLine:
    """The edge's line after the written answer (``context``): ``tokens`` drafted ahead (greedy,
    or the picks of a picker from ``picker()``), one open stream on the edge while the line goes
    on unbroken."""

    def __init__(self, edge: Drafter, context: list[int], picker: Callable[[], Picker | None] = lambda: None) -> None:
        self.edge, self.context, self.picker = edge, list(context), picker
        self.tokens: list[int] = []
        #: The edge's probability of each of ``tokens`` (its own pick): how sure it is of them.
        self.sure: list[float] = []
        self.ended = False  # the line reached an end-of-answer token
        self.seconds = 0.0
        self._stream: Iterator[tuple[int, float]] | None = None

    def extend(self, limit: int, stop: Callable[[], bool] = lambda: False) -> None:
        """Draft on until the line holds ``limit`` tokens, ends, or ``stop()`` says so."""
        started = time.perf_counter()
        while len(self.tokens) < limit and not self.ended and not stop():
            if self._stream is None:
                room = (self.edge.n_ctx or 0) - len(self.context) - len(self.tokens) - 1
                if room < 1:
                    self.ended = True
                    break
                self._stream = edge_stream(self.edge.greedy(self.context + self.tokens, room, self.picker()))
            token = next(self._stream, None)
            if token is None:  # the stream reached the context's end
                self._stream = None
                self.ended = True
                break
            self.tokens.append(token[0])
            self.sure.append(token[1])
            self.ended = self.edge.is_end(token[0])
        self.seconds += time.perf_counter() - started

    def advance(self, written: list[int]) -> bool:
        """``written`` joined the answer: the line goes on where it already holds them, else it is
        drafted again from the new context. Whether it went on."""
        self.context += written
        if self.tokens[:len(written)] == written:
            del self.tokens[:len(written)], self.sure[:len(written)]
            return True
        self.close()
        self.tokens, self.sure, self.ended = [], [], False
        return False

    def close(self) -> None:
        if self._stream is not None:
            close_stream(self._stream)
            self._stream = None
