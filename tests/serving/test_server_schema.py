"""Schemathesis against the real app on loopback, both engines: it reads ``/openapi.json`` and
fuzzes every operation (valid and invalid bodies, headers, wrong types) with a bounded number of
examples. No answer may be a 5xx, none may hang past the request timeout, and every answer must
conform to the documented status codes, content types and response schemas."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp")
pytest.importorskip("schemathesis")
httpx = pytest.importorskip("httpx")

from faults import serving

KEY = "sk-schema"
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
EXAMPLES = 25  # per operation in the fuzzing phase; the coverage phase adds its boundary cases (~500 requests)


@pytest.fixture(scope="module", params=["torch", "llamacpp"])
def server(request: pytest.FixtureRequest, smollm2_path: Path) -> Iterator[str]:
    # a 32-token context bounds every answer, so the ~500 generated requests take seconds
    if request.param == "torch":
        pytest.importorskip("torch")
    with serving(request.param, smollm2_path, n_ctx=32, api_key=KEY) as (url, backend):
        yield url


def test_openapi_document_describes_the_real_shapes(server: str) -> None:
    document = httpx.get(f"{server}/openapi.json").json()
    chat = document["paths"]["/v1/chat/completions"]["post"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    request = document["components"]["schemas"][body]
    assert {"messages", "max_tokens", "seed", "stream"} <= set(request["properties"])
    assert request["additionalProperties"] is False
    assert {"200", "400", "401", "413", "429", "503"} <= set(chat["responses"])


def test_schemathesis_finds_no_server_error_and_no_schema_violation(server: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", f"{server}/openapi.json", "-H", f"Authorization: Bearer {KEY}",
         "--checks", CHECKS, "--max-examples", str(EXAMPLES), "--request-timeout", "60", "--seed", "17",
         "--continue-on-failure", "--no-color"],
        capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout.split("SUMMARY")[-1]
    # the server is still fine afterwards
    assert httpx.get(f"{server}/health").status_code == 200
