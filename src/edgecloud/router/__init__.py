"""The router: which side answers each request, and why.

``features`` (cheap request features), ``scorers`` (rules baseline and the learned model),
``pii`` (personal data detection and redaction), ``policy`` (hard rules, then score bands),
``cascade`` (edge first, escalate on low confidence), ``tasks`` / ``label`` (measured
outcomes), ``evaluate`` (APGR, CPT, curves) and ``sandbox`` (running model-written code).
"""

from __future__ import annotations
