"""load_settings: defaults < TOML file < EDGECLOUD_* environment < keyword overrides, and its errors."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from edgecloud.config import EdgeCloudSettings, RouterSettings, load_settings, to_toml_example, tomllib
from edgecloud.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No EDGECLOUD_* variables and an empty working directory (no stray ./edgecloud.toml)."""
    for name in list(os.environ):
        if name.upper().startswith("EDGECLOUD_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults() -> None:
    s = load_settings()
    assert s.edge_model == "qwen2.5-coder-0.5b-instruct-q4"
    assert s.cloud_base_url == [] and s.cloud_api_key is None and s.cloud_model is None
    # bands unset: the policy takes the scorer's own (the rules': the design notes' 0.3 / 0.7)
    assert (s.router.scorer, s.router.edge_below, s.router.cloud_above, s.router.pii) == ("learned", None, None, "edge_only")
    assert (s.fallback.failure_threshold, s.fallback.cooldown_s, s.fallback.cloud_order) == (3, 30.0, "in_order")
    assert (s.prices.cloud_input_per_mtok, s.prices.cloud_output_per_mtok, s.prices.edge_per_second) == (0.5, 1.5, 0.0)


def test_toml_file(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    path = write(tmp_path / "conf" / "ec.toml", """
cloud_base_url = "https://api.example.com/v1"
cloud_model = "gpt-4o-mini"
n_ctx = 2048
[router]
pii = "redact"
scorer_path = "models/scorer.json"
[prices]
cloud_output_per_mtok = 10
""")
    s = load_settings(path)
    assert s.cloud_base_url == ["https://api.example.com/v1"]
    assert (s.cloud_model, s.n_ctx, s.router.pii, s.prices.cloud_output_per_mtok) == ("gpt-4o-mini", 2048, "redact", 10.0)
    assert s.router.scorer_path == tmp_path / "conf" / "models" / "scorer.json"  # relative to the file
    assert s.router.edge_below is None and s.router.cascade is True  # untouched keys keep their defaults


def test_file_is_found_in_cwd_then_via_edgecloud_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "edgecloud.toml", 'cloud_model = "from-cwd"\n')
    assert load_settings().cloud_model == "from-cwd"
    other = write(tmp_path / "other.toml", 'cloud_model = "from-env-path"\n')
    monkeypatch.setenv("EDGECLOUD_CONFIG", str(other))
    assert load_settings().cloud_model == "from-env-path"


def test_env_over_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "ec.toml", 'cloud_model = "file"\n[router]\npii = "off"\nedge_below = 0.1\n')
    monkeypatch.setenv("EDGECLOUD_CLOUD_MODEL", "env")
    monkeypatch.setenv("EDGECLOUD_ROUTER__PII", "redact")
    s = load_settings(path)
    assert (s.cloud_model, s.router.pii, s.router.edge_below) == ("env", "redact", 0.1)


def test_overrides_over_env_field_by_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "ec.toml", '[router]\nedge_below = 0.1\npii = "off"\n')
    monkeypatch.setenv("EDGECLOUD_CLOUD_MODEL", "env")
    monkeypatch.setenv("EDGECLOUD_ROUTER__CASCADE", "false")
    s = load_settings(path, cloud_model="arg", router={"pii": "redact"}, n_ctx=None)
    assert s.cloud_model == "arg"
    # the nested override replaced one field; the file's and the environment's others stay
    assert (s.router.pii, s.router.edge_below, s.router.cascade) == ("redact", 0.1, False)
    assert s.n_ctx is None
    # None counts as "not given", also nested; a section model contributes only the fields it set
    s = load_settings(path, cloud_model=None, router=RouterSettings(cloud_above=0.9))
    assert (s.cloud_model, s.router.cloud_above, s.router.edge_below) == ("env", 0.9, 0.1)


def test_comma_separated_and_json_urls_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGECLOUD_CLOUD_BASE_URL", " http://a:8000/v1 , https://b/v1")
    assert load_settings().cloud_base_url == ["http://a:8000/v1", "https://b/v1"]
    monkeypatch.setenv("EDGECLOUD_CLOUD_BASE_URL", '["https://c/v1"]')
    assert load_settings().cloud_base_url == ["https://c/v1"]
    assert load_settings(cloud_base_url="https://d/v1").cloud_base_url == ["https://d/v1"]


