"""Settings: round trip, lenient loading, corrupt files, validation, atomic save."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvchat.app.core import settings as settings_mod
from kvchat.app.core.settings import (
    Settings,
    SettingsError,
    load_settings,
    save_settings,
    settings_path,
)
from kvchat.model.errors import KVChatError
from kvchat.model.runtime.events import GenParams


@pytest.fixture(autouse=True)
def config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cfg"
    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(d))
    return d


def test_defaults_match_contract() -> None:
    s = Settings()
    assert (s.system_prompt, s.temp, s.top_p, s.top_k, s.min_p) == ("", 0.7, 0.95, 0, 0.05)
    assert (s.repetition_penalty, s.max_tokens, s.seed, s.max_kv_size, s.keep) == (
        1.1,
        512,
        None,
        None,
        4,
    )
    assert s.model_dirs == [] and s.last_model is None
    assert s.engine_nice == 5  # the engine below the UI (docs/performance.md, Keys and Esc)
    s.validate()


def test_path_from_env(config_dir: Path) -> None:
    assert settings_path() == config_dir / "settings.json"


def test_path_default_uses_platformdirs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVCHAT_CONFIG_DIR")
    monkeypatch.setattr(settings_mod.platformdirs, "user_config_dir", lambda app: f"/x/{app}")
    assert settings_path() == Path("/x/kvchat/settings.json")


def test_missing_file_gives_defaults(config_dir: Path) -> None:
    s = load_settings()
    assert s == Settings() and s.warnings == []
    assert not config_dir.exists()  # loading never writes


def test_round_trip(config_dir: Path) -> None:
    s = Settings(
        system_prompt="Be brief. ✓",
        temp=0.0,
        top_p=0.5,
        top_k=40,
        min_p=0.0,
        repetition_penalty=1.0,
        max_tokens=7,
        seed=123,
        max_kv_size=256,
        keep=0,
        model_dirs=["~/models", "/opt/llm"],
        last_model="/opt/llm/m",
    )
    path = save_settings(s)
    assert path == config_dir / "settings.json"
    data = json.loads(path.read_text())
    assert "warnings" not in data
    back = load_settings()
    assert back == s and back.warnings == []
    # no temp files left behind
    assert [p.name for p in config_dir.iterdir()] == ["settings.json"]


def test_unknown_keys_ignored_and_partial_file(config_dir: Path) -> None:
    config_dir.mkdir()
    (config_dir / "settings.json").write_text(json.dumps({"temp": 0.2, "future_key": [1, 2]}))
    s = load_settings()
    assert s.temp == 0.2 and s.top_p == 0.95
    assert s.warnings == []


def test_bad_values_fall_back_per_key(config_dir: Path) -> None:
    config_dir.mkdir()
    bad = {
        "temp": -1,
        "top_p": 0,
        "top_k": "forty",
        "min_p": 1.0,
        "repetition_penalty": 0,
        "max_tokens": 0,
        "seed": -5,
        "keep": -1,
        "model_dirs": "not-a-list",
        "last_model": 3,
        "system_prompt": None,
        "max_kv_size": 0,
        "engine_nice": 20,  # a nice value is 0-19
    }
    (config_dir / "settings.json").write_text(json.dumps(bad))
    s = load_settings()
    assert s == Settings()
    assert len(s.warnings) == len(bad)
    for key in bad:
        assert any(w.startswith(key) for w in s.warnings), key
    assert all("\n" not in w for w in s.warnings)


def test_good_values_kept_next_to_bad_ones(config_dir: Path) -> None:
    config_dir.mkdir()
    (config_dir / "settings.json").write_text(
        json.dumps({"temp": "hot", "top_k": 50.0, "max_tokens": 64, "seed": True, "temp2": 1})
    )
    s = load_settings()
    assert (s.temp, s.top_k, s.max_tokens, s.seed) == (0.7, 50, 64, None)
    assert len(s.warnings) == 2  # temp and seed (a bool is not a seed)


def test_nan_and_infinity_are_bad_values(config_dir: Path) -> None:
    config_dir.mkdir()
    (config_dir / "settings.json").write_text('{"temp": NaN, "max_tokens": Infinity, "top_k": 3}')
    s = load_settings()
    assert s.temp == 0.7 and s.max_tokens == 512 and s.top_k == 3
    assert len(s.warnings) == 2


def test_cross_field_max_kv_size_vs_keep(config_dir: Path) -> None:
    config_dir.mkdir()
    (config_dir / "settings.json").write_text(json.dumps({"keep": 8, "max_kv_size": 8}))
    s = load_settings()
    assert s.keep == 8 and s.max_kv_size is None
    assert len(s.warnings) == 1 and "keep + 1" in s.warnings[0]


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"", b"[1, 2, 3]", b'"just a string"', b"\xff\xfe\xfa binary", b'{"temp": 0.'],
)
def test_corrupt_file_kept_then_backed_up_on_save(config_dir: Path, content: bytes) -> None:
    config_dir.mkdir()
    (config_dir / "settings.json").write_bytes(content)
    s = load_settings()
    assert s == Settings()
    assert len(s.warnings) == 1 and "kept until you save" in s.warnings[0]
    assert (config_dir / "settings.json").read_bytes() == content  # loading never writes
    # the user's save replaces the corrupt file and keeps it as a numbered backup
    save_settings(s)
    assert load_settings().warnings == []
    assert (config_dir / "settings.json.1.bak").read_bytes() == content


def test_validate_messages_are_one_line() -> None:
    cases = {
        "temp": -0.1,
        "top_p": 1.5,
        "top_k": -1,
        "min_p": -0.1,
        "repetition_penalty": 0.0,
        "max_tokens": 0,
        "keep": -2,
        "seed": -1,
        "engine_nice": -1,  # raising the engine over the UI is not this setting's job
    }
    for key, value in cases.items():
        s = Settings(**{key: value})
        with pytest.raises(SettingsError) as ei:
            s.validate()
        msg = str(ei.value)
        assert key in msg and "\n" not in msg
        assert isinstance(ei.value, KVChatError)


def test_validate_max_kv_size() -> None:
    Settings(max_kv_size=None).validate()
    Settings(max_kv_size=5, keep=4).validate()
    Settings(max_kv_size=1, keep=0).validate()
    with pytest.raises(SettingsError, match="keep"):
        Settings(max_kv_size=4, keep=4).validate()
    with pytest.raises(SettingsError, match="max_kv_size"):
        Settings(max_kv_size=0, keep=0).validate()


def test_save_refuses_invalid(config_dir: Path) -> None:
    save_settings(Settings(temp=0.3))
    with pytest.raises(SettingsError):
        save_settings(Settings(temp=-1.0))
    assert load_settings().temp == 0.3  # the good file is untouched


def test_save_is_atomic(config_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_settings(Settings(temp=0.3))
    good = (config_dir / "settings.json").read_bytes()

    def boom(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(SettingsError, match="No space left"):
        save_settings(Settings(temp=0.9))
    assert (config_dir / "settings.json").read_bytes() == good
    assert [p.name for p in config_dir.iterdir()] == ["settings.json"]


def test_gen_params() -> None:
    s = Settings(
        temp=0.2,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        max_tokens=33,
        seed=9,
        max_kv_size=128,
        keep=2,
    )
    g = s.gen_params()
    assert isinstance(g, GenParams)
    assert (g.temp, g.top_p, g.top_k, g.min_p, g.repetition_penalty) == (0.2, 0.9, 5, 0.1, 1.2)
    assert (g.max_tokens, g.seed, g.max_kv_size, g.keep) == (33, 9, 128, 2)
