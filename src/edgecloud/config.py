"""Settings of the EdgeCloud client, and where they come from.

This module owns :class:`EdgeCloudSettings` (with its sections :class:`RouterSettings`,
:class:`FallbackSettings`, :class:`Prices` and :class:`CollabSettings`) and :func:`load_settings`, which layers them,
highest priority first::

    keyword overrides  >  EDGECLOUD_* environment  >  edgecloud.toml  >  defaults

The layers are pydantic-settings sources (``InitSettingsSource`` for the overrides,
``EnvSettingsSource``, ``TomlConfigSettingsSource``) put in that order by
:meth:`EdgeCloudSettings.settings_customise_sources`, and merged section by section by
pydantic-settings itself. This module adds only what those do not say: which file, and where
a bad value came from. Environment names take the ``EDGECLOUD_`` prefix and ``__`` between a
section and its key (``EDGECLOUD_ROUTER__PII=redact``). The file is the ``config`` argument when it is a path,
else ``$EDGECLOUD_CONFIG``, else ``./edgecloud.toml`` when it exists. Every field is
documented once, in its ``Field(description=...)``; :func:`to_toml_example` renders those
as a commented example file.

Every problem raises :class:`~edgecloud.errors.ConfigError` naming the key path
(``router.pii``), the bad value, what is allowed, and where the value came from (the file
path, ``environment variable EDGECLOUD_ROUTER__PII`` or ``argument``).
"""

from __future__ import annotations

import difflib
import json
import os
import sys
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, ValidationError, ValidationInfo
from pydantic import field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)
from pydantic_settings.exceptions import SettingsError

from .errors import ConfigError
from .store.catalogue import DEFAULT_EDGE_MODEL, get_entry
from .types import CollabMode

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None

__all__ = [
    "CONFIG_ENV", "DEFAULT_BACKOFF_S", "DEFAULT_CONFIG_FILE", "DEFAULT_MAX_RETRIES", "EDGE_RUNTIMES",
    "EDGE_RUNTIME_ENTRY_POINTS", "ENV_PREFIX", "EdgeCloudSettings", "EdgeRuntime", "CollabMode", "CollabSettings",
    "FallbackSettings", "Prices", "RouterSettings", "edge_runtime_names", "load_settings", "to_toml_example",
]

ENV_PREFIX = "EDGECLOUD_"
#: Environment variable naming the settings file.
CONFIG_ENV = "EDGECLOUD_CONFIG"
#: Read from the working directory when neither ``config`` nor ``$EDGECLOUD_CONFIG`` is given.
DEFAULT_CONFIG_FILE = "edgecloud.toml"
_NESTED = "__"
#: Retries of one cloud request on the same URL, and the first wait between them (doubling);
#: the HTTP client's :class:`~edgecloud.remote.retry.RetryPolicy` defaults to the same values.
DEFAULT_MAX_RETRIES = 2
DEFAULT_BACKOFF_S = 0.25


def _http_url(url: str) -> str:
    url = url.strip()
    if not url.startswith(("http://", "https://")) or not url.split("://", 1)[1]:
        raise ValueError("must be an http:// or https:// URL, e.g. https://api.openai.com/v1")
    return url


_HttpUrl = Annotated[str, AfterValidator(_http_url)]


#: The built-in edge runtimes (``edge_runtime``, ``edgecloud chat --backend``), built by
#: :func:`edgecloud.registry.make_edge_backend`; packages add more through the entry point group
#: :data:`EDGE_RUNTIME_ENTRY_POINTS` (``name = "package.module:BackendClass"``).
EdgeRuntime = Literal["llamacpp", "torch", "onnx"]
EDGE_RUNTIMES: tuple[str, ...] = get_args(EdgeRuntime)
EDGE_RUNTIME_ENTRY_POINTS = "edgecloud.edge_runtimes"


