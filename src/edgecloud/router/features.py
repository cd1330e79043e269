"""Cheap request features for the router's scorers (well under a millisecond per request).

:func:`extract` turns a request (or a plain list of chat messages) into named numeric
features: sizes (estimated prompt and conversation tokens, requested ``max_tokens``, turn
depth), content markers (code, maths, reasoning, explicit precision), a domain lexicon
(finance, medical, legal, science), the script of the text, and the task's shape (a short
knowledge question, counting across a long context, a code request by signature or doctests,
its number of sentences). :func:`hashed_ngrams` adds
word uni- and bi-grams hashed into a fixed number of buckets (a stable CRC32 hash, so a
trained model means the same thing in every process) for the learned scorer.

Token counts are estimated from characters (about four per token for English and code,
about one per CJK character) so no tokenizer needs to load; pass ``count_tokens`` to use a
real one.
"""

from __future__ import annotations

import math
import re
import zlib
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..types import ChatRequest

__all__ = ["FEATURE_NAMES", "DOMAINS", "estimate_tokens", "extract", "hashed_ngrams", "messages_of"]

# Bounded work per request: features look at the head and tail of very long prompts only.
_SCAN_CHARS = 2_400
#: Hashed n-grams read the last this-many characters of the scanned text (the question sits at the end).
_NGRAM_CHARS = 1_200

DOMAINS: dict[str, tuple[str, ...]] = {
    "finance": ("invest", "portfolio", "interest rate", "dividend", "tax", "loan", "mortgage", "equity", "bond",
                "revenue", "accounting", "balance sheet", "inflation", "stock", "compound"),
    "medical": ("diagnos", "symptom", "dose", "dosage", "patient", "treatment", "disease", "medication", "clinical",
                "prescri", "syndrome", "therapy", "blood", "vaccine", "infection"),
    "legal": ("contract", "lawsuit", "liabilit", "statute", "court", "plaintiff", "defendant", "regulation",
              "gdpr", "copyright", "jurisdiction", "clause", "attorney", "legal", "treaty"),
    "science": ("quantum", "molecule", "theorem", "enzyme", "photosynth", "thermodynamic", "relativity", "protein",
                "isotope", "atomic", "chemical", "physics", "equation", "integral", "derivative"),
}

# Symbols are matched case-sensitively on the raw text; words by set lookup on one lower-cased
# word pass (a dozen case-insensitive alternations cost ~5 ms on a long prompt; this ~0.3 ms).
_CODE_SNIPPETS = ("```", "def ", "class ", "return", "import ", ";\n", "{\n", "}\n", "=>", "#include", "    ")
_MATH_SYMBOLS = re.compile(r"\d\s*[-+*/^%=]\s*\d|%")
_EXAMPLE_SYMBOLS = re.compile(r">>>|==|->")
_BULLETS = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s+", re.MULTILINE)
_DROP_DIGITS = str.maketrans("", "", "0123456789")
_WORDS = re.compile(r"[a-z][a-z'-]*")

_CODE_WORDS = frozenset("python function code implement algorithm bug compile regex class method sql javascript "
                        "refactor api script".split()) | {"unit test"}
_MATH_WORDS = frozenset("calculate compute total percent sum product average solve equation probability integral "
                        "derivative prove km dollars euros".split()) | {"how many", "how much"}
_REASONING_WORDS = frozenset("explain why reason prove compare analyze analyse justify tradeoff tradeoffs trade-off "
                             "trade-offs design plan evaluate derive optimize optimise".split()) | {
    "step by", "edge case", "edge cases"}
_PRECISION_WORDS = frozenset("exact exactly precise precisely accurate accurately verbatim rigorous "
                             "rigorously".split()) | {"decimal place", "decimal places", "significant figures",
                                                     "the cent", "the penny", "be correct"}
_CONSTRAINT_WORDS = frozenset("must should ensure without don't".split()) | {"make sure", "do not"}
_EXAMPLE_WORDS = frozenset({"example", "examples"})
_QUESTION_WORDS = frozenset("what who when where which how is are does do can name".split())
_SHORT_ANSWER = ("briefly", "one word", "in a word", "just the", "only the", "answer with", "single number",
                 "short answer")
_SENTENCE_END = re.compile(r"[.!?](?:\s|$)")
_PROPER_NOUN = re.compile(r"[^.!?\s]\s+[A-Z][a-z]")  # a capitalised word that does not start a sentence
_SIGNATURE = re.compile(r"`\w+\(")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")
_WORD = re.compile(r"[a-z0-9_]+|[^\sa-z0-9_]")  # on lower-cased text


def _count(counts: Counter[str], lower: str, vocab: frozenset[str]) -> int:
    """Occurrences of the vocabulary: single words from the word counts, phrases by substring."""
    return sum(counts[v] if " " not in v else lower.count(v) for v in vocab)


FEATURE_NAMES: tuple[str, ...] = (
    "log_prompt_tokens", "log_conversation_tokens", "log_max_tokens", "turns", "has_system",
    "code_markers", "code_words", "math_markers", "digits", "reasoning_markers", "precision_request",
    "constraints", "examples", "question_form", "lines", "non_ascii", "cjk", "long_prompt",
    *(f"domain_{d}" for d in DOMAINS),
    "short_answer", "sentences", "proper_nouns", "knowledge_question", "aggregation", "doctests", "named_signature",
)


def estimate_tokens(text: str) -> int:
    """Tokens in ``text``, estimated: ~4 characters per token, CJK characters ~1 each."""
    cjk = len(_CJK.findall(text[:_SCAN_CHARS])) * max(1.0, len(text) / max(1, min(len(text), _SCAN_CHARS)))
    return int(math.ceil((len(text) - cjk) / 4 + cjk))


