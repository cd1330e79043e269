"""A minimal app: ask the default edge model a question, streamed, then print where it ran.

Run: python examples/app.py "your question"   (the model is pulled on first use)
"""

from __future__ import annotations

import sys

from edgecloud import EdgeCloud


def main() -> None:
    question = " ".join(sys.argv[1:]) or "Write a Python function that reverses a string."
    with EdgeCloud() as client:
        route = None
        for chunk in client.chat.completions.create(
            messages=[{"role": "user", "content": question}], stream=True, max_tokens=256
        ):
            print(chunk.text, end="", flush=True)
            route = chunk.route or route
        print()
        if route is not None:
            print(f"[ran on {route.target}/{route.backend}: {route.reason}]", file=sys.stderr)


if __name__ == "__main__":
    main()
