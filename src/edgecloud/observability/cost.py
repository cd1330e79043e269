"""What requests cost, counted both ways a cloud is paid for, against the same answer all-cloud.

This module owns :class:`CostModel`, which turns token counts, forward passes and device
seconds into a :class:`~edgecloud.types.CostInfo` at the configured
:class:`~edgecloud.config.Prices`, :func:`forward_passes` (the pass model), and
:class:`CostTotals`, the client's thread-safe running sums.

Per token (hosted endpoints, internal chargeback):

* the cloud's prompt tokens cost ``cloud_input_per_mtok`` per million, those it read from its
  prefix cache (``usage.prompt_tokens_details.cached_tokens``) ``cloud_cached_input_share`` of
  that (a cloud that reports none is priced as uncached), generated tokens
  ``cloud_output_per_mtok``; every request of an answer counts (spans, verification rounds), and
  a token session's held context (``usage.context_tokens``: not sent) is not billed again;
* the edge costs ``edge_per_second`` per second of device time, whatever it generated;
* ``cloud_equivalent_usd`` is what the answer's own ``usage`` (its prompt, its answer tokens)
  costs on the cloud: the same answer all-cloud; ``saved_usd = cloud_equivalent_usd - usd`` and
  ``vs_all_cloud = usd / cloud_equivalent_usd``.

Per forward pass (a self-hosted GPU, where a pass over a few drafted tokens costs about one
decode step): :func:`forward_passes` counts a request's prompt in chunks of
:data:`PREFILL_CHUNK` tokens (at least one pass), then one decode step per token after the
first; a verification round is one pass. ``all_cloud_passes`` is the same for the answer's own
prompt and tokens, and ``passes_vs_all_cloud`` the ratio. ``edgecloud serve`` counts the real
passes (``edgecloud:forward_passes_total``); the benchmark compares the two.

Parts of one answer are priced with :meth:`CostModel.price_part` and added with
:meth:`CostModel.combine`. Dollar amounts are rounded to 1e-9 USD so that sums compare exactly.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from typing import Any, Literal

from ..config import Prices
from ..types import CostInfo, Usage

__all__ = ["PREFILL_CHUNK", "CostModel", "CostTotals", "forward_passes"]

Target = Literal["edge", "cloud"]
_TARGETS = ("edge", "cloud")
_USD_DIGITS = 9
#: Prompt tokens one prefill pass takes (a serving engine's batch).
PREFILL_CHUNK = 512


def _usd(value: float) -> float:
    return round(value, _USD_DIGITS)


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 6) if b > 0 else None


def _check_target(target: str) -> None:
    if target not in _TARGETS:
        raise ValueError(f"target must be 'edge' or 'cloud', got {target!r}")


def forward_passes(prompt_tokens: int, generated: int) -> int:
    """Forward passes for a request that evaluates ``prompt_tokens`` new prompt tokens and generates
    ``generated`` tokens: the prompt in :data:`PREFILL_CHUNK` chunks (its last pass gives the first
    token), then one decode step per further token. A verification round is ``(k, 1)``: one pass."""
    if prompt_tokens <= 0 and generated <= 0:
        return 0
    prefill = max(1, math.ceil(max(0, prompt_tokens) / PREFILL_CHUNK))
    return prefill + max(0, generated - 1)


class CostModel:
    """Prices requests at fixed :class:`~edgecloud.config.Prices`."""

    def __init__(self, prices: Prices | None = None) -> None:
        self.prices = prices if prices is not None else Prices()

    def cloud_usd(self, input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> float:
        """What these tokens cost on the cloud (``cached_tokens`` of the input read from its cache)."""
        p = self.prices
        cached = min(cached_tokens, input_tokens)
        billed_in = (input_tokens - cached) + cached * p.cloud_cached_input_share
        return _usd((billed_in * p.cloud_input_per_mtok + output_tokens * p.cloud_output_per_mtok) / 1e6)

    def _info(self, usd: float, equivalent: float, edge_seconds: float, cloud_in: int, cloud_out: int,
              **more: Any) -> CostInfo:
        return CostInfo(
            usd=_usd(usd),
            cloud_equivalent_usd=_usd(equivalent),
            saved_usd=_usd(equivalent - usd),
            edge_seconds=edge_seconds,
            cloud_input_tokens=cloud_in,
            cloud_output_tokens=cloud_out,
            vs_all_cloud=_ratio(usd, equivalent),
            **more,
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
        cached = usage.cached_tokens if on_cloud and cloud_input_tokens is None else 0
        usd = self.cloud_usd(cloud_in, cloud_out, cached) + edge_seconds * self.prices.edge_per_second
        equivalent = self.cloud_usd(usage.prompt_tokens, usage.completion_tokens)
        passes = forward_passes(cloud_in - cached, cloud_out) if cloud_in or cloud_out else 0
        all_cloud = forward_passes(usage.prompt_tokens, usage.completion_tokens)
        return self._info(usd, equivalent, edge_seconds, cloud_in, cloud_out, cloud_cached_tokens=cached,
                          all_cloud_input_tokens=usage.prompt_tokens, all_cloud_output_tokens=usage.completion_tokens,
                          cloud_calls=1 if cloud_in or cloud_out else 0, cloud_passes=passes, all_cloud_passes=all_cloud,
                          passes_vs_all_cloud=_ratio(passes, all_cloud))

    def price_part(self, target: Target, prompt_tokens: int, completion_tokens: int, seconds: float = 0.0, *,
                   cached_tokens: int = 0, calls: int = 1, passes: int | None = None) -> CostInfo:
        """One backend's share of a request: cloud tokens (``cached_tokens`` of the prompt read from
        its prefix cache; ``passes``: forward passes, else :func:`forward_passes` of the tokens) on
        the cloud, ``seconds`` of device time on the edge."""
        _check_target(target)
        equivalent = self.cloud_usd(prompt_tokens, completion_tokens)
        if target == "cloud":
            usd = self.cloud_usd(prompt_tokens, completion_tokens, cached_tokens)
            if passes is None:
                passes = forward_passes(prompt_tokens - cached_tokens, completion_tokens)
            return self._info(usd, equivalent, 0.0, prompt_tokens, completion_tokens, cloud_cached_tokens=cached_tokens,
                              cloud_calls=calls, cloud_passes=passes)
        return self._info(seconds * self.prices.edge_per_second, equivalent, seconds, 0, 0)

    def combine(self, parts: Iterable[CostInfo], usage: Usage | None = None) -> CostInfo:
        """The shares of one request added up.

        With ``usage`` (the request's total), ``cloud_equivalent_usd`` prices it and the all-cloud
        passes are its own; without, it is the sum of the parts' equivalents, which counts the
        prompt once per part (a continuation re-reads the prompt), so pass ``usage`` when you have it.
        """
        parts = list(parts)
        usd = sum(p.usd for p in parts)
        if usage is not None:
            equivalent = self.cloud_usd(usage.prompt_tokens, usage.completion_tokens)
            all_cloud = forward_passes(usage.prompt_tokens, usage.completion_tokens)
            all_in, all_out = usage.prompt_tokens, usage.completion_tokens
        else:
            equivalent = sum(p.cloud_equivalent_usd for p in parts)
            all_cloud = sum(p.all_cloud_passes for p in parts)
            all_in, all_out = sum(p.all_cloud_input_tokens for p in parts), sum(p.all_cloud_output_tokens for p in parts)
        passes = sum(p.cloud_passes for p in parts)
        return self._info(
            usd,
            equivalent,
            sum(p.edge_seconds for p in parts),
            sum(p.cloud_input_tokens for p in parts),
            sum(p.cloud_output_tokens for p in parts),
            cloud_cached_tokens=sum(p.cloud_cached_tokens for p in parts),
            cloud_calls=sum(p.cloud_calls for p in parts),
            cloud_passes=passes,
            all_cloud_input_tokens=all_in,
            all_cloud_output_tokens=all_out,
            all_cloud_passes=all_cloud,
            passes_vs_all_cloud=_ratio(passes, all_cloud),
        )


#: The fields of :class:`~edgecloud.types.CostInfo` that add up over requests (the ratios do not).
_SUMMED = ("usd", "cloud_equivalent_usd", "saved_usd", "edge_seconds", "cloud_input_tokens", "cloud_cached_tokens",
           "cloud_output_tokens", "cloud_calls", "cloud_passes", "all_cloud_input_tokens", "all_cloud_output_tokens",
           "all_cloud_passes")
#: Names the totals use for the money fields (``cost_usd`` rather than ``usd``).
_RENAMED = {"usd": "cost_usd"}


def _empty() -> dict[str, float]:
    counts = dict.fromkeys(("requests", "edge_requests", "cloud_requests", "fallbacks", "edge_answer_tokens",
                            "cloud_answer_tokens"), 0)
    return {**counts, **{_RENAMED.get(k, k): 0 for k in _SUMMED}}


class CostTotals:
    """Running sums over a client's requests; safe to :meth:`add` from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums = _empty()

    def add(self, cost: CostInfo, target: str, fallbacks: int = 0, tokens: dict[str, int] | None = None) -> None:
        """Count one finished request that ended on ``target`` after ``fallbacks`` switches;
        ``tokens``: answer tokens each side wrote (``route.tokens``)."""
        _check_target(target)
        values = cost.model_dump(include=set(_SUMMED))
        with self._lock:
            s = self._sums
            s["requests"] += 1
            s["edge_requests" if target == "edge" else "cloud_requests"] += 1
            s["fallbacks"] += fallbacks
            for name, value in values.items():
                s[_RENAMED.get(name, name)] += value
            if tokens:
                s["edge_answer_tokens"] += tokens.get("edge", 0)
                s["cloud_answer_tokens"] += tokens.get("cloud", 0)

    def snapshot(self) -> dict[str, Any]:
        """The sums so far, plus ``saved_pct`` (saving as a percentage of the cloud equivalent),
        ``cost_vs_all_cloud`` and ``passes_vs_all_cloud`` (against the same answers all-cloud)."""
        with self._lock:
            out: dict[str, Any] = dict(self._sums)
        for key in ("cost_usd", "cloud_equivalent_usd", "saved_usd"):
            out[key] = _usd(out[key])
        equivalent = out["cloud_equivalent_usd"]
        out["saved_pct"] = round(100.0 * out["saved_usd"] / equivalent, 6) if equivalent > 0 else 0.0
        out["cost_vs_all_cloud"] = _ratio(out["cost_usd"], equivalent)
        out["passes_vs_all_cloud"] = _ratio(out["cloud_passes"], out["all_cloud_passes"])
        written = out["edge_answer_tokens"] + out["cloud_answer_tokens"]
        out["cloud_token_share"] = round(out["cloud_answer_tokens"] / written, 6) if written else 0.0
        return out

    def reset(self) -> None:
        """Start counting from zero."""
        with self._lock:
            self._sums = _empty()
