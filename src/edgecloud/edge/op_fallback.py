"""Per-op CPU fallback: which torch ops a device cannot be trusted with, and running those on the CPU.

This module owns :class:`DeviceCaps` (what one device kind can run in one dtype),
:data:`KNOWN_GAPS` with :func:`device_caps` (the built-in capability table) and
:class:`CpuFallback`, a :class:`torch.overrides.TorchFunctionMode` that sends the declared
ops to the CPU while everything else stays on the device.

**The table.** A row names an op (a torch function or Tensor method, by its Python name:
``"scaled_dot_product_attention"``, ``"isin"``, ``"index_copy"``), a device kind, optionally
the dtypes it concerns and the torch version that fixed it, and why it is there:

- MPS, float16/bfloat16, ``scaled_dot_product_attention``: grouped-query attention with an
  explicit mask aborts the process on MPS (pytorch#149132), and half-precision SDPA had
  silent-correctness bugs (pytorch#160841, pytorch#174861). The engine's attention is exactly
  that variant (GQA, a causal mask while prefilling).
- MPS, ``isin``: ``aten::isin.Tensor_Tensor_out`` is not implemented before torch 2.4
  (pytorch#124518).
- MPS, ``index_copy``: named in issue 7; not tied to a specific PyTorch report, kept as a
  conservative default (the engine's own model code never calls it).
- MPS, bfloat16 on macOS < 14: the whole dtype is missing ("MPS BFloat16 is only supported on
  MacOS 14 or newer"); that is a dtype, not an op, so :attr:`DeviceCaps.dtype_problem` says
  so and the torch backend picks float16 instead (or refuses an explicit bf16).
- CUDA and CPU: no rows.

``PYTORCH_ENABLE_MPS_FALLBACK=1`` (set by :mod:`edgecloud.edge.torch` before torch is imported
on macOS) covers ops MPS *lacks* (a NotImplementedError otherwise); this table covers ops MPS
*has* but gets wrong, and counts every fallback it makes.

**How a fallback runs.** Inside ``with CpuFallback(caps):`` every call to a declared op (the
function, its Tensor method, and its in-place ``op_`` variant) has each tensor in its
arguments (recursively through tuples, lists and dicts) copied to the CPU, upcast where
:attr:`DeviceCaps.cpu_upcast` says the CPU path should not run that dtype, and a non-CPU
``device=`` argument replaced by ``"cpu"``; the op runs there; tensors in the result go back to
the device (and dtype) of the first tensor argument. In-place ops (``index_copy_``,
``__setitem__`` as in a KV-cache write, ``__iadd__``, ``out=``) are run on the CPU copy and the
copy is written back into the original tensor, which is then returned (so ``x.op_() is x``
still holds). The copy is made even when the device *is* the CPU, so a CPU-only machine
exercises the same path, write-back included. ``counts`` records each fallback per op.

An op declared unsupported on the device *and* on the CPU (``cpu_unsupported``; or one that
raises on the CPU) fails with :class:`~edgecloud.errors.BackendUnavailableError` (a
BackendError) naming the op: there is nowhere left to run it.

**Limits.** Declaring an op that moves tensors (``to``, ``copy_``, ``cpu``...), changes tensor
metadata in place (``resize_``, ``set_``...) or returns a view (``view``, ``transpose``,
``__getitem__``...) is refused with :class:`~edgecloud.errors.ConfigError`: the fallback is
built from the first, cannot write back the second, and would turn the third into a copy a
later write would miss. An in-place op is assumed to mutate only its first argument (and
``out=``). Only calls made through Python are seen: ops that a C++ op calls internally (say,
the softmax inside SDPA) are part of their caller. Ops run under the mode pay a small Python
cost each (a dict lookup); with no op declared no mode is installed at all.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..errors import BackendUnavailableError, ConfigError

__all__ = ["CpuFallback", "DeviceCaps", "KNOWN_GAPS", "OpGap", "device_caps", "op_name"]

#: Ops the fallback itself is made of: they can never be sent to the CPU by it.
_TRANSFER_OPS = frozenset({"to", "copy_", "cpu", "cuda", "mps", "clone", "__get__", "__set__", "contiguous"})
#: In-place ops that change a tensor's shape or storage: a CPU result cannot be written back.
_METADATA_OPS = frozenset({"resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "t_", "transpose_"})
#: Ops that return views of their input: moved back, the view would be a copy.
_VIEW_OPS = frozenset(
    {"view", "view_as", "__getitem__", "select", "narrow", "transpose", "t", "permute", "expand", "expand_as",
     "as_strided", "unsqueeze", "squeeze", "unflatten", "diagonal", "unfold", "split", "chunk", "unbind",
     "movedim", "swapaxes", "detach", "alias"}
)
_INPLACE_DUNDERS = frozenset(
    {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
     "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
)


def _namedtuple(obj: Any) -> bool:
    """A namedtuple (rebuilt from its fields, not from one iterable)."""
    return isinstance(obj, tuple) and any("_fields" in vars(k) for k in type(obj).__mro__)


def op_name(op: str | Callable[..., Any]) -> str:
    """The table's name for ``op``: ``torch.isin``, ``"Tensor.index_copy_"`` and ``"isin"`` -> its last dotted part."""
    name = op if isinstance(op, str) else op.__name__
    return name.rsplit(".", 1)[-1]


