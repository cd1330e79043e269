"""A tool for ``edgecloud chat --tools examples/tools/tools.json``: reads the call's arguments
(``{"expression": "..."}``) as JSON on stdin and prints the value of the arithmetic expression.
Only numbers, + - * / // % ** and parentheses are evaluated (no names, no calls)."""

from __future__ import annotations

import ast
import json
import operator
import sys

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        if isinstance(node.op, ast.Pow) and abs(evaluate(node.right)) > 100:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](evaluate(node.left), evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


def main() -> None:
    args = json.load(sys.stdin)
    try:
        value = evaluate(ast.parse(str(args["expression"]), mode="eval"))
    except (KeyError, SyntaxError, ValueError, ZeroDivisionError) as exc:
        print(f"error: {exc}")
        return
    print(int(value) if isinstance(value, float) and value.is_integer() else value)


if __name__ == "__main__":
    main()
