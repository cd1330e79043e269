"""Token sessions: the server holds an answer's token ids so each round sends only what is new.

This module owns :class:`SessionStore`. A collaborating client (the edge drafting, the cloud
verifying or writing spans) sends ``/v1/completions`` requests whose prompt is token ids and
whose ``session`` is ``{"id": ..., "base": n}``: "these tokens follow the first ``n`` tokens you
hold for session ``id``". The store keeps each session's token ids (a few KB; the KV itself stays
in the engine's slots, whose prefix reuse finds it), so a round's effective prompt is the held
prefix plus the new tokens, and the client never re-sends (nor pays again for) what the server
has seen. A session the store no longer holds, or holds fewer than ``base`` tokens of, is a 409
(``session_expired``): the client sends its whole context again and the answer is unchanged.

One session's requests run one at a time, in the order they arrived (:meth:`SessionStore.turn`):
a client may send its next check before the last one is answered (two checks in flight), and the
later one then continues from what the earlier one left held (or is refused: 409, when the earlier
one kept fewer tokens than it assumed).

Bounded: at most ``max_sessions`` (least recently used first out) and ``ttl_s`` seconds idle.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from ..errors import SessionExpiredError
from ..runtime.completions import SessionRef

__all__ = ["DEFAULT_MAX_SESSIONS", "DEFAULT_SESSION_TTL_S", "SessionStore"]

DEFAULT_MAX_SESSIONS = 4096
DEFAULT_SESSION_TTL_S = 900.0


class SessionStore:
    """Token ids per session id, least recently used out (thread-safe)."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS, ttl_s: float = DEFAULT_SESSION_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_sessions, self.ttl_s, self._clock = max_sessions, ttl_s, clock
        self._held: OrderedDict[str, tuple[float, list[int]]] = OrderedDict()
        self._lock = threading.Lock()
        #: Per session with a request running or waiting: its turn lock and how many hold or wait for it.
        self._turns: dict[str, tuple[asyncio.Lock, int]] = {}

    @asynccontextmanager
    async def turn(self, session_id: str) -> AsyncIterator[None]:
        """Run the body when the earlier requests of ``session_id`` (by arrival) have finished
        (call from the server's event loop; the locks live only while requests wait for them)."""
        lock, waiting = self._turns.get(session_id, (asyncio.Lock(), 0))
        self._turns[session_id] = (lock, waiting + 1)
        try:
            async with lock:
                yield
        finally:
            lock, waiting = self._turns[session_id]
            if waiting == 1:
                del self._turns[session_id]
            else:
                self._turns[session_id] = (lock, waiting - 1)

    def resolve(self, ref: SessionRef, new: list[int]) -> list[int]:
        """The effective prompt: the first ``ref.base`` held tokens, then ``new``."""
        if ref.base == 0:
            return list(new)
        with self._lock:
            self._expire()
            held = self._held.get(ref.id)
            have = len(held[1]) if held is not None else 0
            if held is None or have < ref.base:
                raise SessionExpiredError(
                    f"session {ref.id!r} holds {have} tokens here, not the {ref.base} this request continues "
                    f"({'it expired or was never opened' if held is None else 'fewer than sent before'}); "
                    "send the whole context with session.base 0")
            self._held.move_to_end(ref.id)
            return held[1][: ref.base] + list(new)

    def hold(self, session_id: str, tokens: list[int]) -> None:
        """Keep ``tokens`` as what ``session_id`` holds now."""
        with self._lock:
            self._held[session_id] = (self._clock(), list(tokens))
            self._held.move_to_end(session_id)
            while len(self._held) > self.max_sessions:
                self._held.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._held)

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        while self._held:
            sid, (at, _) = next(iter(self._held.items()))
            if at >= cutoff:
                return
            del self._held[sid]
