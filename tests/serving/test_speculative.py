"""Speculative decoding: exactness (greedy identity, rejection sampling), the adaptive k and its
off switch, proposers, failures, and the server's options — on SmolLM2 (target: the torch engine,
draft: the same GGUF on llama.cpp INT4), with fake proposers only to be adversarial or to fail.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llama_cpp")
scipy_stats = pytest.importorskip("scipy.stats")

from edgecloud.engine import Tokenizer, Transformer, generate
from edgecloud.serving.scheduler import SamplingParams, Scheduler
from edgecloud.serving.speculative import (
    DraftRequest,
    LlamaDraftProposer,
    NgramProposer,
    Proposal,
    Proposer,
    SpecConfig,
    Speculator,
    expected_tokens,
    speedup,
    verify,
)
from edgecloud.errors import ConfigError
from edgecloud.observability import ServerMetrics

TOPICS = ["rust", "the sea", "a cat", "tea", "winter", "Python", "a bridge", "the moon", "bread", "music"]
QUESTIONS = [f"Write one sentence about {t}." for t in TOPICS] + [
    "Write a Python function that adds two numbers.",
    "List the first five prime numbers.",
    "What is the capital of France?",
    "Repeat after me: the quick brown fox jumps over the lazy dog.",
    "Explain what a list is in Python.",
    "Write a haiku about autumn.",
    "Count from one to ten in words.",
    "Name three colours of the rainbow.",
    "What does CPU stand for?",
    "Give a short greeting.",
]


@pytest.fixture(scope="module")
def prompts(engine: tuple[Transformer, Tokenizer]) -> list[list[int]]:
    return [engine[1].encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def alone(engine: tuple[Transformer, Tokenizer], prompts: list[list[int]]) -> list[list[int]]:
    model, tokenizer = engine
    return [list(generate(model, tokenizer, p, 16, temperature=0)) for p in prompts]


def _run(engine: tuple[Transformer, Tokenizer], speculator: Speculator | None, prompts: list[list[int]],
         params: list[SamplingParams], **kwargs: object) -> tuple[list[list[int]], list, Scheduler]:
    model, tokenizer = engine
    scheduler = Scheduler(model, eog_ids=tokenizer.eog_ids, speculator=speculator, **kwargs)  # type: ignore[arg-type]
    try:
        seqs = [scheduler.submit(p, sp) for p, sp in zip(prompts, params)]
        return [list(s) for s in seqs], seqs, scheduler
    finally:
        scheduler.close()


# ---------------------------------------------------------------- verification, unit level


def test_greedy_verify_keeps_the_matching_prefix_and_adds_the_target_token() -> None:
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([3, 7, 2, 9]):
        logits[row, best] = 5.0
    assert verify(logits, [3, 7, 1]).tokens == [3, 7, 2]
    assert verify(logits, [3, 7, 2]).tokens == [3, 7, 2, 9]  # all accepted: the bonus token
    assert verify(logits, [4, 7, 2]).accepted == 0
    with pytest.raises(ValueError, match="rows of logits"):
        verify(logits, [1])


@pytest.mark.parametrize("proposer", ["model", "deterministic"])
def test_rejection_sampling_reproduces_the_target_distribution(proposer: str) -> None:
    """Chi-square over 4,000 draws on an 8-token vocabulary: the first emitted token follows p
    at position 0, and the second (when the first draft was accepted) follows p at position 1."""
    gen = torch.Generator().manual_seed(7)
    vocab, draws = 8, 4000
    target = torch.randn(3, vocab, generator=gen) * 1.5
    p = torch.softmax(target, -1)
    q = torch.softmax(torch.randn(2, vocab, generator=gen) * 1.5, -1)  # a draft that disagrees with the target
    first = [0] * vocab
    second = [0] * vocab
    for _ in range(draws):
        if proposer == "model":
            draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
            verdict = verify(target, draft, draft_probs=q, temperature=1.0, generator=gen)
        else:
            verdict = verify(target, [2, 5], temperature=1.0, generator=gen)
        first[verdict.tokens[0]] += 1
        if verdict.accepted >= 1:
            second[verdict.tokens[1]] += 1
    assert scipy_stats.chisquare(first, _expected(p[0], draws)).pvalue > 0.01
    n2 = sum(second)
    assert n2 > 200
    assert scipy_stats.chisquare(second, _expected(p[1], n2)).pvalue > 0.01


def _expected(p: torch.Tensor, n: int) -> list[float]:
    p64 = p.double()
    return (p64 / p64.sum() * n).tolist()


def test_the_cost_model_prefers_long_drafts_only_when_they_are_accepted() -> None:
    assert expected_tokens(0.0, 5) == pytest.approx(1.0)
    assert expected_tokens(1.0, 5) == 6
    assert speedup(0.9, 4, step=1.0, row=0.02, draft=0.05, batch=1) > 2.0
    assert speedup(0.05, 4, step=1.0, row=0.02, draft=0.05, batch=1) < 1.0
    # the same draft pays less in a big batch: every sequence waits for the extra rows
    assert speedup(0.7, 4, step=1.0, row=0.05, draft=0.0, batch=8) < speedup(0.7, 4, step=1.0, row=0.05, draft=0.0, batch=1)


def test_ngram_lookup_continues_the_latest_earlier_match() -> None:
    ngram = NgramProposer(min_n=2, max_n=3)
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3]
    assert ngram.lookup(tokens, 2) == [7, 8]  # the later of two matches of (1, 2, 3)
    assert ngram.lookup([1, 2, 3, 4], 3) == []
    assert ngram.propose([DraftRequest(1, tokens, 5)])[0].tokens == [7, 8, 6, 1, 2]
    with pytest.raises(ConfigError):
        NgramProposer(min_n=3, max_n=2)


# ---------------------------------------------------------------- with the real model


@pytest.mark.parametrize("mode", ["draft", "ngram"])
def test_greedy_output_is_identical_token_for_token(engine: tuple[Transformer, Tokenizer], smollm2_path: Path,
                                                     prompts: list[list[int]], alone: list[list[int]], mode: str) -> None:
    proposers: dict[str, Proposer] = {"ngram": NgramProposer(min_n=1)}
    if mode == "draft":
        proposers = {"draft": LlamaDraftProposer(smollm2_path, target_vocab=engine[1].vocab_size, max_seqs=4,
                                                 ctx_per_seq=512, threads=2)}
    # a fixed k so drafts are verified at every step (this small target costs what its draft does)
    speculator = Speculator(SpecConfig(mode=mode, k_max=4, adaptive=False), proposers)  # type: ignore[arg-type]
    outputs, seqs, _ = _run(engine, speculator, prompts, [SamplingParams(16)] * len(prompts), max_batch=4)
    assert len(prompts) >= 20
    assert outputs == alone
    summaries = [s.spec_summary for s in seqs]
    assert sum(s["num_draft_tokens"] for s in summaries) > 0
    if mode == "draft":  # the same weights in INT4: most drafts are right
        accepted = sum(s["num_accepted_tokens"] for s in summaries) / sum(s["num_draft_tokens"] for s in summaries)
        assert accepted > 0.5


def test_speculating_and_plain_sequences_share_a_batch(engine: tuple[Transformer, Tokenizer], smollm2_path: Path,
                                                       prompts: list[list[int]], alone: list[list[int]]) -> None:
    proposers = {"draft": LlamaDraftProposer(smollm2_path, target_vocab=engine[1].vocab_size, max_seqs=4,
                                             ctx_per_seq=512, threads=2)}
    metrics = ServerMetrics("smol")
    speculator = Speculator(SpecConfig(mode="draft", k_max=3, adaptive=False), proposers, metrics=metrics)  # type: ignore[arg-type]
    params = [SamplingParams(16, spec_mode="off" if i % 2 else None) for i in range(8)]
    outputs, seqs, scheduler = _run(engine, speculator, prompts[:8], params, max_batch=4)
    assert outputs == alone[:8]
    assert all((s.spec_summary is None) == bool(i % 2) for i, s in enumerate(seqs))
    assert scheduler.steps < sum(len(a) + 1 for a in alone[:8])
    text = metrics.render().decode()
    drafted = sum(s.spec_summary["num_draft_tokens"] for s in seqs if s.spec_summary)
    assert f'edgecloud:spec_decode_num_draft_tokens_total{{model_name="smol",proposer="draft"}} {float(drafted)}' in text
    assert "edgecloud:spec_decode_num_accepted_tokens_per_pos_total" in text


class _Switchable(Proposer):
    """Adversarial (random tokens) until the output reaches ``good_after`` tokens, then perfect (the
    target's own greedy continuation, known in advance)."""

    name = "draft"

    def __init__(self, prompt_len: int, answer: list[int], good_after: int, vocab: int) -> None:
        self.prompt_len, self.answer, self.good_after, self.vocab = prompt_len, answer, good_after, vocab
        self.rng = random.Random(0)

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        out = []
        for r in requests:
            done = len(r.tokens) - self.prompt_len
            if done < self.good_after:
                out.append(Proposal([self.rng.randrange(self.vocab) for _ in range(r.k)]))
            else:
                out.append(Proposal(self.answer[done : done + r.k]))
        return out


def test_adaptive_k_switches_off_on_a_bad_draft_and_recovers(engine: tuple[Transformer, Tokenizer],
                                                             prompts: list[list[int]]) -> None:
    model, tokenizer = engine
    prompt, length, good_after = prompts[0], 120, 50
    answer = list(generate(model, tokenizer, prompt, length, temperature=0, stop_at_eog=False))
    proposer = _Switchable(len(prompt), answer, good_after, tokenizer.vocab_size)
    config = SpecConfig(mode="draft", k_max=6, probe_every=4, max_probe_every=8)
    outputs, seqs, _ = _run(engine, Speculator(config, {"draft": proposer}), [prompt],
                            [SamplingParams(length, stop_at_eog=False)])
    assert outputs == [answer]
    trace = seqs[0].spec_summary["k_trace"]
    bad, good = trace[: good_after - 5], trace[-20:]
    assert bad[-12:].count(0) >= 8  # switched off, with an occasional probe
    assert max(bad[-12:]) <= config.probe_k
    assert sum(good) / len(good) > 2.5  # back on, drafting long once drafts are right again


class _Broken(Proposer):
    name = "draft"

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        self.calls += 1
        raise MemoryError("draft out of memory")


def test_a_failing_draft_never_fails_the_request(engine: tuple[Transformer, Tokenizer], prompts: list[list[int]],
                                                 alone: list[list[int]]) -> None:
    metrics = ServerMetrics("smol")
    broken = _Broken()
    speculator = Speculator(SpecConfig(mode="draft", adaptive=False), {"draft": broken}, metrics=metrics)
    outputs, seqs, _ = _run(engine, speculator, prompts[:2], [SamplingParams(16)] * 2, max_batch=2)
    assert outputs == alone[:2]
    assert all(s.spec_summary["draft_failures"] == 1 and "out of memory" in s.spec_summary["disabled"] for s in seqs)
    # the two sequences fail in one batched call or in two (if the scheduler admits them in different
    # steps); the counter counts failed calls, and a failed sequence is never asked again
    assert 1 <= broken.calls <= 2
    found = re.search(r'edgecloud:spec_decode_draft_failures_total\{model_name="smol",proposer="draft"\} (\S+)',
                      metrics.render().decode())
    assert found is not None and float(found.group(1)) == broken.calls


def test_a_draft_with_another_vocabulary_is_refused(qwen05_path: Path, engine: tuple[Transformer, Tokenizer]) -> None:
    with pytest.raises(ConfigError, match=rf"vocabulary of \d+ tokens but the target has {engine[1].vocab_size}"):
        LlamaDraftProposer(qwen05_path, target_vocab=engine[1].vocab_size, max_seqs=1, ctx_per_seq=256)


def test_spec_config_limits() -> None:
    with pytest.raises(ConfigError, match="between 1 and 32"):
        SpecConfig(mode="ngram", k_max=33)
    with pytest.raises(ConfigError, match="not one of"):
        SpecConfig(mode="medusa")  # type: ignore[arg-type]
    assert SpecConfig(mode="auto").allows("ngram") and not SpecConfig(mode="ngram").allows("draft")
