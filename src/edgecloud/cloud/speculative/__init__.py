"""Speculative decoding for the cloud engine: proposers, verification, adaptive k and the off switch.

:class:`Speculator` plugs into :class:`~edgecloud.cloud.scheduler.Scheduler` (``speculator=``);
proposers are :class:`LlamaDraftProposer` (a small same-vocabulary model on llama.cpp) and
:class:`NgramProposer` (prompt lookup); :func:`verify` keeps greedy output identical and
sampled output distributed exactly as the target's; :class:`SpecState` chooses ``k`` per
sequence and step and switches speculation off (with periodic re-probing) when it does not pay.
"""

from __future__ import annotations

from .adaptive import K_LIMIT, SPEC_MODES, Acceptance, SpecConfig, SpecState, StepCost, expected_tokens, speedup
from .proposers import DraftRequest, LlamaDraftProposer, NgramProposer, Proposal, Proposer
from .speculator import Planned, Speculator
from .verify import Verdict, verify

__all__ = [
    "K_LIMIT",
    "SPEC_MODES",
    "Acceptance",
    "DraftRequest",
    "LlamaDraftProposer",
    "NgramProposer",
    "Planned",
    "Proposal",
    "Proposer",
    "SpecConfig",
    "SpecState",
    "Speculator",
    "StepCost",
    "Verdict",
    "expected_tokens",
    "speedup",
    "verify",
]
