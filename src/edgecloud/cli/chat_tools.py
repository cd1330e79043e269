"""``edgecloud chat --tools FILE.json``: a tool loop in the terminal.

This module owns :func:`load_tools` and :func:`run_call`. ``FILE.json`` is a list of OpenAI
function tools, each with a ``run`` command (argv; relative paths are relative to the file,
``python`` is this interpreter): when the model calls a tool, its command runs with the call's
arguments as JSON on stdin, and what it prints is the tool's result, sent back to the model as a
``tool`` message; the model then answers (or calls again, up to :data:`MAX_ROUNDS` rounds).
``examples/tools/tools.json`` holds a calculator.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..tools.spec import ToolCall, ToolSpec

__all__ = ["LocalTool", "MAX_ROUNDS", "load_tools", "run_call"]

#: Most model turns one question may take in a tool loop.
MAX_ROUNDS = 5
#: Seconds a tool command may run.
TOOL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class LocalTool:
    """A tool the chat can run: its OpenAI spec and the command that computes it."""

    spec: dict[str, Any]
    argv: list[str]
    cwd: Path


def load_tools(path: Path) -> dict[str, LocalTool]:
    """The tools in ``path`` by name (ConfigError saying what is wrong otherwise)."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the tools file {path}: {exc}") from exc
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path} must hold a JSON list of tools ([{{'type': 'function', 'function': {{...}}, 'run': [...]}}])")
    tools: dict[str, LocalTool] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ConfigError(f"{path}: tool {i} is not a JSON object")
        argv = entry.get("run")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise ConfigError(f"{path}: tool {i} needs 'run', the command to compute it as a list of strings")
        spec = {k: v for k, v in entry.items() if k != "run"}
        try:
            parsed = ToolSpec.model_validate(spec)
        except ValueError as exc:
            raise ConfigError(f"{path}: tool {i} is not an OpenAI function tool: {exc}") from exc
        argv = [sys.executable if a == "python" and n == 0 else a for n, a in enumerate(argv)]
        tools[parsed.function.name] = LocalTool(spec=spec, argv=argv, cwd=path.resolve().parent)
    return tools


def run_call(tools: dict[str, LocalTool], call: ToolCall) -> str:
    """The result of one call: the tool command's output, or what went wrong (the model reads it)."""
    tool = tools.get(call.function.name)
    if tool is None:
        return f"error: there is no tool named {call.function.name!r}"
    try:
        done = subprocess.run(tool.argv, input=call.function.arguments, capture_output=True, text=True,
                              cwd=tool.cwd, timeout=TOOL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"error: the tool could not run: {exc}"
    if done.returncode != 0:
        return f"error: the tool exited with {done.returncode}: {done.stderr.strip()[-500:]}"
    return done.stdout.strip()


def shown_arguments(call: ToolCall) -> str:
    """A call's arguments on one line for the transcript (the model may lay its JSON out over
    several lines; arguments that are not JSON are shown with their whitespace collapsed)."""
    text = call.function.arguments if call.function is not None else ""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return " ".join(text.split())