def edge_runtime_names() -> tuple[str, ...]:
    """The built-in edge runtimes, then those installed packages register (entry points)."""
    from importlib.metadata import entry_points

    plugins = sorted(ep.name for ep in entry_points(group=EDGE_RUNTIME_ENTRY_POINTS) if ep.name not in EDGE_RUNTIMES)
    return (*EDGE_RUNTIMES, *plugins)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Prices(_Section):
    """What tokens and device time cost, for :class:`~edgecloud.types.CostInfo`."""

    cloud_input_per_mtok: float = Field(0.50, ge=0, description="USD per million prompt tokens sent to the cloud.")
    cloud_output_per_mtok: float = Field(1.50, ge=0, description="USD per million tokens the cloud generates.")
    edge_per_second: float = Field(0.0, ge=0, description="USD per second of on-device generation (energy, wear).")
    cloud_cached_input_share: float = Field(
        0.1, ge=0, le=1,
        description="Prompt tokens the cloud reads from its prefix cache (usage.prompt_tokens_details.cached_tokens) "
                    "cost this share of the input price (the large APIs bill about 10 %); a cloud that reports no "
                    "cached tokens is priced as uncached.",
    )


class CacheSettings(_Section):
    """Where the edge keeps saved KV states: a RAM tier and a disk tier that outlives the process
    (a conversation's next turn after a restart loads its KV instead of recomputing it)."""

    ram_mib: int = Field(256, ge=0, description="RAM tier: MiB of saved KV states of the edge model (0: off).")
    disk_mib: int = Field(2048, ge=0, description="Disk tier: MiB of KV state files under `dir`, all models "
                                                 "together; never exceeded (0: off).")
    dir: str | None = Field(None, description="Folder of the disk tier (default: `kv` under the edgecloud cache, "
                                              "$EDGECLOUD_HOME or ~/.cache/edgecloud).",
                            examples=["~/.cache/edgecloud/kv"])

    def folder(self) -> Path:
        """The disk tier's folder (``dir`` or the default under the edgecloud cache)."""
        if self.dir:
            return Path(self.dir).expanduser()
        from .store.cache import home_dir

        return home_dir() / "kv"


class RouterSettings(_Section):
    """How a request picks the edge or the cloud (see :mod:`edgecloud.router.policy`)."""

    scorer: Literal["learned", "rules"] = Field(
        "learned", description="Difficulty scorer: the trained model ('learned') or keyword rules ('rules')."
    )
    scorer_path: Path | None = Field(
        None, description="A trained scorer file to use instead of the bundled one (relative to this file).",
        examples=["scorer.json"],
    )
    edge_below: float | None = Field(
        None, ge=0, le=1, description="Scores below this run on the edge (default: the scorer's own band; rules 0.3).",
        examples=[0.3],
    )
    cloud_above: float | None = Field(
        None, ge=0, le=1, description="Scores above this run on the cloud (default: the scorer's own band; rules 0.7).",
        examples=[0.7],
    )
    target_cloud_fraction: float | None = Field(
        None, ge=0, le=1, description="Send this share of traffic to the cloud (replaces cloud_above).",
        examples=[0.2],
    )
    pii: Literal["edge_only", "redact", "off"] = Field(
        "edge_only", description="Personal data: keep on the device, redact before the cloud, or ignore."
    )
    cascade: bool = Field(True, description="Middle-band scores try the edge first and check its answer.")

    @field_validator("cloud_above")
    @classmethod
    def _bands_ordered(cls, cloud_above: float | None, info: ValidationInfo) -> float | None:
        edge_below = info.data.get("edge_below")
        if edge_below is not None and cloud_above is not None and cloud_above < edge_below:
            raise ValueError(f"must be >= router.edge_below ({edge_below}); lower edge_below or raise cloud_above")
        return cloud_above


class FallbackSettings(_Section):
    """When a backend fails: retries, circuit breaking, and handing a request to the other side."""

    enabled: bool = Field(True, description="Retry a failed request on the other side.")
    failure_threshold: int = Field(3, ge=1, description="Consecutive failures that open a backend's circuit.")
    cooldown_s: float = Field(30.0, gt=0, description="Seconds an open circuit waits before a trial request.")
    max_retries: int = Field(
        DEFAULT_MAX_RETRIES, ge=0,
        description="Retries on the same URL of a retryable cloud error (429, 502, 503, 504, connect errors).",
    )
    backoff_s: float = Field(DEFAULT_BACKOFF_S, ge=0, description="First retry delay in seconds; doubles per retry.")
    timeout_s: float = Field(60.0, gt=0, description="Cloud read timeout in seconds.")
    connect_timeout_s: float = Field(5.0, gt=0, description="Cloud connect timeout in seconds.")
    cloud_order: Literal["in_order", "round_robin"] = Field(
        "in_order", description="Several cloud_base_url: try them in order, or rotate."
    )
    mid_stream: bool = Field(True, description="Continue a broken stream on the other side.")


