"""Quickstart: one question through the router, streamed, then where it ran, why, and what it cost.

Run:
    python examples/app_quickstart.py "your question"
    python examples/app_quickstart.py --cloud-url http://127.0.0.1:8000 --cloud-model M "a hard question"

With no cloud configured (argument, EDGECLOUD_CLOUD_BASE_URL or edgecloud.toml) everything runs
on the default edge model, pulled on first use. A second request marked privacy="local_only"
shows that private questions stay on the device whatever the router thinks.
"""

from __future__ import annotations

import argparse
import sys

from edgecloud import EdgeCloud


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="*", help="what to ask")
    parser.add_argument("--edge-model", default=None, help="catalogue name or .gguf path (default: the SDK's)")
    parser.add_argument("--cloud-url", action="append", default=None, help="OpenAI-compatible endpoint(s)")
    parser.add_argument("--cloud-model", default=None, help="the model the endpoint serves")
    parser.add_argument("--cloud-key", default=None, help="API key (or EDGECLOUD_CLOUD_API_KEY)")
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args(argv)
    question = " ".join(args.question) or "Write a Python function that reverses a string."
    options = {"cloud_base_url": args.cloud_url, "cloud_model": args.cloud_model, "cloud_api_key": args.cloud_key}
    if args.edge_model:
        options["edge_model"] = args.edge_model

    with EdgeCloud(**options) as client:
        route, cost = None, None
        stream = client.chat.completions.create(
            messages=[{"role": "user", "content": question}], stream=True, max_tokens=args.max_tokens
        )
        for chunk in stream:
            print(chunk.text, end="", flush=True)
            route, cost = chunk.route or route, chunk.cost or cost
        print()
        if route is not None:
            print(f"[ran on {route.target}/{route.backend}: {route.reason}]", file=sys.stderr)
            if route.tokens is not None:  # who wrote the answer (token mode shares it)
                print(f"[tokens written: edge {route.tokens['edge']}, cloud {route.tokens['cloud']}, "
                      f"{route.cloud_calls} cloud calls]", file=sys.stderr)
            for switch in route.fallbacks:
                print(f"[fell back {switch['from']} -> {switch['to']}: {switch['cause']}]", file=sys.stderr)
        if cost is not None:
            print(f"[cost ${cost.usd:.6f}, saved ${cost.saved_usd:.6f} vs the cloud]", file=sys.stderr)

        private = client.chat.completions.create(
            messages=[{"role": "user", "content": "My card is 4111 1111 1111 1111. Is it a Visa card?"}],
            max_tokens=32, privacy="local_only",
        )
        assert private.route is not None and private.route.target == "edge"
        print(f"[private question answered on the {private.route.target}: {private.route.reason}]", file=sys.stderr)
        print(f"[totals: {client.stats()}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