def _check_declarable(ops: Iterable[str]) -> frozenset[str]:
    names = frozenset(op_name(op) for op in ops)
    for name in sorted(names):
        if not name:
            raise ConfigError("an empty op name cannot be declared unsupported")
        if name in _TRANSFER_OPS:
            raise ConfigError(f"op {name!r} cannot fall back to the CPU: the fallback moves tensors with it")
        if name in _METADATA_OPS:
            raise ConfigError(f"op {name!r} changes tensor metadata in place; a CPU result cannot be written back")
        if name in _VIEW_OPS:
            raise ConfigError(f"op {name!r} returns a view; on the CPU it would become a copy that later writes miss")
    return names


@dataclass(frozen=True)
class OpGap:
    """One row of the built-in table: ``op`` is not to be run on ``device`` (in ``dtypes``; all if None)."""

    device: str
    op: str
    reason: str
    dtypes: frozenset[torch.dtype] | None = None
    #: First torch (major, minor) where the gap is gone; None: still open.
    fixed_in: tuple[int, int] | None = None

    def applies(self, device: str, dtype: torch.dtype, torch_version: tuple[int, int]) -> bool:
        """Whether this row concerns ``device`` (a kind: "mps") in ``dtype`` under that torch version."""
        return (
            self.device == device
            and (self.dtypes is None or dtype in self.dtypes)
            and (self.fixed_in is None or torch_version < self.fixed_in)
        )


_HALF = frozenset({torch.float16, torch.bfloat16})

#: The built-in table (the module docstring gives each row's evidence).
KNOWN_GAPS: tuple[OpGap, ...] = (
    OpGap("mps", "scaled_dot_product_attention",
          "GQA with a mask aborts on MPS (pytorch#149132); half-precision SDPA had silent-correctness bugs "
          "(pytorch#160841, #174861)", dtypes=_HALF),
    OpGap("mps", "isin", "aten::isin.Tensor_Tensor_out is not implemented on MPS (pytorch#124518)", fixed_in=(2, 4)),
    OpGap("mps", "index_copy", "named in issue 7; a conservative default, not tied to a PyTorch report"),
)
#: macOS major version from which MPS has bfloat16.
MPS_BF16_MACOS = 14