class CollabSettings(_Section):
    """How the edge and the cloud share one answer (see :mod:`edgecloud.collab`)."""

    mode: CollabMode = Field(
        "auto",
        description="auto: verified mode for answers that start on the edge (when a cloud is configured; token "
                    "mode where token ids cannot be shared or the cloud holds no sessions; lead mode for a cloud that "
                    "only chats); off: one side answers; checked: the edge writes while sure and the cloud checks the "
                    "tokens it is unsure of; token: the cloud writes text spans where the edge is unsure; verified: "
                    "the cloud checks every drafted token (its greedy text, token for token); cascade: the buffered "
                    "middle-band check; lead: the cloud opens, the edge takes over where it agrees; probe: the edge's "
                    "first tokens decide whether it or the cloud writes the whole answer.",
    )
    gate_signal: Literal["entropy", "top1", "margin"] = Field(
        "top1", description="Token mode: what the gate reads from the edge's next-token distribution.",
    )
    gate: float = Field(
        0.3, ge=0, le=1,
        description="Token mode: hand a span to the cloud when the edge's unsure-score for its next token is above "
                    "this (top1: 1 - p(top token); margin: 1 - (p1 - p2); entropy: 1 - exp(-H)).",
    )
    span_tokens: int = Field(4, ge=1, le=512, description="Token mode: most tokens the cloud writes per span.")
    span_stop: Literal["line", "tokens"] = Field(
        "tokens", description="Token mode: a span also ends at the end of a line ('line') or only at span_tokens.",
    )
    span_timeout_s: float = Field(
        3.0, gt=0, description="Token mode: a span whose first token is not back in this many seconds is "
                               "dropped and the edge writes on alone.",
    )
    top_logprobs: int = Field(10, ge=2, le=20, description="Alternatives per edge token the gate reads.")
    trust: float = Field(
        0.7, ge=0, le=1,
        description="Checked mode: the edge writes a token without asking the cloud when its own probability of it is "
                    "at least this (1: every token is checked, as in verified mode; 0: the edge writes alone).",
    )
    max_calls: int | None = Field(
        None, ge=0, description="Most cloud calls (spans, checks) per answer; once spent the edge writes alone "
                                "(unset: no limit).",
        examples=[8],
    )
    probe_threshold: float | None = Field(
        None, ge=0, le=1,
        description="Probe mode: the cloud writes the whole answer when the check's score of the edge's first tokens "
                    "is at least this (0: always the cloud, 1: always the edge; unset: the packaged check's, chosen "
                    "held out by task family).",
    )
    lead_tokens: int = Field(
        16, ge=1, le=512, description="Lead mode: the cloud's tokens the edge reads before it may take over.",
    )
    lead_agree: float = Field(
        0.8125, ge=0, le=1,
        description="Lead mode: the edge takes over when its own greedy choice agrees with at least this share of "
                    "the cloud's first lead_tokens tokens, those copied from the prompt left out (lead_copy_ngram; "
                    "else the cloud writes the whole answer; 0: always take over, 1: only when it agrees with every "
                    "one). Chosen on the development corpus for 90 % of all-cloud quality, held out by task family "
                    "(benchmarks/lead_copy.py).",
    )
    lead_copy_ngram: int = Field(
        4, ge=0, le=64,
        description="Lead mode: the edge's agreement leaves out the cloud's tokens inside a stretch of at least this "
                    "many tokens the prompt holds verbatim (a signature, a restated question: agreeing with a copy "
                    "says nothing of the answer); an opening copied whole counts every token. 0: count every token.",
    )
    pipeline: bool = Field(
        True, description="Verified mode: the edge drafts on while a check is in flight and the next check goes out "
                          "as soon as the last one lands (the same text as strict rounds, sooner); false: strict "
                          "rounds (draft, then wait for the check).",
    )
    overlap: bool | None = Field(
        None, description="Verified mode with pipeline: the edge drafts while a check is computed. Unset: yes, "
                          "unless the cloud shares this process's CPUs (a loopback URL and this process not pinned "
                          "to some of the CPUs): two llama.cpp processes computing at once on the same cores slow "
                          "each other far more than twofold, so there the sides take turns.",
    )
    checks_in_flight: int = Field(
        1, ge=1, le=2,
        description="Verified mode, the edge drafting while checks are computed: how many checks may be out at "
                    "once. 1: the next check goes when the last one's answer lands. 2: while a check is out, the "
                    "edge's line past it goes to the cloud too where the edge is sure enough the first will be kept "
                    "whole (the server checks one answer's requests in arrival order); a lost bet is dropped, the "
                    "text is the same. On a CPU cloud it did not pay (benchmarks/pipeline.py: the server is busy "
                    "between checks anyway, and lost bets cost it work).",
    )
    cloud_first_token: bool = Field(
        True, description="Verified mode with pipeline: the first check carries the prompt alone and goes out at "
                          "once, so the cloud's prefill runs while the edge drafts and the first token shown is the "
                          "cloud's own (the answer starts no later than the cloud's alone).",
    )
    opening_tokens: int = Field(
        4, ge=1, le=64,
        description="Verified mode where the sides take turns (a cloud on this process's CPUs), with "
                    "cloud_first_token: the cloud writes the answer's first this-many tokens itself, streamed in one "
                    "request (a cloud that streams token ids; else one check without drafts each), before the edge "
                    "reads the prompt. An answer that short ends at the "
                    "cloud's own pace; only a longer one pays the edge's read of the prompt and its first round. "
                    "Each costs the cloud a pass and an output token billed; chosen held out by task family within "
                    "verified mode's bars on passes and bill (benchmarks/draft_stop.py opening). 1: the first only.",
    )
    stream_opening: int = Field(
        8, ge=0, le=64,
        description="Verified mode where the edge drafts while checks are out (a cloud on other CPUs), with "
                    "cloud_first_token: the cloud streams the answer's first this-many tokens itself, in one "
                    "request, at its own pace, while the edge reads the prompt and drafts past them; the checks "
                    "start after them. An answer that short is the cloud's alone, as fast as asking it; each token "
                    "costs the cloud a decoding step and an output token billed. Needs a cloud that streams token "
                    "ids (edgecloud serve, vLLM; others: the prompt's check alone). 0: off.",
    )
    draft_confidence: float = Field(
        0.7, ge=0, le=1,
        description="Verified mode's greedy plain answers where the sides take turns (strict rounds, or a cloud on "
                    "this process's CPUs): a block ends after a drafted token the edge is less sure of than this (its "
                    "probability of its own pick; the block always holds draft_min tokens), else at draft_max. The "
                    "tokens it would draft after it are mostly rejected, and each costs a draft step and a position "
                    "the cloud checks on the user's clock, and an input token billed. 0: blocks of the length the "
                    "measured costs favour. Chosen held out by task family (benchmarks/draft_stop.py).",
    )
    draft_min: int = Field(1, ge=1, le=64, description="Checked and verified mode: fewest tokens one check sends.")
    draft_max: int = Field(
        15, ge=1, le=64,
        description="Checked and verified mode: most tokens one check sends. 15 (a batch of 16 with the cloud's "
                    "last token): llama.cpp on a CPU checks 16 tokens faster than 13 (benchmarks/pipeline.py "
                    "breakdown); on a GPU a pass costs about the same up to far larger batches.",
    )

    @field_validator("draft_max")
    @classmethod
    def _draft_range(cls, draft_max: int, info: ValidationInfo) -> int:
        draft_min = info.data.get("draft_min")
        if draft_min is not None and draft_max < draft_min:
            raise ValueError(f"must be >= collab.draft_min ({draft_min}); lower draft_min or raise draft_max")
        return draft_max


