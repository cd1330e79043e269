"""How one answer is written: by one side, or by both, decided while decoding.

Each way is a :class:`~edgecloud.collab.run.Mode` in one registry, :data:`MODES`:

* ``off`` (:mod:`.plain`) - one side writes the answer, through the one failover;
* ``cascade`` (:mod:`.cascade`) - the edge answers off-stream, a confidence check accepts it or
  the cloud answers instead;
* ``token`` (:mod:`.token`) - the edge streams; where it is unsure the cloud writes a span;
* ``checked`` (:mod:`.verified`) - the edge writes while it is sure; where it is not, it drafts a
  block and the cloud checks it in one forward pass, keeping its own choice there;
* ``verified`` (:mod:`.verified`) - the edge drafts, the cloud verifies every draft in one forward
  pass; the answer is the cloud's greedy answer;
* ``probe`` (:mod:`.probe`) - for a cloud that only chats: the edge's first tokens, unseen, decide
  whether the edge or the cloud writes the whole answer;
* ``lead`` (:mod:`.lead`) - for a cloud that only chats: the cloud writes the answer's first tokens,
  the edge the rest.

:mod:`.gate` says when the edge is unsure; :mod:`.run` holds what the modes share (the
request's :class:`~edgecloud.collab.run.AnswerRun`, the shared-answer base, the span deadline).
:class:`~edgecloud.hybrid.Hybrid` picks a mode per request (``collab`` on the request or in the
settings; ``auto`` is the best mode the sides can run, :func:`.auto.auto_mode`) and runs it. A
new mode is one module with a :func:`~edgecloud.collab.run.register_mode` class, imported here.
"""

from .run import MODES, AnswerRun, Mode, SharedAnswer, register_mode
from .auto import auto_mode
from .cascade import CascadeMode
from .gate import Gate, TokenSignals, signals_of
from .lead import LeadMode
from .plain import PlainMode
from .probe import ProbeMode
from .token import TokenCollab, TokenMode
from .verified import CheckedMode, DraftAndCheck, VerifiedMode, can_score

#: The mode ``collab="auto"`` runs for an answer the edge starts, when the edge drafts token ids
#: and the cloud scores them (llama.cpp on the device, ``edgecloud serve`` or vLLM in the cloud):
#: verified mode, the only one that kept >= 95 % of all-cloud quality held out by task family on
#: the development corpus (benchmarks/hybrid_policy.py; checked mode at trust 0.85 reached 94 %).
AUTO_MODE = VerifiedMode.name
#: What ``auto`` runs where token ids cannot be shared (a redacted conversation, a cloud that continues
#: text but does not score it): the cloud writes text spans where the edge is unsure.
TEXT_MODE = TokenMode.name

__all__ = [
    "AUTO_MODE", "auto_mode", "MODES", "TEXT_MODE", "AnswerRun", "CascadeMode", "CheckedMode", "DraftAndCheck", "Gate", "LeadMode", "Mode",
    "PlainMode", "ProbeMode", "SharedAnswer", "TokenCollab", "TokenMode", "TokenSignals", "VerifiedMode", "register_mode",
    "can_score", "signals_of",
]
