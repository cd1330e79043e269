"""What requests cost, and what running them on the device saved.

This module owns :class:`CostModel`, which turns token counts and device seconds into a
:class:`~edgecloud.types.CostInfo` at the configured :class:`~edgecloud.config.Prices`, and
:class:`CostTotals`, the client's thread-safe running sums.

Pricing rules:

* cloud tokens cost ``cloud_input_per_mtok`` / ``cloud_output_per_mtok`` per million;
* the edge costs ``edge_per_second`` per second of device time, whatever it generated;
* ``cloud_equivalent_usd`` is what the request's whole ``usage`` would have cost on the cloud,
  and ``saved_usd = cloud_equivalent_usd - usd`` (negative when the device is the dearer side).

A request that fell back mid-stream ran partly on each side: price each side's share with
:meth:`CostModel.price_part` and add the shares with :meth:`CostModel.combine`, or price it at
once with :meth:`CostModel.price` giving both the device seconds and the cloud's tokens.
Dollar amounts are rounded to 1e-9 USD (a nano-dollar, far below one token's price) so that
sums compare exactly instead of carrying float noise such as ``0.30000000000000004``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from ..config import Prices
from ..types import CostInfo, Usage

__all__ = ["CostModel", "CostTotals"]

Target = Literal["edge", "cloud"]
_TARGETS = ("edge", "cloud")
_USD_DIGITS = 9


def _usd(value: float) -> float:
    return round(value, _USD_DIGITS)


def _check_target(target: str) -> None:
    if target not in _TARGETS:
        raise ValueError(f"target must be 'edge' or 'cloud', got {target!r}")


class CostModel:
    """Prices requests at fixed :class:`~edgecloud.config.Prices`."""

    def __init__(self, prices: Prices | None = None) -> None:
        self.prices = prices if prices is not None else Prices()

    def cloud_usd(self, input_tokens: int, output_tokens: int) -> float:
        """What these tokens cost on the cloud."""
        p = self.prices
        return _usd((input_tokens * p.cloud_input_per_mtok + output_tokens * p.cloud_output_per_mtok) / 1e6)

    def _info(self, usd: float, equivalent: float, edge_seconds: float, cloud_in: int, cloud_out: int) -> CostInfo:
        return CostInfo(
            usd=_usd(usd),
            cloud_equivalent_usd=_usd(equivalent),
            saved_usd=_usd(equivalent - usd),
            edge_seconds=edge_seconds,
            cloud_input_tokens=cloud_in,
            cloud_output_tokens=cloud_out,
        )

    def price(
        self,
        target: Target,
        usage: Usage,
        *,
        edge_seconds: float = 0.0,
        cloud_input_tokens: int | None = None,
        cloud_output_tokens: int | None = None,
    ) -> CostInfo:
        """One whole request that finished on ``target``.

        The cloud's tokens default to all of ``usage`` when ``target`` is ``"cloud"`` and to
        none when it is ``"edge"``; give them (and ``edge_seconds``) for a request that ran on
        both sides. ``cloud_equivalent_usd`` always prices all of ``usage``.
        """
        _check_target(target)
        on_cloud = target == "cloud"
        cloud_in = cloud_input_tokens if cloud_input_tokens is not None else (usage.prompt_tokens if on_cloud else 0)
        cloud_out = (
            cloud_output_tokens if cloud_output_tokens is not None else (usage.completion_tokens if on_cloud else 0)
        )
        usd = self.cloud_usd(cloud_in, cloud_out) + edge_seconds * self.prices.edge_per_second
        equivalent = self.cloud_usd(usage.prompt_tokens, usage.completion_tokens)
        return self._info(usd, equivalent, edge_seconds, cloud_in, cloud_out)

    def price_part(self, target: Target, prompt_tokens: int, completion_tokens: int, seconds: float = 0.0) -> CostInfo:
        """One backend's share of a request: cloud tokens on the cloud, ``seconds`` of device time on the edge."""
        _check_target(target)
        equivalent = self.cloud_usd(prompt_tokens, completion_tokens)
        if target == "cloud":
            return self._info(equivalent, equivalent, 0.0, prompt_tokens, completion_tokens)
        return self._info(seconds * self.prices.edge_per_second, equivalent, seconds, 0, 0)

    def combine(self, parts: Iterable[CostInfo], usage: Usage | None = None) -> CostInfo:
        """The shares of one request added up.

        With ``usage`` (the request's total), ``cloud_equivalent_usd`` prices it; without,
        it is the sum of the parts' equivalents, which counts the prompt once per part
        (a continuation re-reads the prompt), so pass ``usage`` when you have it.
        """
        parts = list(parts)
        usd = sum(p.usd for p in parts)
        if usage is not None:
            equivalent = self.cloud_usd(usage.prompt_tokens, usage.completion_tokens)
        else:
            equivalent = sum(p.cloud_equivalent_usd for p in parts)
        return self._info(
            usd,
            equivalent,
            sum(p.edge_seconds for p in parts),
            sum(p.cloud_input_tokens for p in parts),
            sum(p.cloud_output_tokens for p in parts),
        )


@dataclass
class _Sums:
    requests: int = 0
    edge_requests: int = 0
    cloud_requests: int = 0
    fallbacks: int = 0
    cost_usd: float = 0.0
    cloud_equivalent_usd: float = 0.0
    saved_usd: float = 0.0
    edge_seconds: float = 0.0
    cloud_input_tokens: int = 0
    cloud_output_tokens: int = 0
    #: Answer tokens written by each side (collaborative answers split; others by where they ran).
    edge_answer_tokens: int = 0
    cloud_answer_tokens: int = 0


class CostTotals:
    """Running sums over a client's requests; safe to :meth:`add` from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums = _Sums()

    def add(self, cost: CostInfo, target: str, fallbacks: int = 0, tokens: dict[str, int] | None = None) -> None:
        """Count one finished request that ended on ``target`` after ``fallbacks`` switches;
        ``tokens``: answer tokens each side wrote (``route.tokens``)."""
        _check_target(target)
        with self._lock:
            s = self._sums
            s.requests += 1
            if target == "edge":
                s.edge_requests += 1
            else:
                s.cloud_requests += 1
            s.fallbacks += fallbacks
            s.cost_usd += cost.usd
            s.cloud_equivalent_usd += cost.cloud_equivalent_usd
            s.saved_usd += cost.saved_usd
            s.edge_seconds += cost.edge_seconds
            s.cloud_input_tokens += cost.cloud_input_tokens
            s.cloud_output_tokens += cost.cloud_output_tokens
            if tokens:
                s.edge_answer_tokens += tokens.get("edge", 0)
                s.cloud_answer_tokens += tokens.get("cloud", 0)

    def snapshot(self) -> dict[str, Any]:
        """The sums so far, plus ``saved_pct`` (saving as a percentage of the cloud equivalent)."""
        with self._lock:
            out: dict[str, Any] = asdict(self._sums)
        for key in ("cost_usd", "cloud_equivalent_usd", "saved_usd"):
            out[key] = _usd(out[key])
        equivalent = out["cloud_equivalent_usd"]
        out["saved_pct"] = round(100.0 * out["saved_usd"] / equivalent, 6) if equivalent > 0 else 0.0
        written = out["edge_answer_tokens"] + out["cloud_answer_tokens"]
        out["cloud_token_share"] = round(out["cloud_answer_tokens"] / written, 6) if written else 0.0
        return out

    def reset(self) -> None:
        """Start counting from zero."""
        with self._lock:
            self._sums = _Sums()