class EdgeCloudSettings(BaseSettings):
    """Everything the client reads at start-up. Build it with :func:`load_settings`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter=_NESTED, extra="forbid", validate_assignment=True
    )

    edge_model: str | None = Field(
        DEFAULT_EDGE_MODEL,
        description="On-device model: a catalogue name or a GGUF path ('' for cloud only).",
    )
    edge_runtime: str = Field(
        "llamacpp",
        description="Edge runtime: llama.cpp (INT4 as is), torch (cuda/mps/cpu, per-op CPU fallback), onnx "
                    "(onnxruntime-genai; edge_model is then an `edgecloud export onnx` folder), or one an installed "
                    "package registers (entry point group edgecloud.edge_runtimes).",
    )
    edge_speculate: str = Field(
        "auto",
        description="Speculative decoding on the device (llama.cpp runtime): auto (prompt lookup, the default), ngram, "
                    "off, or a smaller draft model of the same family (catalogue name or .gguf path). Greedy text is "
                    "unchanged; answers that copy from their prompt come faster.",
        examples=["auto", "off", "qwen2.5-coder-0.5b-instruct-q4"],
    )
    edge_draft_model: str | None = Field(
        "auto",
        description="The file verified mode drafts with (llama.cpp runtime; the cloud checks every drafted token, so "
                    "it never changes the text): auto (the faster file the catalogue names for edge_model, loaded "
                    "beside it on first use: for the default 0.5B, the same model requantized as IQ4_NL, 1.8x faster "
                    "to decode; where it has none, edge_model itself), a catalogue name or .gguf path of the same "
                    "family, or '' for edge_model itself (one file in memory).",
        examples=["auto", "", "qwen2.5-coder-0.5b-instruct-iq4nl"],
    )
    cloud_base_url: Annotated[list[_HttpUrl], NoDecode] = Field(
        default_factory=list, description="OpenAI-compatible endpoints (a list, or comma-separated).",
        examples=[["https://api.openai.com/v1"]],
    )
    cloud_api_key: SecretStr | None = Field(
        None, description="Cloud API key; prefer the EDGECLOUD_CLOUD_API_KEY variable to a file.",
        examples=["sk-..."],
    )
    cloud_model: str | None = Field(None, description="Model name sent to the cloud.", examples=["gpt-4o-mini"])
    n_ctx: int | None = Field(
        None, gt=0, description="Edge context window in tokens (default: planned from memory).", examples=[4096]
    )
    router: RouterSettings = Field(default_factory=RouterSettings, description="Routing.")
    fallback: FallbackSettings = Field(default_factory=FallbackSettings, description="Failures and fallback.")
    prices: Prices = Field(default_factory=Prices, description="Prices for cost reporting.")
    collab: CollabSettings = Field(default_factory=CollabSettings, description="Edge-cloud collaboration per answer.")
    cache: CacheSettings = Field(default_factory=CacheSettings, description="Saved KV states of the edge (RAM, disk).")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Arguments first, then what :func:`load_settings` chose (the environment, then the
        TOML file), else the environment alone."""
        lower = _LOWER_SOURCES.get()
        return (init_settings, *(lower if lower is not None else (env_settings,)))

    @field_validator("edge_speculate")
    @classmethod
    def _speculate_named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("edge_speculate is empty: use auto, off, ngram, or a draft model's catalogue name or path")
        return value.strip()

    @field_validator("edge_draft_model")
    @classmethod
    def _draft_model_known(cls, value: str | None) -> str | None:
        if value is None or value == "auto" or get_entry(value) is not None or Path(value).expanduser().is_file():
            return value
        raise ValueError(f"no catalogue model and no file is named {value!r}: use auto, '' (the edge model drafts "
                         "itself), a catalogue name (`edgecloud models list`) or the path of a .gguf file")

    @field_validator("edge_runtime")
    @classmethod
    def _known_runtime(cls, runtime: str) -> str:
        names = edge_runtime_names()
        if runtime not in names:
            raise ValueError(f"unknown edge runtime; use one of {', '.join(names)}")
        return runtime

    @field_validator("edge_model", "cloud_model", "edge_draft_model", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        # TOML has no null and an environment variable is always a string: '' means "none".
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("cloud_base_url", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    return json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"looks like a JSON list but is not one ({exc})") from exc
            return [part for part in (p.strip() for p in text.split(",")) if part]
        return value


_SECTIONS: dict[str, type[BaseModel]] = {
    "router": RouterSettings, "fallback": FallbackSettings, "prices": Prices, "collab": CollabSettings,
    "cache": CacheSettings,
}
_SECRETS = {"cloud_api_key"}


# ---------------------------------------------------------------------------------- layers

#: The sources below the arguments for the settings being built now (set by load_settings).
_LOWER_SOURCES: ContextVar[tuple[PydanticBaseSettingsSource, ...] | None] = ContextVar("_LOWER_SOURCES", default=None)


@dataclass
class _Layer:
    """One source of settings: the source, its data, and how to name it in an error."""

    source: str
    data: dict[str, Any]
    settings_source: PydanticBaseSettingsSource | None = None

    def describe(self, path: tuple[Any, ...]) -> str:
        return self.source


class _EnvLayer(_Layer):
    def describe(self, path: tuple[Any, ...]) -> str:
        names = {k.upper(): k for k in os.environ}
        keys = [str(p) for p in path if isinstance(p, str)]
        for n in range(len(keys), 0, -1):
            name = (ENV_PREFIX + _NESTED.join(keys[:n])).upper()
            if name in names:
                return f"environment variable {names[name]}"
        return "the environment"


class _TomlFile(TomlConfigSettingsSource):
    """``edgecloud.toml`` as a pydantic-settings source, with the errors a user can act on: a file
    that was named but is missing, unreadable or not TOML is a ConfigError; a ``scorer_path``
    written in the file means "next to this file", wherever the program runs from."""

    def __init__(self, path: Path, named_by: str) -> None:
        if tomllib is None:  # pragma: no cover - Python 3.10 without tomli
            raise ConfigError(f"reading {path} on Python 3.10 needs tomli: pip install tomli")
        if not path.is_file():
            raise ConfigError(f"config file {path} ({named_by}) does not exist; fix the path")
        try:
            super().__init__(EdgeCloudSettings, toml_file=path, deep_merge=True)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path} ({named_by}): {exc}") from exc
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}; fix the syntax") from exc
        router = self.toml_data.get("router")
        if isinstance(router, dict) and isinstance(router.get("scorer_path"), str):
            scorer = Path(router["scorer_path"]).expanduser()
            router["scorer_path"] = str(scorer if scorer.is_absolute() else path.parent / scorer)
            self.init_kwargs = self.toml_data