@dataclass(frozen=True)
class DeviceCaps:
    """What one device kind can run in one dtype.

    ``unsupported`` ops run on the CPU instead (:class:`CpuFallback`); ``cpu_unsupported``
    ops cannot run on the CPU either (a test profile, or a CPU build without the kernel), so
    one that is also in ``unsupported`` fails naming itself. ``cpu_upcast`` maps a dtype
    to the one the CPU path computes in. ``dtype_problem`` is non-empty when the device
    cannot use ``dtype`` at all; ``reasons`` says why each op is in ``unsupported``.
    """

    device: str
    dtype: torch.dtype
    unsupported: frozenset[str] = frozenset()
    cpu_unsupported: frozenset[str] = frozenset()
    cpu_upcast: Mapping[torch.dtype, torch.dtype] = field(default_factory=dict)
    dtype_problem: str = ""
    reasons: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "unsupported", _check_declarable(self.unsupported))
        object.__setattr__(self, "cpu_unsupported", frozenset(op_name(op) for op in self.cpu_unsupported))

    def declaring(
        self, unsupported: Iterable[str] = (), *, cpu_unsupported: Iterable[str] = (), reason: str = "declared by the caller"
    ) -> DeviceCaps:
        """These caps with more ops declared unsupported (on the device, and/or on the CPU)."""
        added = _check_declarable(unsupported)
        return replace(
            self,
            unsupported=self.unsupported | added,
            cpu_unsupported=self.cpu_unsupported | frozenset(op_name(op) for op in cpu_unsupported),
            reasons={**self.reasons, **{name: reason for name in added}},
        )

    def falls_back(self, name: str) -> bool:
        """Whether the op called ``name`` (or the op whose in-place variant it is) runs on the CPU."""
        return name in self.unsupported or (name.endswith("_") and name[:-1] in self.unsupported)

    def runs_on_cpu(self, name: str) -> bool:
        """Whether the CPU can run the op called ``name`` (False: declared missing there too)."""
        return not (name in self.cpu_unsupported or (name.endswith("_") and name[:-1] in self.cpu_unsupported))


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _macos_major() -> int | None:
    release = platform.mac_ver()[0]
    return int(release.split(".")[0]) if release else None


def device_caps(
    device: str,
    dtype: torch.dtype,
    *,
    torch_version: tuple[int, int] | None = None,
    macos_major: int | None = None,
) -> DeviceCaps:
    """The built-in caps of ``device`` (``"cpu"``, ``"cuda"``, ``"mps"``; an index is ignored) in ``dtype``.

    ``torch_version`` and ``macos_major`` default to this machine's (tests pass others).
    """
    kind = torch.device(device).type
    version = torch_version or _torch_version()
    gaps = [gap for gap in KNOWN_GAPS if gap.applies(kind, dtype, version)]
    problem = ""
    if kind == "mps" and dtype == torch.bfloat16:
        macos = macos_major if macos_major is not None else _macos_major()
        if macos is not None and macos < MPS_BF16_MACOS:
            problem = f"MPS has bfloat16 only on macOS {MPS_BF16_MACOS} or newer (this is macOS {macos})"
    # The CPU's half-precision kernels are slow or missing for some ops: compute MPS fallbacks in float32.
    upcast = {torch.float16: torch.float32} if kind == "mps" else {}
    return DeviceCaps(
        device=kind,
        dtype=dtype,
        unsupported=frozenset(gap.op for gap in gaps),
        cpu_upcast=upcast,
        dtype_problem=problem,
        reasons={gap.op: gap.reason for gap in gaps},
    )


