"""Async app: several questions at once with AsyncEdgeCloud, one of them streamed.

Run:
    python examples/async_app.py [--edge-model M] [--cloud-url URL --cloud-model M]

Each answer says where it ran; requests that the router sends to different sides run
concurrently, and the edge serves its share one at a time in arrival order.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from edgecloud import AsyncEdgeCloud

QUESTIONS = [
    "What is the capital of Japan?",
    "Write a Python one-liner that sums the squares of 1..10.",
    "Name a prime number larger than 50.",
]


async def ask(client: AsyncEdgeCloud, question: str, max_tokens: int) -> str:
    answer = await client.chat.completions.create(messages=[{"role": "user", "content": question}],
                                                  max_tokens=max_tokens)
    return f"{question}\n  -> {answer.text.strip()[:120]!r} [{answer.route.target}: {answer.route.reason}]"


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edge-model", default=None)
    parser.add_argument("--cloud-url", action="append", default=None)
    parser.add_argument("--cloud-model", default=None)
    parser.add_argument("--cloud-key", default=None)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    options = {"cloud_base_url": args.cloud_url, "cloud_model": args.cloud_model, "cloud_api_key": args.cloud_key}
    if args.edge_model:
        options["edge_model"] = args.edge_model
    async with AsyncEdgeCloud(**options) as client:
        lines = await asyncio.gather(*(ask(client, q, args.max_tokens) for q in QUESTIONS))
        print("\n".join(lines))
        stream = await client.chat.completions.create(
            messages=[{"role": "user", "content": "Count from 1 to 5."}], stream=True, max_tokens=args.max_tokens
        )
        async for chunk in stream:
            print(chunk.text, end="", flush=True)
        print()
        print(f"[totals: {client.stats()}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