def _source_layer(name: str, source: PydanticBaseSettingsSource, layer: type[_Layer] = _Layer) -> _Layer:
    return layer(name, source(), source)


def _mapping_layer(name: str, data: Mapping[str, Any]) -> _Layer:
    return _source_layer(name, InitSettingsSource(EdgeCloudSettings, init_kwargs=_plain(data)))


def _file_layer(config: Any) -> _Layer | None:
    """The TOML layer: ``config`` (a path or mapping), else $EDGECLOUD_CONFIG, else ./edgecloud.toml."""
    if isinstance(config, Mapping):
        return _mapping_layer("the config mapping", config)
    if config is not None:
        path = Path(os.fspath(config)).expanduser()
        return _source_layer(str(path), _TomlFile(path, "the config argument"))
    if os.environ.get(CONFIG_ENV):
        path = Path(os.environ[CONFIG_ENV]).expanduser()
        return _source_layer(str(path), _TomlFile(path, f"environment variable {CONFIG_ENV}"))
    default = Path(DEFAULT_CONFIG_FILE)
    if default.is_file():
        return _source_layer(str(default.resolve()), _TomlFile(default, "found in the working directory"))
    return None


def _check_env_names() -> None:
    """Catch EDGECLOUD_* names that look like a misspelt setting (others belong to other tools)."""
    fields = list(EdgeCloudSettings.model_fields)
    for name in os.environ:
        if not name.upper().startswith(ENV_PREFIX) or name.upper() == CONFIG_ENV:
            continue
        key = name[len(ENV_PREFIX):].lower()
        if key.split(_NESTED)[0] in fields:
            continue  # a real setting; a bad nested key is caught by validation
        section = next((s for s in _SECTIONS if key.startswith(s + "_")), None)
        if section is not None:
            hint = f"{ENV_PREFIX}{section.upper()}{_NESTED}{key[len(section) + 1:].upper()}"
        else:
            close = difflib.get_close_matches(key, fields, n=1, cutoff=0.85)
            if not close:
                continue
            hint = ENV_PREFIX + close[0].upper()
        raise ConfigError(
            f"environment variable {name} is not an edgecloud setting; did you mean {hint}? "
            f"(sections and keys are joined by '{_NESTED}')"
        )


