"""Coupled sampling: two models draw tokens with shared noise, so a draft is verified by one comparison.

This module owns :class:`Coupling`, the sampler both sides of verified mode run when a request
samples (``temperature`` above 0), and the serving engine's own sampler for such requests.

The scheme is the Gumbel-max trick with noise shared between the sides. An answer has a 64-bit
seed; the noise for token ``v`` at sequence position ``p`` is a fixed function of
``(seed, p, v)`` (a splitmix64 hash turned into a uniform ``u``, then ``-log(-log(u))``). A model
picks, at position ``p``, the argmax over its kept tokens of ``logit / temperature + noise``.
Whatever the logits, that pick is distributed exactly as a draw from the softmax of the kept,
tempered logits (the Gumbel-max theorem), and the noise at ``p`` is independent of everything
before ``p``. So when the cloud keeps a drafted token exactly where its own pick equals it, every
token of the answer is the cloud's own sampled token: the text has the cloud's distribution, and
is the same text the cloud alone writes with that seed (the serving engine samples with this
scheme too). The edge's picks, made with the same noise, agree with the cloud's wherever the two
distributions are close, which is what keeps acceptance high at any temperature.

Truncation, in this order (as vLLM applies it): ``temperature``; ``top_k`` (the k most likely;
0 or -1: all); ``top_p`` (the smallest most-likely set whose mass reaches ``top_p``, over the
top-k set renormalised; the top token always stays); ``min_p`` (tokens at least ``min_p`` times as
likely as the top token). ``bias`` (``logit_bias``) is added to the logits first. Temperature 0
is the argmax of the biased logits (no noise).

:data:`SCHEME` names the noise function on the wire: a server that answers a check without
naming the same scheme did not sample this way, and the client treats the check as refused.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ..errors import InvalidRequestError

__all__ = ["SCHEME", "WIRE_FIELDS", "Coupling", "Picker", "gumbel_noise", "new_seed"]

#: The name of the noise function (a version: a different function must get a different name).
SCHEME = "gumbel-splitmix64-v1"
#: The request fields a coupled check may carry (:meth:`Coupling.wire`).
WIRE_FIELDS = ("coupling", "seed", "temperature", "top_p", "top_k", "min_p", "logit_bias")

_MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
#: Candidates looked at first when finding a top-p set (grown eightfold until the mass is reached).
_NUCLEUS_FIRST = 64


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser over an array (uint64 arithmetic wraps, as the hash needs)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _MUL1
    x = x ^ (x >> np.uint64(27))
    x = x * _MUL2
    return x ^ (x >> np.uint64(31))


def _key(seed: int, position: int) -> np.uint64:
    """The hash key of one position of one answer."""
    with np.errstate(over="ignore"):
        pos = _mix(np.array([(position * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _MASK64], dtype=np.uint64))
        return np.uint64(_mix(pos ^ np.uint64(seed & _MASK64))[0])


def gumbel_noise(seed: int, position: int, tokens: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    """Standard Gumbel noise for ``tokens`` (ids) at ``position`` of the answer seeded ``seed``:
    the same numbers on every machine, for every subset of the vocabulary."""
    ids = np.asarray(tokens, dtype=np.uint64)
    with np.errstate(over="ignore"):
        bits = _mix(ids * _GOLDEN + _key(seed, position))
    u = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * (2.0 ** -53)  # in (0, 1), never 0 or 1
    return -np.log(-np.log(u))


class Picker(Protocol):
    """What chooses a side's token from a logits row at a sequence position: a :class:`Coupling`,
    or a grammar-held picker (:class:`edgecloud.runtime.held.HeldPicker`)."""

    def pick(self, logits: npt.NDArray[Any], position: int) -> int:
        """The token at ``position`` (the picker may advance its own state by it)."""
        ...


def new_seed() -> int:
    """A fresh answer seed (when the request names none)."""
    return secrets.randbits(63)


@dataclass(frozen=True)
class Coupling:
    """How one answer samples (see the module docstring): the seed and the truncation."""

    seed: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    #: (token id, bias) pairs added to the logits first (``logit_bias``).
    bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError(f"temperature must be in 0..2, got {self.temperature}", param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 or 0 (all tokens) or positive, got {self.top_k}",
                                      param="top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in 0..1, got {self.min_p}", param="min_p")

    @property
    def greedy(self) -> bool:
        """True when the pick is the argmax (temperature 0): no noise is drawn."""
        return self.temperature == 0.0

    def kept(self, logits: npt.NDArray[Any]) -> tuple[npt.NDArray[np.int64] | None, npt.NDArray[np.float64]]:
        """The token ids the truncation keeps (None: all) and the tempered, biased logits."""
        scaled = np.asarray(logits, dtype=np.float64).copy()
        for token, value in self.bias:
            if 0 <= token < scaled.shape[0]:
                scaled[token] += value
        scaled = np.nan_to_num(scaled, nan=-np.inf, posinf=np.finfo(np.float64).max * 1e-4, neginf=-np.inf)
        scaled /= max(self.temperature, 1e-4)
        n = scaled.shape[0]
        ids: npt.NDArray[np.int64] | None = None
        if 0 < self.top_k < n:
            ids = np.argpartition(-scaled, self.top_k - 1)[:self.top_k].astype(np.int64)
        if self.top_p < 1.0:
            ids = _nucleus(scaled, ids, self.top_p)
        if self.min_p > 0.0:
            pool = ids if ids is not None else np.arange(n, dtype=np.int64)
            top = scaled[pool].max()
            ids = pool[scaled[pool] - top >= np.log(self.min_p)]
        return ids, scaled

    def pick(self, logits: npt.NDArray[Any], position: int) -> int:
        """The token this sampler draws at ``position`` (an index into the whole sequence, prompt
        included) from a logits row: the same token on every machine given the same logits."""
        if self.greedy:
            if not self.bias:
                return int(np.asarray(logits).argmax())
            return int(self.kept(logits)[1].argmax())
        ids, scaled = self.kept(logits)
        if ids is None:
            ids = np.arange(scaled.shape[0], dtype=np.int64)
        race = scaled[ids] + gumbel_noise(self.seed, position, ids)
        return int(ids[int(race.argmax())])

    def wire(self) -> dict[str, Any]:
        """The request fields that ask a server to check with this sampler."""
        body: dict[str, Any] = {"coupling": SCHEME, "seed": self.seed, "temperature": self.temperature,
                                "top_p": self.top_p}
        if self.top_k > 0:
            body["top_k"] = self.top_k
        if self.min_p > 0.0:
            body["min_p"] = self.min_p
        if self.bias:
            body["logit_bias"] = {str(t): v for t, v in self.bias}
        return body


def _nucleus(scaled: npt.NDArray[np.float64], ids: npt.NDArray[np.int64] | None,
             top_p: float) -> npt.NDArray[np.int64]:
    """The most likely tokens of ``ids`` (None: all) whose mass (renormalised over ``ids``)
    reaches ``top_p``: each kept token has less than ``top_p`` of the mass before it, best first,
    ties in id order. Only the leading candidates are sorted (grown until the mass is reached)."""
    pool = ids if ids is not None else np.arange(scaled.shape[0], dtype=np.int64)
    values = scaled[pool]
    top = values.max()
    weights = np.exp(values - top)
    total = weights.sum()
    m = min(_NUCLEUS_FIRST, pool.shape[0])
    while True:
        lead = np.argpartition(-values, m - 1)[:m] if m < pool.shape[0] else np.arange(pool.shape[0])
        order = lead[np.lexsort((pool[lead], -values[lead]))]
        mass = np.cumsum(weights[order]) / total
        keep = (mass - weights[order] / total) < top_p
        if m >= pool.shape[0] or not keep[-1]:
            return pool[order[keep]]
        m = min(pool.shape[0], m * 8)
