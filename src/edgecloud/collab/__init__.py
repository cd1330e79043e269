"""How one answer is written: by one side, or by both, decided while decoding.

Each way is a :class:`~edgecloud.collab.run.Mode` in one registry, :data:`MODES`:

* ``off`` (:mod:`.plain`) - one side writes the answer, through the one failover;
* ``cascade`` (:mod:`.cascade`) - the edge answers off-stream, a confidence check accepts it or
  the cloud answers instead;
* ``token`` (:mod:`.token`) - the edge streams; where it is unsure the cloud writes a span;
* ``verified`` (:mod:`.verified`) - the edge drafts, the cloud verifies each draft in one forward
  pass; the answer is the cloud's greedy answer.

:mod:`.gate` says when the edge is unsure; :mod:`.run` holds what the modes share (the
request's :class:`~edgecloud.collab.run.AnswerRun`, the shared-answer base, the span deadline).
:class:`~edgecloud.hybrid.Hybrid` picks a mode per request (``collab`` on the request or in the
settings; ``auto`` is :data:`AUTO_MODE` for every answer that starts on the edge) and runs it. A
new mode is one module with a :func:`~edgecloud.collab.run.register_mode` class, imported here.
"""

from .run import MODES, AnswerRun, Mode, SharedAnswer, register_mode
from .cascade import CascadeMode
from .gate import Gate, TokenSignals, signals_of
from .plain import PlainMode
from .token import TokenCollab, TokenMode
from .verified import VerifiedCollab, VerifiedMode

#: The mode ``collab="auto"`` runs for an answer the edge can start.
AUTO_MODE = TokenMode.name

__all__ = [
    "AUTO_MODE", "MODES", "AnswerRun", "CascadeMode", "Gate", "Mode", "PlainMode", "SharedAnswer", "TokenCollab",
    "TokenMode", "TokenSignals", "VerifiedCollab", "VerifiedMode", "register_mode", "signals_of",
]
