"""What one cloud endpoint can do beyond plain chat, learned while it is used.

This module owns :class:`Capabilities`: per endpoint and model, whether it accepts each of the
extensions edgecloud's collaboration relies on (:data:`CAPABILITIES`). Nothing is assumed up
front: an extension is tried where it is wanted, and the endpoint's first refusal — a 4xx that
the same request without the extension does not get, or a missing endpoint — is remembered for
the client's life, with the endpoint's words (:meth:`Capabilities.refuse`). Later answers then
go straight to the next mode that does without it; no request fails because edgecloud asked for
an extension. What an endpoint showed it can do is remembered too (:meth:`Capabilities.allow`).

``client.stats()["clouds"]`` and ``edgecloud plan --cloud-base-url`` show the table.

The extensions:

* ``score`` - scores a given continuation: ``POST /v1/completions`` with token ids, ``echo`` and
  ``logprobs`` (``edgecloud serve``, vLLM; hosted chat APIs answer 404);
* ``token_ids`` - names tokens by id in scoring answers, with the edge model's vocabulary (the
  same tokenizer): what checked and verified mode send and read;
* ``sessions`` - holds a token session, so a check sends only what the endpoint has not seen
  (``edgecloud serve``; vLLM re-reads the whole context every check);
* ``coupling`` - picks each checked position's token with the shared-noise sampler
  (:mod:`edgecloud.runtime.coupling`), so a sampled answer (``temperature`` above 0) is verified
  exactly (``edgecloud serve``; vLLM ignores the fields and answers without picks);
* ``grammar`` - holds each checked position's pick to a GBNF grammar (:mod:`edgecloud.runtime.held`),
  so tool calls and ``json_schema`` answers are verified too (``edgecloud serve``);
* ``tokenize`` - says which prompt token ids it evaluates for a conversation (``POST /tokenize``
  with ``messages`` and ``tools``: ``edgecloud serve``, vLLM), so verified mode drafts for the
  cloud's own rendering of the prompt where the two chat templates differ;
* ``stream_ids`` - streams its greedy continuation of token ids with the ids it generates
  (``return_token_ids``: ``edgecloud serve``, vLLM), so the cloud can open a verified answer
  at its own pace (:mod:`edgecloud.remote.opening`);
* ``continue`` - continues a partial assistant message (``continue_final_message``: vLLM,
  ``edgecloud serve``; hosted chat APIs answer 400);
* ``logprobs``, ``tools``, ``json_schema`` - the chat request's own fields of those names.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Literal, get_args

__all__ = ["CAPABILITIES", "Capabilities", "Capability"]

Capability = Literal["score", "token_ids", "sessions", "coupling", "grammar", "tokenize", "stream_ids", "continue",
                     "logprobs", "tools", "json_schema"]
CAPABILITIES: tuple[str, ...] = get_args(Capability)


class Capabilities:
    """What ``endpoint`` (serving ``model``) was seen to accept or refuse (see the module docstring).

    Safe to share between threads. Unknown is not refused: :meth:`may` says True until the
    endpoint has refused.
    """

    def __init__(self, endpoint: str, model: str, prober: Callable[[Capability], None] | None = None) -> None:
        self.endpoint, self.model = endpoint, model
        #: Learns one capability with a cheap request (calls :meth:`allow` or :meth:`refuse`).
        self.prober = prober
        self._known: dict[str, bool] = {}
        self._why: dict[str, str] = {}
        self._lock = threading.Lock()
        self._probing = threading.Lock()

    def _check(self, name: str) -> None:
        if name not in CAPABILITIES:
            raise ValueError(f"unknown capability {name!r}; use one of {', '.join(CAPABILITIES)}")

    def known(self, name: Capability) -> bool | None:
        """True (seen to work), False (refused) or None (not tried yet)."""
        self._check(name)
        return self._known.get(name)

    def may(self, name: Capability) -> bool:
        """Whether asking for ``name`` is worth a try: not refused so far."""
        return self.known(name) is not False

    def find(self, name: Capability) -> bool:
        """Whether the endpoint takes ``name``, probed with one cheap request when not known yet (and
        a prober exists; an outage during the probe leaves it unknown: worth a try)."""
        if self.known(name) is None and self.prober is not None:
            with self._probing:
                if self.known(name) is None:
                    try:
                        self.prober(name)
                    except Exception:  # noqa: BLE001 - an outage is not a refusal; the real request will say
                        pass
        return self.may(name)

    def why(self, name: Capability) -> str:
        """The endpoint's words when it refused ``name`` ('' otherwise)."""
        return self._why.get(name, "")

    def allow(self, name: Capability) -> None:
        """``name`` worked (a refusal seen earlier stands: endpoints do not learn new tricks mid-life)."""
        self._check(name)
        with self._lock:
            self._known.setdefault(name, True)

    def refuse(self, name: Capability, why: str) -> None:
        """The endpoint refused ``name``; ``why`` in its words (kept for the route notes and stats)."""
        self._check(name)
        with self._lock:
            self._known[name] = False
            self._why[name] = why

    def table(self) -> dict[str, bool | None]:
        """Every capability: True, False or None (not tried yet)."""
        return {name: self._known.get(name) for name in CAPABILITIES}

    def snapshot(self) -> dict[str, object]:
        """What ``client.stats()`` shows: the endpoint, the model, the table, and why each refusal."""
        return {"endpoint": self.endpoint, "model": self.model, "capabilities": self.table(),
                "refused": dict(self._why)}

    def __repr__(self) -> str:
        return f"Capabilities({self.endpoint!r}, {self.model!r}, {self.table()!r})"
