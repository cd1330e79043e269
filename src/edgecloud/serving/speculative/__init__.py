"""Speculative decoding for the cloud engine: proposers, verification, adaptive k and the off switch.

:class:`Speculator` plugs into :class:`~edgecloud.serving.scheduler.Scheduler` (``speculator=``);
proposers are :class:`LlamaDraftProposer` (a small same-vocabulary model on llama.cpp) and
:class:`NgramProposer` (prompt lookup); :func:`verify` keeps greedy output identical and
sampled output distributed exactly as the target's; :class:`SpecState` chooses ``k`` per
sequence and step and switches speculation off (with periodic re-probing) when it does not pay.

Everything but :func:`verify` (and :class:`Verdict`) works without torch, so the llama.cpp
engine speculates with the same controller and proposers (it verifies by sampling each
position with the sequence's own sampler and comparing); those two load torch on first use.
"""

from __future__ import annotations

from ...runtime.spec_control import K_LIMIT, SPEC_MODES, Acceptance, SpecConfig, SpecState, StepCost, expected_tokens, speedup
from .proposers import DraftRequest, LlamaDraftProposer, NgramProposer, Proposal, Proposer
from .speculator import Planned, Speculator

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


def __getattr__(name: str) -> object:
    if name in ("Verdict", "verify"):
        import importlib

        module = importlib.import_module(f"{__name__}.verify")
        # importing the submodule bound the package's name ``verify`` to the module: rebind both names
        globals().update(Verdict=module.Verdict, verify=module.verify)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
