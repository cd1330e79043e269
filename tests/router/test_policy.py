"""RoutePolicy: pins, privacy and PII, context fit, availability, bands and the target cloud fraction."""

from __future__ import annotations

import pytest

from edgecloud.errors import ConfigError
from edgecloud.router.policy import PrivacyViolationError, RoutePolicy
from edgecloud.types import ChatRequest


class FixedScorer:
    name = "fixed"

    def __init__(self, value: float) -> None:
        self.value = value

    def score(self, request: object) -> float:
        return self.value


def _req(text: str, **kw: object) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": text}], **kw)


@pytest.mark.parametrize(("score", "target", "cascade"), [(0.1, "edge", False), (0.5, "edge", True), (0.9, "cloud", False)])
def test_bands(score: float, target: str, cascade: bool) -> None:
    decision = RoutePolicy(scorer=FixedScorer(score)).decide(_req("hello"))
    assert (decision.target, decision.cascade, decision.score) == (target, cascade, score)
    assert "fixed score" in decision.reason


def test_unset_bands_are_the_scorers_own_and_settings_override_them() -> None:
    scorer = FixedScorer(0.25)
    scorer.bands = (0.1, 0.2)  # type: ignore[attr-defined]  # e.g. a learned scorer of cloud-win probabilities
    assert RoutePolicy(scorer=scorer).decide(_req("hello")).target == "cloud"
    assert (RoutePolicy(scorer=scorer).edge_below, RoutePolicy(scorer=scorer).cloud_above) == (0.1, 0.2)
    overridden = RoutePolicy(scorer=scorer, edge_below=0.3).decide(_req("hello"))
    assert (overridden.target, overridden.cascade) == ("edge", False)
    assert RoutePolicy(scorer=scorer, edge_below=0.3).cloud_above == 0.3  # never below edge_below


def test_local_only_and_pii_never_reach_the_cloud() -> None:
    policy = RoutePolicy(scorer=FixedScorer(0.99))
    assert policy.decide(_req("hard question", privacy="local_only")).target == "edge"
    pii = policy.decide(_req("Email bob@example.com the contract"))
    assert pii.target == "edge" and "PII detected (email)" in pii.reason
    with pytest.raises(PrivacyViolationError, match="edge is unavailable"):
        policy.decide(_req("card 4111 1111 1111 1111"), available=["cloud"])
    with pytest.raises(PrivacyViolationError, match="route='cloud'"):
        policy.decide(_req("hi", privacy="local_only", route="cloud"))


def test_redact_policy_sends_placeholders_and_restores() -> None:
    policy = RoutePolicy(scorer=FixedScorer(0.99), pii="redact")
    decision = policy.decide(_req("Write to bob@example.com about IBAN GB82 WEST 1234 5698 7654 32"))
    assert decision.target == "cloud" and decision.redaction is not None and decision.messages is not None
    sent = decision.messages[0]["content"]
    assert "bob@example.com" not in sent and "[EMAIL_1]" in sent and "[IBAN_1]" in sent
    assert decision.redaction.restore("Dear [EMAIL_1],") == "Dear bob@example.com,"


def test_pins_context_fit_and_availability() -> None:
    policy = RoutePolicy(scorer=FixedScorer(0.0), edge_max_context=512)
    assert policy.decide(_req("x", route="cloud")).target == "cloud"
    assert policy.decide(_req("x", route="edge")).reason == "route=edge requested"
    too_long = policy.decide(_req("word " * 800, max_tokens=100))
    assert too_long.target == "cloud" and "exceed the edge context 512" in too_long.reason
    assert policy.decide(_req("x"), available=["cloud"]).target == "cloud"
    assert RoutePolicy(scorer=FixedScorer(0.99)).decide(_req("x"), available=["edge"]).reason == "the cloud is unavailable"


def test_target_cloud_fraction_holds_on_live_traffic() -> None:
    class Cycling:
        name = "cycling"
        i = 0

        def score(self, request: object) -> float:
            self.i += 1
            return (self.i * 37 % 100) / 100

    policy = RoutePolicy(scorer=Cycling(), target_cloud_fraction=0.2)
    targets = [policy.decide(_req("q")).target for _ in range(600)]
    share = targets[100:].count("cloud") / 500
    assert 0.15 <= share <= 0.25


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigError):
        RoutePolicy(scorer=FixedScorer(0), edge_below=0.8, cloud_above=0.2)
    with pytest.raises(ConfigError):
        RoutePolicy(scorer=FixedScorer(0), target_cloud_fraction=1.5)