def _scan(text: str) -> str:
    if len(text) <= _SCAN_CHARS:
        return text
    half = _SCAN_CHARS // 2
    return text[:half] + "\n" + text[-half:]


def max_tokens_of(request: Any) -> int | None:
    """The answer budget a ChatRequest or a request dict asks for (None: not said)."""
    if isinstance(request, ChatRequest):
        return request.max_tokens
    return request.get("max_tokens") if isinstance(request, dict) else None


def messages_of(request: Any) -> list[dict[str, str]]:
    """Chat messages from a ChatRequest, a list of message dicts, or a plain prompt string."""
    if isinstance(request, str):
        return [{"role": "user", "content": request}]
    if isinstance(request, ChatRequest):
        # tools, calls and results as the text a model reads: the schemas are part of the
        # prompt's size and of what the answer must get right
        from ..tools.prompt import plain_tool_messages

        messages = request.message_dicts()
        tools = request.tool_dicts()
        if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            return plain_tool_messages(messages, tools)
        return list(messages)
    if isinstance(request, dict):
        if "messages" in request:
            return [{"role": str(m.get("role", "user")), "content": str(m.get("content") or "")}
                    for m in request["messages"]]
        return [{"role": "user", "content": str(request.get("prompt", ""))}]
    return [{"role": str(m.get("role", "user")), "content": str(m.get("content") or "")} for m in request]


def extract(
    request: Any, *, max_tokens: int | None = None, count_tokens: Callable[[str], int] | None = None
) -> dict[str, float]:
    """Named features of a request (see :data:`FEATURE_NAMES`); never raises on odd text."""
    messages = messages_of(request)
    if max_tokens is None:
        max_tokens = max_tokens_of(request)
    count = count_tokens or estimate_tokens
    users = [m["content"] for m in messages if m["role"] == "user"]
    last = users[-1] if users else ""
    prompt_tokens = count(last)
    conversation_tokens = sum(count(m["content"]) for m in messages)
    text = _scan(last)
    lower = text.lower()
    words = _WORDS.findall(lower)
    counts = Counter(words)
    n = max(1, len(text))
    features = {
        "log_prompt_tokens": math.log1p(prompt_tokens),
        "log_conversation_tokens": math.log1p(conversation_tokens),
        "log_max_tokens": math.log1p(max_tokens or 0),
        "turns": float(min(len(users), 20)),
        "has_system": float(any(m["role"] == "system" for m in messages)),
        "code_markers": math.log1p(sum(text.count(snippet) for snippet in _CODE_SNIPPETS)),
        "code_words": math.log1p(_count(counts, lower, _CODE_WORDS)),
        "math_markers": math.log1p(_count(counts, lower, _MATH_WORDS) + len(_MATH_SYMBOLS.findall(text))),
        "digits": (len(text) - len(text.translate(_DROP_DIGITS))) / n,
        "reasoning_markers": math.log1p(_count(counts, lower, _REASONING_WORDS)),
        "precision_request": float(_count(counts, lower, _PRECISION_WORDS) > 0),
        "constraints": math.log1p(_count(counts, lower, _CONSTRAINT_WORDS) + len(_BULLETS.findall(text))),
        "examples": math.log1p(_count(counts, lower, _EXAMPLE_WORDS) + len(_EXAMPLE_SYMBOLS.findall(text))),
        "question_form": float(bool(words) and words[0] in _QUESTION_WORDS),
        "lines": math.log1p(text.count("\n")),
        "non_ascii": (len(text) - len(text.encode("ascii", "ignore"))) / n,
        "cjk": len(_CJK.findall(text)) / n,
        "long_prompt": float(conversation_tokens > 1024),
    }
    for domain, words in DOMAINS.items():
        features[f"domain_{domain}"] = float(sum(1 for w in words if w in lower))
    # Task shape: a short knowledge question, a question over a long context that needs counting
    # across it, a code request stated by signature or by doctests, and how many sentences it has.
    coded = features["code_markers"] > 0 or features["code_words"] > 0
    head = text[:1500]
    features.update({
        "short_answer": float(any(phrase in lower for phrase in _SHORT_ANSWER)),
        "sentences": math.log1p(len(_SENTENCE_END.findall(text[-1500:]))),
        "proper_nouns": len(_PROPER_NOUN.findall(head)) / max(1, len(head.split())),
        "knowledge_question": float(prompt_tokens < 60 and not coded and features["math_markers"] == 0),
        "aggregation": float(conversation_tokens > 1024 and "how many" in lower[-300:]),
        "doctests": math.log1p(text.count(">>>")),
        "named_signature": float(bool(_SIGNATURE.search(text))),
    })
    return features


def hashed_ngrams(request: Any, dim: int = 4096) -> dict[int, float]:
    """Word 1- and 2-grams of the last user message, hashed into ``dim`` buckets, L2-normalised."""
    messages = messages_of(request)
    users = [m["content"] for m in messages if m["role"] == "user"]
    words = _WORD.findall(_scan(users[-1] if users else "")[-_NGRAM_CHARS:].lower())
    counts: dict[int, float] = {}
    grams = Counter(words)
    grams.update(map(" ".join, zip(words, words[1:])))
    for gram, n in grams.items():  # each distinct gram hashed once
        bucket = zlib.crc32(gram.encode("utf-8", "replace")) % dim
        counts[bucket] = counts.get(bucket, 0.0) + n
    norm = math.sqrt(sum(v * v for v in counts.values())) or 1.0
    return {k: v / norm for k, v in counts.items()}