class _Moves:
    """The tensors of one call copied to the CPU, and how to undo that for its results."""

    def __init__(self, upcast: Mapping[torch.dtype, torch.dtype]) -> None:
        self.upcast = upcast
        self.home: torch.device | None = None
        self.downcast: dict[torch.dtype, torch.dtype] = {}
        self.copies: dict[int, Tensor] = {}  # id(original) -> its CPU copy

    def to_cpu(self, obj: Any) -> Any:
        if isinstance(obj, Tensor):
            if self.home is None:
                self.home = obj.device
            target = self.upcast.get(obj.dtype, obj.dtype)
            if target != obj.dtype:
                self.downcast[target] = obj.dtype
            copy = self.copies.get(id(obj))
            if copy is None:
                # copy=True even on the CPU: an in-place op must never write the original behind our back
                copy = self.copies[id(obj)] = obj.to("cpu", target, copy=True)
            return copy
        if _namedtuple(obj):
            return type(obj)(*(self.to_cpu(x) for x in obj))
        if isinstance(obj, (tuple, list)) and not isinstance(obj, torch.Size):
            return type(obj)(self.to_cpu(x) for x in obj)
        if isinstance(obj, dict):
            return {k: self.to_cpu(v) for k, v in obj.items()}
        return obj

    def back(self, obj: Any) -> Any:
        if isinstance(obj, Tensor):
            dtype = self.downcast.get(obj.dtype, obj.dtype)
            return obj.to(self.home or obj.device, dtype)
        if _namedtuple(obj):
            return type(obj)(*(self.back(x) for x in obj))
        if isinstance(obj, (tuple, list)) and not isinstance(obj, torch.Size):
            return type(obj)(self.back(x) for x in obj)
        return obj


class CpuFallback(TorchFunctionMode):
    """While active, the ops ``caps`` declares unsupported run on the CPU; ``counts`` records each.

    Enter it around model calls only (not across a generator's ``yield``): torch function
    modes are a per-thread stack, and one left active would also catch the caller's ops.
    """

    def __init__(self, caps: DeviceCaps) -> None:
        super().__init__()
        self.caps = caps
        #: Fallbacks made so far, per op name.
        self.counts: dict[str, int] = {}
        self._decisions: dict[Any, str | None] = {}

    @property
    def total(self) -> int:
        """All fallbacks made so far."""
        return sum(self.counts.values())

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        try:
            name = self._decisions[func]
        except (KeyError, TypeError):  # TypeError: an unhashable callable; decide every time
            name = op_name(func)
            name = name if self.caps.falls_back(name) else None
            try:
                self._decisions[func] = name
            except TypeError:
                pass
        if name is None:
            return func(*args, **kwargs)
        return self._run_on_cpu(func, name, args, kwargs)

    def _run_on_cpu(self, func: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        caps = self.caps
        if not caps.runs_on_cpu(name):
            raise BackendUnavailableError(
                f"op {name!r} is not supported on {caps.device} ({caps.dtype}) nor on the CPU fallback; "
                "run the model on another device or dtype"
            )
        moves = _Moves(caps.cpu_upcast)
        cpu_args, cpu_kwargs = moves.to_cpu(args), moves.to_cpu(kwargs)
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            moves.home = moves.home or torch.device(device)
            cpu_kwargs["device"] = "cpu"
        try:
            result = func(*cpu_args, **cpu_kwargs)
        except (RuntimeError, NotImplementedError) as exc:
            raise BackendUnavailableError(
                f"op {name!r} is not supported on {caps.device} ({caps.dtype}) and failed on the CPU fallback: {exc}"
            ) from exc
        self.counts[name] = self.counts.get(name, 0) + 1
        written = _written(name, args, kwargs, cpu_args, cpu_kwargs)
        for original, copy in written:
            original.copy_(copy)
        for original, copy in written:
            if result is copy:
                return original  # ``x.op_() is x`` holds as it does on the device
        return moves.back(result)


def _written(
    name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], cpu_args: tuple[Any, ...], cpu_kwargs: Mapping[str, Any]
) -> list[tuple[Tensor, Tensor]]:
    """(original, CPU copy) of every tensor the call mutates: an in-place op's self, and ``out=``."""
    pairs: list[tuple[Tensor, Tensor]] = []
    in_place = name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))
    if in_place and args and isinstance(args[0], Tensor):
        pairs.append((args[0], cpu_args[0]))
    out = kwargs.get("out")
    if isinstance(out, Tensor):
        pairs.append((out, cpu_kwargs["out"]))
    elif isinstance(out, (tuple, list)):
        pairs.extend(zip(out, cpu_kwargs["out"]))
    return pairs
