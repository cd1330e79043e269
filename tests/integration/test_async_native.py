"""AsyncEdgeCloud talks to the cloud natively: 64 concurrent requests against a real
``edgecloud serve`` all get their answer while the process's thread count stays bounded
(the old path started one worker thread per request)."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")

from edgecloud import AsyncEdgeCloud
from faults import ServeProcess

KEY = "sk-test"
CLOUD_MODEL = "smollm2-135m-instruct-q4"
CONCURRENT = 64


def test_64_concurrent_async_requests_use_a_bounded_number_of_threads(server: ServeProcess) -> None:
    async def run() -> tuple[list[str], int, int]:
        before = threading.active_count()
        peak = before
        async with AsyncEdgeCloud(edge_model=None, cloud_base_url=server.url, cloud_model=CLOUD_MODEL,
                                  cloud_api_key=KEY) as client:

            async def ask(i: int) -> str:
                stream = await client.chat.completions.create(
                    messages=[{"role": "user", "content": f"Count to {i % 5 + 2}."}], max_tokens=4,
                    temperature=0, stream=True)
                return "".join([c.text async for c in stream])

            tasks = [asyncio.create_task(ask(i)) for i in range(CONCURRENT)]
            while not all(t.done() for t in tasks):
                peak = max(peak, threading.active_count())
                await asyncio.sleep(0.005)
            answers = [t.result() for t in tasks]
        return answers, before, peak

    answers, before, peak = asyncio.run(run())
    assert len(answers) == CONCURRENT and all(a.strip() for a in answers)
    assert peak - before <= 8, f"{peak - before} extra threads for {CONCURRENT} concurrent requests"
