"""``edgecloud serve --engine vllm`` with real vLLM on loopback (its CPU build on a CPU-only machine).

The launcher converts SmolLM2's GGUF into a Hugging Face checkpoint (cached), starts vLLM's
OpenAI server and reports when it serves; then the official ``openai`` client, a streamed
request with usage, ``continue_final_message`` (what mid-stream fallback needs) through both
the openai client and our ``CloudBackend``, and the hybrid client with vLLM as its cloud (a
cloud-first answer, and an edge failing mid-stream that vLLM continues).

vLLM comes from the Python that ``EDGECLOUD_VLLM_PYTHON`` names, else ``.venv-vllm`` (which
``make test`` installs), else this environment. Where it is not installed, every test here is
skipped with the reason: the install error ``make`` recorded, quoted, when there is one.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from edgecloud import EdgeCloud
from edgecloud.remote.client import CloudBackend
from edgecloud.serving.vllm_launch import find_vllm
from edgecloud.edge.llamacpp import LlamaCppBackend
from edgecloud.router.policy import RoutePolicy
from edgecloud.types import ChatRequest
from faults import BreaksAfter, free_port, ignoring

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-vllm"
MODEL = "smollm2-135m-instruct-q4"
KEY = "sk-vllm-test"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]


def _vllm_python() -> str:
    if os.environ.get("EDGECLOUD_VLLM_PYTHON"):
        return os.environ["EDGECLOUD_VLLM_PYTHON"]
    candidate = VENV / "bin" / "python"
    return str(candidate) if candidate.exists() else sys.executable


def _skip_reason() -> str:
    recorded = VENV / "install-error.txt"
    if recorded.exists():
        lines = [line for line in recorded.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
        return "vLLM could not be installed here: " + " | ".join(lines[-3:])
    return f"vLLM is not installed for {_vllm_python()} (make vllm, or set EDGECLOUD_VLLM_PYTHON)"


@pytest.fixture(scope="module")
def vllm_url(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    python = _vllm_python()
    found = find_vllm(python)
    if found is None:
        pytest.skip(_skip_reason())
    if found.problem is not None:
        pytest.fail(f"vLLM is installed but cannot start: {found.problem}")
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "serve.log"
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "edgecloud", "serve", "--engine", "vllm", "--model", MODEL, "--port", str(port),
             "--ctx", "2048", "--max-batch", "4", "--api-key", KEY, "--vllm-python", python,
             # eager mode: the CI machine has no time for the minutes of compiling vLLM's warm-up does
             "--vllm-arg=--enforce-eager"],
            stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log, 900)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = log.read_text(encoding="utf-8", errors="replace")
    assert "edgecloud: vLLM serves" in text, text[-2000:]


def test_the_openai_client_plain_and_streamed(vllm_url: str) -> None:
    with openai.OpenAI(base_url=f"{vllm_url}/v1", api_key=KEY) as client:
        models = [m.id for m in client.models.list()]
        assert models == [MODEL]
        reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
        stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    with openai.OpenAI(base_url=f"{vllm_url}/v1", api_key="wrong") as wrong, pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)


def test_continue_final_message_continues_a_partial_answer(vllm_url: str) -> None:
    partial = "The capital of France is"
    whole = [*QUESTION, {"role": "assistant", "content": partial}]
    with openai.OpenAI(base_url=f"{vllm_url}/v1", api_key=KEY) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=whole, max_tokens=8, temperature=0,  # type: ignore[arg-type]
            extra_body={"continue_final_message": True, "add_generation_prompt": False})
    continued = reply.choices[0].message.content or ""
    assert continued and not continued.lstrip().startswith(partial)
    with CloudBackend(vllm_url, MODEL, api_key=KEY) as cloud:
        ours = cloud.complete(ChatRequest(messages=whole, continue_final_message=True, max_tokens=8, temperature=0))
    assert ours.text == continued


class _Fixed:
    def __init__(self, value: float) -> None:
        self.value, self.name = value, f"fixed-{value}"

    def score(self, request: object) -> float:
        return self.value


def test_the_hybrid_client_uses_vllm_as_its_cloud(vllm_url: str, smollm2_path: Path) -> None:
    config = {"fallback": {"max_retries": 0, "timeout_s": 60}, "collab": {"mode": "off"}}
    with EdgeCloud(edge_model=None, cloud_base_url=vllm_url, cloud_model=MODEL, cloud_api_key=KEY, config=config,
                   policy=RoutePolicy(scorer=_Fixed(1.0))) as client:
        answer = client.chat.completions.create(messages=QUESTION, max_tokens=12, temperature=0)
    assert answer.route.target == "cloud" and answer.text
    with LlamaCppBackend(str(smollm2_path), n_ctx=1024) as edge:
        with EdgeCloud(edge_model=None, edge_backend=BreaksAfter(edge, 5), cloud_base_url=vllm_url, cloud_model=MODEL,
                       cloud_api_key=KEY, config=config, policy=RoutePolicy(scorer=_Fixed(0.0))) as client:
            story = client.chat.completions.create(messages=STORY, max_tokens=40, temperature=0)
    [switch] = story.route.fallbacks
    assert (switch["from"], switch["to"], switch["cause"]) == ("edge", "cloud", "runtime_error")
    at = switch["at_chars"]
    assert at > 0 and len(story.text) > at
    with CloudBackend(vllm_url, MODEL, api_key=KEY) as cloud:
        expected = cloud.complete(ChatRequest(messages=[*STORY, {"role": "assistant", "content": story.text[:at]}],
                                              continue_final_message=True, max_tokens=40 - switch["at_tokens"],
                                              temperature=0)).text
    # vLLM's CPU build computes in bf16, and a request continued by the failover and the same
    # continuation asked for directly can part at a logit tie further on; the opening shows whether
    # the cloud continued the partial answer (not restarted it)
    assert story.text[at:][:24] == expected[:24]


def test_checks_read_vllms_prefix_cache_in_token_sessions(vllm_url: str) -> None:
    """With edgecloud's plugin (loaded by the launcher) a check continues a token session: it
    sends only the new tokens, vLLM reads the context from its prefix cache, and the scores are
    those of the whole context recomputed (as plain vLLM gives them, through a proxy that drops the
    plugin's fields). A session vLLM does not hold is sent whole again, with the same scores."""
    from edgecloud.runtime.scoring import TokenSession

    context = list(range(1000, 1000 + 300))  # past several KV blocks
    block = [5, 6, 7, 8]
    with CloudBackend(vllm_url, MODEL, api_key=KEY) as cloud:
        session = TokenSession()
        opened = cloud.score_in(session, context, start=len(context) - 1)
        assert session.supported is True and session.held == len(context) and opened.sent == len(context)
        checked = cloud.score_in(session, context + block, start=len(context))
        assert checked.sent == len(block) and checked.held == len(context)
        again = cloud.score_in(None, context + block, start=len(context))  # no session: the cache still serves it
        assert again.sent == len(context) + len(block) and again.cached >= len(context) // 2
        lost = TokenSession(held=len(context), supported=True)  # the server never held this one
        resent = cloud.score_in(lost, context + block, start=len(context))
        assert lost.resent == 1 and resent.sent == len(context) + len(block)
    with ignoring(vllm_url, ("session", "score_from"), "session") as plain, \
            CloudBackend(plain, MODEL, api_key=KEY) as cloud:
        recomputed = cloud.score_in(None, context + block, start=len(context))
        assert recomputed.cached == 0  # plain vLLM: prompt logprobs skip the prefix cache
    for got in (checked, again, resent):
        assert [s.token for s in got.scores] == block
        assert [s.top[0][0] for s in got.scores] == [s.top[0][0] for s in recomputed.scores]
        assert got.next.top[0][0] == recomputed.next.top[0][0]
        for ours, theirs in zip(got.scores, recomputed.scores):
            assert abs(ours.logprob - theirs.logprob) < 0.1


def test_a_check_that_keeps_what_it_verified_is_not_sent_the_clouds_token_back(vllm_url: str) -> None:
    """``session.keep_verified``: the session holds the drafts vLLM agrees with and its own token
    after them, so the next check sends its new drafts alone and scores them as before."""
    from edgecloud.runtime.scoring import TokenSession
    from edgecloud.runtime.speculative import accept_prefix

    context = list(range(1000, 1000 + 300))
    with CloudBackend(vllm_url, MODEL, api_key=KEY) as cloud:
        session = TokenSession()
        opened = cloud.score_in(session, context, start=len(context), keep_verified=True)  # the cloud's first token
        first = opened.next.token
        assert opened.verified == (0, first) and session.held == len(context) + 1
        block = [first + 1, 6, 7]  # a draft it will not take
        checked = cloud.score_in(session, context + [first] + block, start=len(context) + 1, keep_verified=True)
        kept = accept_prefix(block, [s.choice for s in checked.scores])
        assert checked.sent == len(block) and kept == 0
        assert checked.verified == (0, checked.scores[0].choice) and session.held == len(context) + 2
        whole = cloud.score_in(None, context + [first] + block, start=len(context) + 1)
    assert [s.top[0][0] for s in checked.scores] == [s.top[0][0] for s in whole.scores]


def test_a_check_without_drafts_sends_no_token_and_continues_vllms_session(vllm_url: str) -> None:
    """The plugin says the session ``resumes``: a check without drafts (the cloud opening an
    answer) sends no token ids and gets vLLM's next greedy token after what it holds, the one a
    whole context recomputed gives."""
    from edgecloud.runtime.scoring import TokenSession

    context = list(range(1000, 1000 + 300))
    with CloudBackend(vllm_url, MODEL, api_key=KEY) as cloud:
        session = TokenSession()
        opened = cloud.score_in(session, context, start=len(context), keep_verified=True)
        assert session.resumes is True
        written = [opened.next.token]
        for _ in range(2):
            at = len(context) + len(written)
            later = cloud.score_in(session, context + written, start=at, keep_verified=True)
            assert later.sent == 0 and session.held == at + 1
            whole = cloud.score_in(None, context + written, start=at)
            assert later.next.token == whole.next.token
            written.append(later.next.token)
    empty = httpx.post(f"{vllm_url}/v1/completions", json={
        "model": MODEL, "prompt": [], "max_tokens": 1, "echo": True, "logprobs": 1, "return_tokens_as_token_ids": True,
        "score_from": 1, "session": {"id": "nothing-held", "base": 0}}, headers={"Authorization": f"Bearer {KEY}"},
        timeout=60)
    assert empty.status_code == 400  # nothing sent and nothing held


def test_a_bad_session_or_score_from_is_a_400_naming_it(vllm_url: str) -> None:
    check = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 1, "echo": True, "logprobs": 1,
             "return_tokens_as_token_ids": True}
    bad = [({"session": {"id": "", "base": 0}}, "session"), ({"session": {"id": "s", "base": -1}}, "session"),
           ({"session": "s"}, "session"), ({"score_from": -2}, "score_from"), ({"score_from": "3"}, "score_from")]
    for fields, param in bad:
        answer = httpx.post(f"{vllm_url}/v1/completions", json={**check, **fields},
                            headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert answer.status_code == 400, (fields, answer.text)
        assert answer.json()["error"]["param"] == param
    expired = httpx.post(f"{vllm_url}/v1/completions", json={**check, "session": {"id": "never", "base": 2}},
                         headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert expired.status_code == 409 and expired.json()["error"]["type"] == "session_expired"


def test_the_default_verifies_against_vllm_launched_by_edgecloud(vllm_url: str, smollm2_path: Path) -> None:
    """The default (collab=auto) runs verified mode against vLLM launched by ``edgecloud serve``:
    the answer is the cloud's own greedy text, each check sends only what is new."""
    config = {"fallback": {"max_retries": 0, "timeout_s": 120}, "router": {"pii": "off"}}
    with LlamaCppBackend(str(smollm2_path), n_ctx=1024) as edge:
        with EdgeCloud(edge_model=None, edge_backend=edge, cloud_base_url=vllm_url, cloud_model=MODEL,
                       cloud_api_key=KEY, config=config) as client:
            answer = client.chat.completions.create(messages=STORY, max_tokens=40, temperature=0)
            cloud = client.chat.completions.create(messages=STORY, max_tokens=40, temperature=0, route="cloud",
                                                   collab="off")
            capabilities = client.stats()["clouds"][0]["capabilities"]
    route, cost = answer.route, answer.cost
    assert route.collab == "verified" and route.cloud_calls >= 2 and not route.fallbacks
    assert capabilities["sessions"] is True and capabilities["score"] is True
    # in a session the prompt is sent once, then only the new tokens of each check
    assert cost.cloud_input_tokens < answer.usage.prompt_tokens + answer.usage.completion_tokens + 16 * route.cloud_calls
    assert answer.text.split()[:6] == cloud.text.split()[:6]


def test_the_default_does_not_check_every_block_against_a_plain_vllm(vllm_url: str, smollm2_path: Path) -> None:
    """A plain vLLM (here: a proxy that drops the plugin's fields) scores drafted blocks but holds
    no token session: every check would send, and recompute, the whole context. The default learns
    that from its first check, before anything is shown, and writes the answer with text spans
    (which vLLM's prefix cache serves); later answers start there. Verified mode asked for by name
    still checks every block."""
    config = {"fallback": {"max_retries": 0, "timeout_s": 120}, "router": {"pii": "off"}}
    with ignoring(vllm_url, ("session", "score_from"), "session") as plain, \
            LlamaCppBackend(str(smollm2_path), n_ctx=1024) as edge:
        with EdgeCloud(edge_model=None, edge_backend=edge, cloud_base_url=plain, cloud_model=MODEL,
                       cloud_api_key=KEY, config=config) as client:
            first = client.chat.completions.create(messages=QUESTION, max_tokens=16, temperature=0)
            later = client.chat.completions.create(messages=QUESTION, max_tokens=16, temperature=0)
            capabilities = client.stats()["clouds"][0]["capabilities"]
        assert first.text and later.text
        assert first.route.collab == later.route.collab == "token"
        assert any(n.code == "collab_mode" and "'sessions'" in n.text for n in first.route.notes)
        assert capabilities["sessions"] is False and capabilities["score"] is True
        with EdgeCloud(edge_model=None, edge_backend=edge, cloud_base_url=plain, cloud_model=MODEL,
                       cloud_api_key=KEY, config=config) as client:
            answer = client.chat.completions.create(messages=QUESTION, max_tokens=16, temperature=0,
                                                    collab="verified")
            cloud = client.chat.completions.create(messages=QUESTION, max_tokens=16, temperature=0, route="cloud",
                                                   collab="off")
    route, cost = answer.route, answer.cost
    assert route.collab == "verified" and route.cloud_calls >= 1 and answer.text
    assert cost.cloud_calls == route.cloud_calls and cost.cloud_passes >= route.cloud_calls
    # no session: every round re-sends the prompt, so more input than the prompt and answer once
    assert cost.cloud_input_tokens >= route.cloud_calls * answer.usage.prompt_tokens
    assert answer.text.split()[:3] == cloud.text.split()[:3]


def test_a_sampled_answer_is_never_a_silent_greedy_one(vllm_url: str, smollm2_path: Path) -> None:
    """vLLM ignores the fields of a coupled check (it cannot draw with the edge's noise): under the
    defaults a sampled answer moves, before anything is shown, to a mode where vLLM samples
    itself; verified mode asked for by name raises the refusal."""
    from edgecloud.errors import ExtensionUnsupportedError

    config = {"fallback": {"max_retries": 0, "timeout_s": 120}, "router": {"pii": "off"}}
    with LlamaCppBackend(str(smollm2_path), n_ctx=1024) as edge:
        with EdgeCloud(edge_model=None, edge_backend=edge, cloud_base_url=vllm_url, cloud_model=MODEL,
                       cloud_api_key=KEY, config=config) as client:
            answer = client.chat.completions.create(messages=QUESTION, max_tokens=16, temperature=0.8, seed=3)
            capabilities = client.stats()["clouds"][0]["capabilities"]
        assert answer.text and answer.route.collab != "verified"
        assert answer.route.noted("sampling") is None and capabilities["coupling"] is False
        with EdgeCloud(edge_model=None, edge_backend=edge, cloud_base_url=vllm_url, cloud_model=MODEL,
                       cloud_api_key=KEY, config=config) as client, pytest.raises(ExtensionUnsupportedError) as refused:
            client.chat.completions.create(messages=QUESTION, max_tokens=16, temperature=0.8, collab="verified")
    assert refused.value.extension == "coupling"


def test_kv_offload_is_refused_by_name_where_this_vllm_cannot_do_it() -> None:
    """The installed vLLM knows --kv-offloading-size, but on the CPU its native offloading has nowhere
    to move KV to (vLLM itself fails at start-up, minutes in): refused before anything starts."""
    python = _vllm_python()
    found = find_vllm(python)
    if found is None:
        pytest.skip(_skip_reason())
    assert "kv_offloading" in found.features
    run = subprocess.run([sys.executable, "-m", "edgecloud", "serve", "--engine", "vllm", "--model", MODEL,
                          "--vllm-python", python, "--kv-offload", "2"], capture_output=True, text=True, timeout=300)
    if found.cpu:
        assert run.returncode == 2 and "VLLM_CPU_KVCACHE_SPACE" in run.stderr
    if "lmcache" not in found.features:
        run = subprocess.run([sys.executable, "-m", "edgecloud", "serve", "--engine", "vllm", "--model", MODEL,
                              "--vllm-python", python, "--kv-offload", "2", "--kv-offload-backend", "lmcache"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 2 and "pip install lmcache" in run.stderr


def _wait_healthy(url: str, proc: subprocess.Popen[str], log: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        if proc.poll() is not None:
            pytest.fail(f"edgecloud serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        assert time.monotonic() < deadline, f"not healthy within {seconds:.0f} s:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)


def test_disaggregated_prefill_and_decode_answer_as_one_instance_and_survive_a_restart(
        vllm_url: str, tmp_path: Path) -> None:
    """Two vLLM instances with vLLM's shared-storage KV connector behind the proxy: the decode
    instance reads the prompt's KV the prefill instance wrote (its usage says the prompt was
    cached the first time it saw it), the answer is the single instance's, plain and streamed; a
    decode instance killed is a 503 naming it until it is back, started again by the launcher."""
    python = _vllm_python()
    port = free_port()
    while any(_port_taken(port + n) for n in (1, 2)):
        port = free_port()
    log = tmp_path / "pd.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "edgecloud", "serve", "--engine", "vllm", "--model", MODEL, "--port", str(port),
             "--ctx", "4096", "--max-batch", "4", "--api-key", KEY, "--vllm-python", python,
             "--disaggregate", "prefill=1,decode=1", "--vllm-arg=--enforce-eager"],
            stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    long_question = [{"role": "user", "content": "Name the capital of the country these cities are in: "
                      + ", ".join(["Lyon", "Marseille", "Toulouse", "Nice", "Nantes", "Lille"] * 8) + "."}]
    try:
        _wait_healthy(url, proc, log, 900)
        with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY) as client, \
                openai.OpenAI(base_url=f"{vllm_url}/v1", api_key=KEY) as single:
            reply = client.chat.completions.create(model=MODEL, messages=long_question, max_tokens=12, temperature=0)
            alone = single.chat.completions.create(model=MODEL, messages=long_question, max_tokens=12, temperature=0)
            streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=MODEL, messages=long_question, max_tokens=12, temperature=0, stream=True) if c.choices)
        assert reply.choices[0].message.content == alone.choices[0].message.content == streamed
        details = reply.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens and details.cached_tokens >= 16  # KV from the prefill side
        # a prompt longer than one step's token budget (2,048 here) is prefilled in chunks: its whole
        # KV still reaches the decode side (vLLM's shared-storage connector saves a chunked prompt
        # in part, and the decode engine died loading it, until the launcher stopped chunking)
        with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY) as client:
            long_reply = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
                {"role": "user", "content": "Name the capital of the country these cities are in: "
                 + ", ".join(["Lyon", "Marseille", "Toulouse", "Nice", "Nantes", "Lille"] * 130) + "."}])
        assert long_reply.usage.prompt_tokens > 2048
        cached = long_reply.usage.prompt_tokens_details
        assert cached is not None and cached.cached_tokens is not None and cached.cached_tokens > 2048
        decode_port = port + 2
        pids = subprocess.run(["pgrep", "-f", "--", f"--port {decode_port}"], capture_output=True, text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(int(pid)), 9)
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "the proxy did not notice the decode instance had gone"
            time.sleep(0.5)
        health = httpx.get(f"{url}/health", timeout=5).json()
        assert health["down"] == ["decode"]
        down = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 4},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert down.status_code == 503 and down.json()["error"]["code"] == "decode_unavailable"
        _wait_healthy(url, proc, log, 900)  # the launcher started it again
        again = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 4},
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
        assert again.status_code == 200, again.text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
    # SIGTERM stops the instances too, not only the proxy
    assert proc.returncode == 0, log.read_text()[-2000:]
    assert not _port_taken(port + 1) and not _port_taken(port + 2)


def _port_taken(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0