def _env_layer() -> _Layer:
    _check_env_names()
    try:
        return _source_layer("the environment", EnvSettingsSource(EdgeCloudSettings), _EnvLayer)
    except SettingsError as exc:
        raise ConfigError(f"cannot parse an {ENV_PREFIX}* environment variable: {exc}") from exc


def _plain(value: Any, *, drop_none: bool = False) -> Any:
    """Mappings and pydantic models as plain nested dicts (models: only the fields they set)."""
    if isinstance(value, BaseModel):
        value = value.model_dump(exclude_unset=True)
    if isinstance(value, Mapping):
        return {
            str(k): _plain(v, drop_none=drop_none) for k, v in value.items() if not (drop_none and v is None)
        }
    return value


# ---------------------------------------------------------------------------------- errors


def _lookup(data: Any, path: tuple[Any, ...]) -> bool:
    for part in path:
        if isinstance(data, Mapping) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        else:
            return False
    return True


def _source_of(path: tuple[Any, ...], layers: list[_Layer]) -> str:
    """The highest-priority layer that set ``path`` (or the nearest enclosing key, e.g. a URL list string)."""
    for n in range(len(path), 0, -1):
        for layer in reversed(layers):
            if _lookup(layer.data, path[:n]):
                return layer.describe(path[:n])
    return "the defaults"


