"""Personal data in prompts: detection, and redaction that can be undone in the answer.

Detected kinds: ``email``, ``phone`` (international or national formats, 8-15 digits),
``card`` (13-19 digits that pass the Luhn check), ``iban`` (country code + check digits that
pass the ISO 13616 mod-97 test), ``ssn`` (US social security numbers), ``uk_nino``
(UK national insurance numbers) and ``national_id`` (labelled id numbers such as
"passport no. X1234567"). Checksums keep order numbers and dates from being flagged.

:func:`redact` replaces each finding with a placeholder such as ``[EMAIL_1]`` (the same value
gets the same placeholder everywhere) and returns a :class:`Redaction` whose
:meth:`~Redaction.restore` puts the originals back into the cloud's answer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Finding", "Redaction", "StreamingRestore", "find_pii", "has_pii", "luhn_ok", "iban_ok", "redact"]

_EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b")
_CARD = re.compile(r"(?<![\d-])(?:\d[ -]?){12,18}\d(?![\d-])")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}\b")
_SSN = re.compile(r"\b(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}\b")
_NINO = re.compile(r"\b(?![DFIQUV])[A-Z](?![DFIQUVO])[A-Z] ?\d{2} ?\d{2} ?\d{2} ?[A-D]\b")
_PHONE = re.compile(r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{2,4}(?:[ .-]\d{2,4}){1,4}(?![\w-])"
                    r"|(?<![\w+])\+\d{8,15}\b")
_NATIONAL = re.compile(r"\b(?:passport|national id|id card|personalausweis|dni|nie|aadhaar|tax id|"
                       r"steuer-?id|bsn|sin)(?: ?(?:no\.?|number|nr\.?|#))?[:\s]+([A-Z0-9][A-Z0-9 -]{5,18}[A-Z0-9])",
                       re.IGNORECASE)
_DATE_LIKE = re.compile(r"^\d{4}-\d{2}-\d{2}$|^\d{2}[./-]\d{2}[./-]\d{2,4}$|^\d{1,3}(?:\.\d{1,3}){3}$")


@dataclass(frozen=True)
class Finding:
    """One piece of personal data: its kind, the text, and where it is."""

    kind: str
    value: str
    start: int
    end: int


def luhn_ok(digits: str) -> bool:
    """The Luhn checksum used by payment card numbers."""
    nums = [int(c) for c in digits if c.isdigit()]
    if len(nums) < 13:
        return False
    total = 0
    for i, d in enumerate(reversed(nums)):
        if i % 2:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def iban_ok(text: str) -> bool:
    """The ISO 13616 mod-97 check of an IBAN."""
    s = text.replace(" ", "").upper()
    if not re.fullmatch(r"[A-Z]{2}\d{2}[A-Z0-9]{11,30}", s):
        return False
    moved = s[4:] + s[:4]
    return int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


def _candidates(text: str) -> Iterable[Finding]:
    for m in _EMAIL.finditer(text):
        yield Finding("email", m.group(), m.start(), m.end())
    for m in _IBAN.finditer(text):
        if iban_ok(m.group()):
            yield Finding("iban", m.group(), m.start(), m.end())
    for m in _CARD.finditer(text):
        if luhn_ok(m.group()):
            yield Finding("card", m.group(), m.start(), m.end())
    for m in _SSN.finditer(text):
        yield Finding("ssn", m.group(), m.start(), m.end())
    for m in _NINO.finditer(text):
        yield Finding("uk_nino", m.group(), m.start(), m.end())
    for m in _NATIONAL.finditer(text):
        if sum(c.isdigit() for c in m.group(1)) >= 4:
            yield Finding("national_id", m.group(1), m.start(1), m.end(1))
    for m in _PHONE.finditer(text):
        value = m.group()
        digits = sum(c.isdigit() for c in value)
        if 8 <= digits <= 15 and not _DATE_LIKE.match(value) and (value.startswith("+") or not value.isdigit()):
            yield Finding("phone", value, m.start(), m.end())


def find_pii(text: str) -> list[Finding]:
    """Non-overlapping findings in ``text``, in order (checksum-verified kinds win overlaps)."""
    rank = {"email": 0, "iban": 1, "card": 2, "ssn": 3, "uk_nino": 4, "national_id": 5, "phone": 6}
    chosen: list[Finding] = []
    for f in sorted(_candidates(text), key=lambda f: (rank[f.kind], f.start)):
        if all(f.end <= c.start or f.start >= c.end for c in chosen):
            chosen.append(f)
    return sorted(chosen, key=lambda f: f.start)


def has_pii(texts: str | Iterable[str]) -> list[str]:
    """The kinds of personal data found in one text or several (empty when none)."""
    items = [texts] if isinstance(texts, str) else list(texts)
    return sorted({f.kind for t in items for f in find_pii(t)})


@dataclass
class Redaction:
    """Placeholder -> original value, to put the originals back into an answer."""

    mapping: dict[str, str] = field(default_factory=dict)

    def restore(self, text: str) -> str:
        if not self.mapping:
            return text
        pattern = re.compile("|".join(re.escape(k) for k in sorted(self.mapping, key=len, reverse=True)))
        return pattern.sub(lambda m: self.mapping[m.group()], text)


class StreamingRestore:
    """Put originals back into a streamed answer: text that may be the start of a placeholder
    is held back until it is complete (or clearly not one), so a placeholder split across
    chunks is still restored and nothing is emitted twice."""

    def __init__(self, redaction: Redaction) -> None:
        self.redaction = redaction
        self._held = ""
        self._longest = max((len(k) for k in redaction.mapping), default=0)

    def push(self, delta: str) -> str:
        """Restored text that is safe to emit now."""
        text = self._held + delta
        cut = text.rfind("[")
        if cut >= 0 and len(text) - cut < self._longest and "]" not in text[cut:]:
            tail = text[cut:]
            if any(k.startswith(tail) for k in self.redaction.mapping):
                self._held = tail
                return self.redaction.restore(text[:cut])
        self._held = ""
        return self.redaction.restore(text)

    def flush(self) -> str:
        """Whatever is still held (an unfinished placeholder-like tail) at the end of the stream."""
        held, self._held = self._held, ""
        return self.redaction.restore(held)


def redact(texts: list[str], redaction: Redaction | None = None) -> tuple[list[str], Redaction]:
    """Replace personal data in each text by placeholders; one value keeps one placeholder."""
    redaction = redaction or Redaction()
    by_value = {v: k for k, v in redaction.mapping.items()}
    counters: dict[str, int] = {}
    for placeholder in redaction.mapping:
        kind = placeholder[1:].rsplit("_", 1)[0]
        counters[kind] = counters.get(kind, 0) + 1
    out = []
    for text in texts:
        parts, pos = [], 0
        for f in find_pii(text):
            if f.value not in by_value:
                kind = f.kind.upper()
                counters[kind] = counters.get(kind, 0) + 1
                placeholder = f"[{kind}_{counters[kind]}]"
                by_value[f.value] = placeholder
                redaction.mapping[placeholder] = f.value
            parts += [text[pos:f.start], by_value[f.value]]
            pos = f.end
        parts.append(text[pos:])
        out.append("".join(parts))
    return out, redaction
