"""The edge model writes, a faster file of it drafts: verified mode drafts with ``edge_draft_model``.

A real ``edgecloud serve`` (llama.cpp, SmolLM2) is the cloud. The client is built as a user builds
it (from model names, not backends passed in): the edge model is SmolLM2, the draft model the same
weights under another file name, so the cloud's greedy answer is known and which file was read
shows in which backend loaded. The catalogue's own pairing (the default edge model's drafter) is
checked where it is defined.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")

from edgecloud import EdgeCloud
from edgecloud.store import DEFAULT_EDGE_MODEL, require_entry
from faults import serving

KEY = "sk-test"
PROMPT = "List three colours of the rainbow, one per line."


@pytest.fixture(scope="module")
def cloud(smollm2_path: Path) -> Iterator[str]:
    with serving("llamacpp", smollm2_path, n_ctx=1024, api_key=KEY) as (url, _):
        yield url


@pytest.fixture()
def draft_file(smollm2_path: Path, tmp_path: Path) -> Path:
    link = tmp_path / "smollm2-drafter.gguf"
    link.symlink_to(smollm2_path)
    return link


def client(edge_model: Path, url: str, **options: Any) -> EdgeCloud:
    config = {"fallback": {"max_retries": 0, "timeout_s": 30, "connect_timeout_s": 2}, "router": {"pii": "off"}}
    return EdgeCloud(str(edge_model), cloud_base_url=url, cloud_model="m", cloud_api_key=KEY, n_ctx=1024,
                     config=config, **options)


def ask(c: EdgeCloud, **params: Any) -> tuple[str, Any]:
    chunks = list(c.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], max_tokens=24,
                                            temperature=0, stream=True, **params))
    return "".join(ch.text for ch in chunks), chunks[-1]


def test_verified_mode_drafts_with_the_draft_model_and_the_edge_model_writes_alone(
        smollm2_path: Path, draft_file: Path, cloud: str) -> None:
    with client(smollm2_path, cloud, edge_draft_model=str(draft_file)) as c:
        edge, drafter = c.edge, c.hybrid.drafter
        assert edge is not None and drafter is not None and drafter is not edge
        text, final = ask(c, collab="verified")
        assert final.route.collab == "verified" and final.route.cloud_calls > 0
        assert drafter.loaded and not edge.loaded  # the drafts came from the draft file alone
        alone, _ = ask(c, route="cloud", collab="off")
        assert text == alone  # the cloud's greedy answer, whichever file drafted it
        own, final = ask(c, route="edge")
        assert edge.loaded and final.route.target == "edge" and not final.route.cloud_calls
        assert own == alone  # (the same weights: the edge's greedy answer is the cloud's)


def test_checked_mode_keeps_the_edge_models_own_tokens(smollm2_path: Path, draft_file: Path, cloud: str) -> None:
    with client(smollm2_path, cloud, edge_draft_model=str(draft_file)) as c:
        _, final = ask(c, collab="checked")
        assert final.route.collab == "checked"
        assert c.edge is not None and c.edge.loaded  # unchecked tokens are written by the edge model
        assert not c.hybrid.drafter.loaded


def test_an_empty_draft_model_drafts_with_the_edge_model(smollm2_path: Path, cloud: str) -> None:
    with client(smollm2_path, cloud, edge_draft_model="") as c:
        assert c.hybrid.draft_model() is None and c.hybrid.drafter is c.edge
        _, final = ask(c, collab="verified")
        assert final.route.collab == "verified" and c.edge.loaded


def test_the_default_edge_model_drafts_with_a_faster_file_of_itself() -> None:
    edge = require_entry(DEFAULT_EDGE_MODEL)
    assert edge.drafter is not None
    drafter = require_entry(edge.drafter)
    # made from the edge model's own file: the same weights and tokenizer, checked by the cloud
    assert drafter.source.kind == "requantized" and drafter.source.base == edge.name
    assert drafter.family == edge.family and drafter.size_bytes < edge.size_bytes
    c = EdgeCloud(cloud_base_url="http://127.0.0.1:9/v1", cloud_model="m")
    assert c.hybrid.draft_model() == edge.drafter
    assert EdgeCloud(cloud_base_url="http://127.0.0.1:9/v1", cloud_model="m",
                     edge_draft_model="").hybrid.draft_model() is None


def test_a_draft_model_that_names_nothing_is_a_config_error_naming_the_setting(tmp_path: Path) -> None:
    from edgecloud.errors import ConfigError

    for name in ("no-such-model", str(tmp_path / "missing.gguf")):
        with pytest.raises(ConfigError) as caught:
            EdgeCloud(cloud_base_url="http://127.0.0.1:9/v1", cloud_model="m", edge_draft_model=name)
        assert "edge_draft_model" in str(caught.value)


def test_a_prompt_longer_than_the_drafters_context_is_answered_by_the_cloud(
        smollm2_path: Path, draft_file: Path, cloud: str) -> None:
    long = "Repeat the word apple. " * 80  # ~500 tokens: more than the edge's 256, less than the cloud's 1024
    config = {"fallback": {"max_retries": 0, "timeout_s": 30, "connect_timeout_s": 2}, "router": {"pii": "off"}}
    with EdgeCloud(str(smollm2_path), cloud_base_url=cloud, cloud_model="m", cloud_api_key=KEY, n_ctx=256,
                   config=config, edge_draft_model=str(draft_file)) as c:
        c.hybrid.policy.edge_max_context = None  # as before any edge model has loaded: the router cannot tell
        answers = []
        for _ in range(2):  # before anything is loaded, and once the drafter's context is known
            chunks = list(c.chat.completions.create(messages=[{"role": "user", "content": long}], max_tokens=8,
                                                    temperature=0, stream=True, collab="verified"))
            answers.append(("".join(ch.text for ch in chunks), chunks[-1]))
        alone = list(c.chat.completions.create(messages=[{"role": "user", "content": long}], max_tokens=8,
                                               temperature=0, stream=True, route="cloud", collab="off"))
    expected = "".join(ch.text for ch in alone)
    assert expected and all(text == expected for text, _ in answers)
    first, second = answers[0][1], answers[1][1]
    assert [f.cause for f in first.route.fallbacks] == ["context_overflow"]  # found while starting: the cloud wrote it
    # the drafter loaded (the edge model did not): its context now routes such a prompt to the cloud at once
    assert c.edge is not None and not c.edge.loaded
    assert second.route.target == "cloud" and not second.route.fallbacks
