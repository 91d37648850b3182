"""User settings: one JSON file, read leniently, written atomically.

Location: platformdirs.user_config_dir("kvchat")/settings.json, or $KVCHAT_CONFIG_DIR/settings.json
when that variable is set (tests). Loading never fails: unknown keys are ignored, a bad value
falls back to its default (with a line in `Settings.warnings`), and a file that is not JSON at
all is copied to settings.json.bak before starting from defaults, so nothing the user wrote is
lost and the app always starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs

from model.errors import KVChatError
from model.events import GenParams
from model.sampling import SamplingParams

from .store import atomic_write_text

SETTINGS_FILE = "settings.json"


class SettingsError(KVChatError):
    """An invalid setting; str(e) is one line naming the setting and the bad value."""


@dataclass
class Settings:
    system_prompt: str = ""
    temp: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    min_p: float = 0.05
    repetition_penalty: float = 1.1
    max_tokens: int = 512
    seed: int | None = None
    max_kv_size: int | None = None
    keep: int = 4
    model_dirs: list[str] = field(default_factory=list)
    last_model: str | None = None
    theme: str | None = None  # a Textual theme name; None = the default
    restore_session: bool = True  # input history and the open chat come back at start
    # what load_settings() had to fix (one line each); never saved
    warnings: list[str] = field(default_factory=list, init=False, compare=False, repr=False)

    def gen_params(self) -> GenParams:
        return GenParams(
            max_tokens=self.max_tokens,
            temp=self.temp,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            max_kv_size=self.max_kv_size,
            keep=self.keep,
        )

    def validate(self) -> Settings:
        """Raise SettingsError on the first invalid value; returns self for chaining."""
        for name in _FIELD_NAMES:
            err = _field_error(name, getattr(self, name))
            if err:
                raise SettingsError(err)
        err = _cross_error(self)
        if err:
            raise SettingsError(err)
        return self

    def to_dict(self) -> dict[str, Any]:
        d = {name: getattr(self, name) for name in _FIELD_NAMES}
        d["model_dirs"] = list(self.model_dirs)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Settings:
        """Lenient: unknown keys ignored, bad values -> defaults, each noted in .warnings."""
        s = cls()
        for name in _FIELD_NAMES:
            if name not in data:
                continue
            value = _coerce(name, data[name])
            err = _field_error(name, value)
            if err:
                s.warnings.append(f"{err}; using the default {getattr(s, name)!r}")
            else:
                setattr(s, name, value)
        err = _cross_error(s)
        if err:
            # only max_kv_size relates fields; the unbounded default is always valid
            s.warnings.append(f"{err}; using the default max_kv_size None")
            s.max_kv_size = None
        return s


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(Settings) if f.init)
_SAMPLING_FIELDS = {"temp", "top_p", "top_k", "min_p", "repetition_penalty", "seed"}
_INT_FIELDS = {"top_k", "max_tokens", "keep", "seed", "max_kv_size"}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _coerce(name: str, value: Any) -> Any:
    """JSON-level leniency: 40.0 for an integer setting means 40."""
    if name in _INT_FIELDS and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _field_error(name: str, v: Any) -> str | None:
    """One line describing why `v` is not a valid value of setting `name`, or None."""
    if name in _SAMPLING_FIELDS:
        # one definition of the sampling ranges: the sampler's own
        try:
            SamplingParams(**{name: v}).validate()
        except KVChatError as e:
            return str(e)
        return None
    if name == "max_tokens":
        if not _is_int(v) or v < 1:
            return f"max_tokens must be an integer >= 1 (got {v!r})"
    elif name == "keep":
        if not _is_int(v) or v < 0:
            return f"keep must be an integer >= 0 (got {v!r})"
    elif name == "max_kv_size":
        if v is not None and (not _is_int(v) or v < 1):
            return f"max_kv_size must be empty (the model's context) or an integer >= 1 (got {v!r})"
    elif name == "system_prompt":
        if not isinstance(v, str):
            return f"system_prompt must be text (got {v!r})"
    elif name == "last_model":
        if v is not None and not isinstance(v, str):
            return f"last_model must be a path (got {v!r})"
    elif name == "theme":
        if v is not None and not isinstance(v, str):
            return f"theme must be a theme name (got {v!r})"
    elif name == "restore_session":
        if not isinstance(v, bool):
            return f"restore_session must be true or false (got {v!r})"
    elif name == "model_dirs":
        if not isinstance(v, list) or not all(isinstance(d, str) for d in v):
            return f"model_dirs must be a list of folder paths (got {v!r})"
    return None


def _cross_error(s: Settings) -> str | None:
    """Checks across fields, once each field is valid: the engine's own (GenParams)."""
    try:
        s.gen_params().validate()
    except KVChatError as e:
        return str(e)
    return None


def config_dir() -> Path:
    env = os.environ.get("KVCHAT_CONFIG_DIR")
    return Path(env).expanduser() if env else Path(platformdirs.user_config_dir("kvchat"))


def settings_path() -> Path:
    return config_dir() / SETTINGS_FILE


def load_settings(path: str | os.PathLike[str] | None = None) -> Settings:
    """Settings from disk; defaults when the file is missing. Never raises."""
    p = Path(path) if path is not None else settings_path()
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Settings()
    except (OSError, UnicodeDecodeError) as e:
        return _corrupt(p, f"cannot read {p}: {getattr(e, 'strerror', None) or e}")
    try:
        data = json.loads(text)  # NaN/Infinity parse; field checks reject them
    except ValueError as e:
        return _corrupt(p, f"{p} is not valid JSON ({e})")
    if not isinstance(data, dict):
        return _corrupt(p, f"{p} does not hold a JSON object")
    return Settings.from_dict(data)


def _corrupt(p: Path, why: str) -> Settings:
    """Keep the user's bytes in settings.json.bak, then start from defaults."""
    s = Settings()
    bak = p.with_name(p.name + ".bak")
    try:
        shutil.copyfile(p, bak)
        s.warnings.append(f"{why}; saved a copy as {bak.name} and using default settings")
    except OSError:
        s.warnings.append(f"{why}; using default settings")
    return s


def save_settings(s: Settings, path: str | os.PathLike[str] | None = None) -> Path:
    """Validate, then write atomically (a crash leaves the old file or the new one)."""
    s.validate()
    p = Path(path) if path is not None else settings_path()
    data = s.to_dict()
    text = json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False)
    try:
        atomic_write_text(p, text + "\n")
    except OSError as e:
        raise SettingsError(f"cannot save settings to {p}: {e.strerror or e}") from None
    return p


__all__ = [
    "SETTINGS_FILE",
    "Settings",
    "SettingsError",
    "config_dir",
    "load_settings",
    "save_settings",
    "settings_path",
]