def test_nested_env_and_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGECLOUD_PRICES__CLOUD_INPUT_PER_MTOK", "2")
    monkeypatch.setenv("EDGECLOUD_FALLBACK__MID_STREAM", "0")
    monkeypatch.setenv("EDGECLOUD_CLOUD_API_KEY", "sk-test")
    monkeypatch.setenv("EDGECLOUD_EDGE_MODEL", "")  # cloud only
    monkeypatch.setenv("EDGECLOUD_HOME", "/somewhere")  # another tool's variable: ignored
    s = load_settings()
    assert s.prices.cloud_input_per_mtok == 2.0 and s.fallback.mid_stream is False
    assert s.cloud_api_key is not None and s.cloud_api_key.get_secret_value() == "sk-test"
    assert "sk-test" not in repr(s)
    assert s.edge_model is None


def test_mapping_and_settings_as_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGECLOUD_CLOUD_MODEL", "env")
    s = load_settings({"cloud_model": "map", "router": {"pii": "off"}})
    assert (s.cloud_model, s.router.pii) == ("env", "off")  # a mapping is a file: env wins
    given = EdgeCloudSettings.model_validate({"cloud_model": "given", "n_ctx": 512})
    s = load_settings(given, n_ctx=1024)
    assert (s.cloud_model, s.n_ctx) == ("given", 1024)  # finished settings: env not read again


# ---------------------------------------------------------------------------------- errors


def test_missing_explicit_file_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "nope.toml")) + ".*does not exist"):
        load_settings(tmp_path / "nope.toml")
    monkeypatch.setenv("EDGECLOUD_CONFIG", str(tmp_path / "gone.toml"))
    with pytest.raises(ConfigError, match="gone.toml.*EDGECLOUD_CONFIG"):
        load_settings()


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.toml", '[router]\npii = "redact\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert str(path) in str(info.value) and "invalid TOML" in str(info.value) and "line 2" in str(info.value)


def test_bad_value_in_file_names_key_value_allowed_and_file(tmp_path: Path) -> None:
    path = write(tmp_path / "ec.toml", '[router]\npii = "sometimes"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    msg = str(info.value)
    assert "router.pii" in msg and "'sometimes'" in msg and "'edge_only'" in msg and "'redact'" in msg
    assert f"from {path}" in msg


def test_bad_value_in_env_names_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "ec.toml", '[router]\npii = "off"\n')
    monkeypatch.setenv("EDGECLOUD_ROUTER__PII", "nope")
    with pytest.raises(ConfigError, match=r"router\.pii = 'nope' \(from environment variable EDGECLOUD_ROUTER__PII\)"):
        load_settings(path)
    monkeypatch.delenv("EDGECLOUD_ROUTER__PII")
    monkeypatch.setenv("EDGECLOUD_PRICES__EDGE_PER_SECOND", "-1")
    with pytest.raises(ConfigError, match=r"prices\.edge_per_second.*EDGECLOUD_PRICES__EDGE_PER_SECOND.*greater than or equal to 0"):
        load_settings(path)


def test_bad_argument_names_argument() -> None:
    with pytest.raises(ConfigError, match=r"fallback\.failure_threshold = 0 \(from argument\).*greater than or equal to 1"):
        load_settings(fallback={"failure_threshold": 0})
    with pytest.raises(ConfigError, match="unknown key 'cloud_modle' .*from argument.*cloud_model"):
        load_settings(cloud_modle="x")
    with pytest.raises(ConfigError, match=r"collab\.lead_copy_ngram = -1 \(from argument\).*greater than or equal to 0"):
        load_settings(collab={"lead_copy_ngram": -1})