def _key_path(path: tuple[Any, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(path))


def _known_keys(section: tuple[Any, ...]) -> list[str]:
    model = _SECTIONS.get(str(section[0])) if section else None
    return list((model or EdgeCloudSettings).model_fields)


def _describe_error(err: Mapping[str, Any], layers: list[_Layer]) -> str:
    path = tuple(err["loc"])
    key = _key_path(path)
    source = _source_of(path, layers)
    if err["type"] == "extra_forbidden":
        known = ", ".join(_known_keys(path[:-1]))
        return f"unknown key {key!r} (from {source}); check its spelling - known keys here: {known}"
    value = "'***'" if path and path[0] in _SECRETS else repr(err["input"])
    allowed = str(err["msg"]).removeprefix("Value error, ")
    return f"invalid {key} = {value} (from {source}): {allowed}"


def _config_error(exc: ValidationError, layers: list[_Layer]) -> ConfigError:
    problems = [_describe_error(err, layers) for err in exc.errors()]
    if len(problems) == 1:
        return ConfigError(problems[0])
    return ConfigError(f"{len(problems)} settings are invalid:\n  " + "\n  ".join(problems))


# ---------------------------------------------------------------------------------- entry points


def load_settings(
    config: str | os.PathLike[str] | Mapping[str, Any] | EdgeCloudSettings | None = None,
    **overrides: Any,
) -> EdgeCloudSettings:
    """Resolve the client's settings: ``overrides`` > ``EDGECLOUD_*`` > TOML file > defaults.

    ``config`` is a TOML file path, a mapping shaped like the file's content, or finished
    :class:`EdgeCloudSettings` (then neither the environment nor a file is read; only the
    overrides apply). Overrides whose value is ``None`` - at any depth - count as not given;
    nested overrides (``router={"pii": "redact"}`` or a section model, of which only the
    fields it set count) merge field by field over the lower layers. Raises
    :class:`~edgecloud.errors.ConfigError` for a missing file, bad TOML, or a bad value.
    """
    lower: list[_Layer]  # lowest priority first
    if isinstance(config, EdgeCloudSettings):
        lower = [_mapping_layer("the given settings", config.model_dump())]
    else:
        file_layer = _file_layer(config)
        lower = [*([file_layer] if file_layer else []), _env_layer()]
    given = _plain(overrides, drop_none=True)
    layers = [*lower, _Layer("argument", given)]
    token = _LOWER_SOURCES.set(tuple(layer.settings_source for layer in reversed(lower) if layer.settings_source))
    try:
        return EdgeCloudSettings(**given)
    except ValidationError as exc:
        raise _config_error(exc, layers) from exc
    except SettingsError as exc:
        raise ConfigError(f"cannot read the settings: {exc}") from exc
    finally:
        _LOWER_SOURCES.reset(token)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string


def _field_lines(name: str, field: FieldInfo) -> list[str]:
    default = field.get_default(call_default_factory=True)
    lines = [f"# {field.description}"]
    if default is None or default == []:
        example = field.examples[0] if field.examples else None
        lines.append(f"# {name} = {_toml_value(example)}" if example is not None else f"# {name} =")
    else:
        lines.append(f"{name} = {_toml_value(default)}")
    return lines


def to_toml_example() -> str:
    """A commented ``edgecloud.toml`` holding every default (optional keys commented out)."""
    lines = [
        "# edgecloud.toml - settings of the EdgeCloud client. Every key is optional.",
        f"# Override any key with {ENV_PREFIX}<KEY> or {ENV_PREFIX}<SECTION>{_NESTED}<KEY> variables.",
    ]
    for name, field in EdgeCloudSettings.model_fields.items():
        if name not in _SECTIONS:
            lines += ["", *_field_lines(name, field)]
    for name, model in _SECTIONS.items():
        lines += ["", f"[{name}]  # {EdgeCloudSettings.model_fields[name].description}"]
        for key, field in model.model_fields.items():
            lines += _field_lines(key, field)
    return "\n".join(lines) + "\n"