def test_unknown_key_in_file_lists_known_keys(tmp_path: Path) -> None:
    path = write(tmp_path / "ec.toml", '[router]\npiii = "redact"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    msg = str(info.value)
    assert "'router.piii'" in msg and str(path) in msg and "pii" in msg.split("known keys here:")[1]


def test_env_typos_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGECLOUD_ROUTER__PIII", "redact")
    with pytest.raises(ConfigError, match="unknown key 'router.piii'.*EDGECLOUD_ROUTER__PIII"):
        load_settings()
    monkeypatch.delenv("EDGECLOUD_ROUTER__PIII")
    monkeypatch.setenv("EDGECLOUD_ROUTER_PII", "redact")
    with pytest.raises(ConfigError, match="EDGECLOUD_ROUTER_PII is not an edgecloud setting; did you mean EDGECLOUD_ROUTER__PII"):
        load_settings()
    monkeypatch.delenv("EDGECLOUD_ROUTER_PII")
    monkeypatch.setenv("EDGECLOUD_CLOUD_BASEURL", "http://x")
    with pytest.raises(ConfigError, match="did you mean EDGECLOUD_CLOUD_BASE_URL"):
        load_settings()


def test_bad_url_names_its_position(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGECLOUD_CLOUD_BASE_URL", "https://ok/v1,api.example.com")
    with pytest.raises(ConfigError) as info:
        load_settings()
    msg = str(info.value)
    assert "cloud_base_url[1] = 'api.example.com'" in msg and "http:// or https://" in msg
    assert "environment variable EDGECLOUD_CLOUD_BASE_URL" in msg


def test_bands_must_be_ordered_and_secrets_are_masked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"router\.cloud_above = 0\.5 \(from argument\): must be >= router\.edge_below \(0\.6\)"):
        load_settings(router={"edge_below": 0.6, "cloud_above": 0.5})
    path = write(tmp_path / "ec.toml", "cloud_api_key = 12345\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert "cloud_api_key = '***'" in str(info.value) and "12345" not in str(info.value)


def test_several_errors_are_all_reported() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(n_ctx=0, router={"pii": "x"})
    assert str(info.value).startswith("2 settings are invalid") and "n_ctx" in str(info.value) and "router.pii" in str(info.value)


# ---------------------------------------------------------------------------------- example file


def test_toml_example_holds_the_defaults_and_its_commented_keys_are_valid(tmp_path: Path) -> None:
    example = to_toml_example()
    assert load_settings(write(tmp_path / "a.toml", example)) == EdgeCloudSettings.model_validate({})
    assert set(tomllib.loads(example)) >= {"edge_model", "router", "fallback", "prices"}
    uncommented = re.sub(r"^# (\w+ = .+)$", r"\1", example, flags=re.MULTILINE)
    s = load_settings(write(tmp_path / "b.toml", uncommented))
    assert s.cloud_base_url == ["https://api.openai.com/v1"] and s.router.target_cloud_fraction == 0.2


def test_edge_runtime_picks_the_backend_class(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from edgecloud import EdgeCloud
    from edgecloud.edge.llamacpp import LlamaCppBackend
    from edgecloud.edge.torch import TorchBackend
    from edgecloud.errors import ConfigError

    monkeypatch.setenv("EDGECLOUD_EDGE_RUNTIME", "torch")
    assert isinstance(EdgeCloud(edge_model="m.gguf").edge, TorchBackend)  # constructing loads nothing
    monkeypatch.delenv("EDGECLOUD_EDGE_RUNTIME")
    assert isinstance(EdgeCloud(edge_model="m.gguf").edge, LlamaCppBackend)
    with pytest.raises(ConfigError, match="edge_runtime"):
        EdgeCloud(config={"edge_runtime": "tpu"})


@pytest.mark.parametrize("collab, key", [
    ({"max_calls": -1}, "collab.max_calls"),
    ({"trust": 1.5}, "collab.trust"),
    ({"draft_min": 9, "draft_max": 4}, "collab.draft_max"),
    ({"draft_confidence": -0.1}, "collab.draft_confidence"),
    ({"checks_in_flight": 3}, "collab.checks_in_flight"),
    ({"opening_tokens": 0}, "collab.opening_tokens"),
    ({"mode": "sometimes"}, "collab.mode"),
])
def test_collab_settings_out_of_range_name_the_key(collab: dict[str, object], key: str) -> None:
    from edgecloud.errors import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_settings(collab=collab)


def test_a_request_may_bring_its_own_collab_settings() -> None:
    from edgecloud.errors import InvalidRequestError
    from edgecloud.types import ChatRequest

    asked = ChatRequest(messages=[{"role": "user", "content": "x"}], collab={"mode": "checked", "max_calls": 3})
    assert (asked.collab_options.mode, asked.collab_options.max_calls) == ("checked", 3)
    assert ChatRequest(messages=[{"role": "user", "content": "x"}], collab="verified").collab_options.mode == "verified"
    for collab, param in (({"max_calls": -2}, "collab.max_calls"), ({"policy": "x"}, "collab.policy"),
                          ({"draft_confidence": 2}, "collab.draft_confidence"),
                          ({"checks_in_flight": 0}, "collab.checks_in_flight"),
                          ({"opening_tokens": 65}, "collab.opening_tokens"), ("sometimes", "collab")):
        with pytest.raises(InvalidRequestError) as info:
            ChatRequest(messages=[{"role": "user", "content": "x"}], collab=collab)
        assert info.value.param == param
