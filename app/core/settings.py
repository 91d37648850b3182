"""User settings: one JSON file, read leniently, written atomically.

Location: platformdirs.user_config_dir("kvchat")/settings.json, or $KVCHAT_CONFIG_DIR/settings.json
when that variable is set (tests). Loading never fails and never writes: unknown keys are
ignored, a bad value falls back to its default (with a line in `Settings.warnings`), a file
that is not JSON at all gives the defaults. Nothing the user wrote is lost:

- the file is rewritten only when the user saves settings (`save_settings`); the app's own
  note of the last model (`remember_model`) updates that one key, and only in a file that
  loads cleanly;
- saving over a file with bad values (or not JSON) first copies it to the next free
  ``settings.json.N.bak``; keys kvchat does not know are carried over.
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

from kvchat import metal_kernels
from kvchat.app.core.store import atomic_write_text
from kvchat.model.decoder.kv_format import BITS, GROUP_SIZES
from kvchat.model.errors import KVChatError
from kvchat.model.files import BadJSONFile, load_json
from kvchat.model.runtime import threads
from kvchat.model.runtime.events import MAX_DRAFT_TOKENS, MAX_NGRAM, SPECULATION, GenParams
from kvchat.model.runtime.sampling import SamplingParams

SETTINGS_FILE = "settings.json"


class SettingsError(KVChatError):
    """An invalid setting; str(e) is one line naming the setting and the bad value,
    `field` the setting it is about (None when it is about the file)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


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
    # K/V cache in 4 or 8 bits (None: the float dtype); group size None: 64 or 32 by
    # head_dim; quantize once the cache holds quantized_kv_start tokens
    kv_bits: int | None = None
    kv_group_size: int | None = None
    quantized_kv_start: int = 0
    # speculative decoding (docs/design.md): off, lookup (prompt lookup) or draft (the
    # model in draft_model); at most draft_tokens drafted per step
    speculation: str = "off"
    draft_model: str | None = None
    draft_tokens: int = 4
    lookup_ngram: int = 3
    model_dirs: list[str] = field(default_factory=list)
    last_model: str | None = None
    kernels: str | None = None  # RMSNorm/RoPE backend (metal|fast|ops); None: the default
    threads: str | int = "auto"  # OpenBLAS threads: "auto" (model/runtime/threads.py) or a count
    # the chat engine process's nice value, 0-19: at 5 a busy machine takes its share of
    # the CPU from the engine, not from the keyboard (docs/performance.md, Keys and Esc)
    engine_nice: int = 5
    # warm chats: save each chat's K/V cache beside it, unless larger than the cap (MiB)
    save_kv_cache: bool = True
    kv_cache_max_mib: int = 256
    theme: str | None = None  # a Textual theme name; None = the default
    restore_session: bool = True  # input history and the open chat come back at start
    # what load_settings() had to fix (one line each); never saved
    warnings: list[str] = field(default_factory=list, init=False, compare=False, repr=False)

    def gen_params(self) -> GenParams:
        return GenParams.from_fields(self)

    def validate(self) -> Settings:
        """Raise SettingsError on the first invalid value; returns self for chaining."""
        for name in _FIELD_NAMES:
            err = _field_error(name, getattr(self, name))
            if err:
                raise SettingsError(err, name)
        err = _cross_error(self)
        if err:  # with every field valid alone: K/V options without bits, a draft model
            # asked for without its folder, or window vs keep
            field = ("kv_bits" if _kv_orphan(self) else "draft_model" if _draft_orphan(self)
                     else "max_kv_size")
            raise SettingsError(err, field)
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
        if err and _kv_orphan(s):
            # the K/V group size and start mean nothing without bits: the float defaults
            s.warnings.append(f"{err}; using the defaults kv_group_size None,"
                              " quantized_kv_start 0")
            s.kv_group_size, s.quantized_kv_start = None, 0
            err = _cross_error(s)
        if err and _draft_orphan(s):
            s.warnings.append(f"{err}; using the default speculation 'off'")
            s.speculation = "off"
            err = _cross_error(s)
        if err:
            # max_kv_size and keep relate; the unbounded default is always valid
            s.warnings.append(f"{err}; using the default max_kv_size None")
            s.max_kv_size = None
        return s


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(Settings) if f.init)
_SAMPLING_FIELDS = {"temp", "top_p", "top_k", "min_p", "repetition_penalty", "seed"}
_INT_FIELDS = {"top_k", "max_tokens", "keep", "seed", "max_kv_size", "kv_cache_max_mib",
               "kv_bits", "kv_group_size", "quantized_kv_start", "draft_tokens", "lookup_ngram"}


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
    elif name == "kv_bits":
        if v is not None and v not in BITS:
            return f"kv_bits must be empty (the float cache), 4 or 8 (got {v!r})"
    elif name == "kv_group_size":
        if v is not None and v not in GROUP_SIZES:
            return f"kv_group_size must be empty (automatic), 32, 64 or 128 (got {v!r})"
    elif name == "quantized_kv_start":
        if not _is_int(v) or v < 0:
            return f"quantized_kv_start must be an integer >= 0 (got {v!r})"
    elif name == "speculation":
        if v not in SPECULATION:
            return f"speculation must be one of {', '.join(SPECULATION)} (got {v!r})"
    elif name == "draft_model":
        if v is not None and not isinstance(v, str):
            return f"draft_model must be a folder path (got {v!r})"
    elif name == "draft_tokens":
        if not _is_int(v) or not 1 <= v <= MAX_DRAFT_TOKENS:
            return f"draft_tokens must be an integer in 1..{MAX_DRAFT_TOKENS} (got {v!r})"
    elif name == "lookup_ngram":
        if not _is_int(v) or not 1 <= v <= MAX_NGRAM:
            return f"lookup_ngram must be an integer in 1..{MAX_NGRAM} (got {v!r})"
    elif name == "save_kv_cache":
        if not isinstance(v, bool):
            return f"save_kv_cache must be true or false (got {v!r})"
    elif name == "kv_cache_max_mib":
        if not _is_int(v) or v < 0:
            return f"kv_cache_max_mib must be an integer >= 0 (got {v!r})"
    elif name == "system_prompt":
        if not isinstance(v, str):
            return f"system_prompt must be text (got {v!r})"
    elif name == "last_model":
        if v is not None and not isinstance(v, str):
            return f"last_model must be a path (got {v!r})"
    elif name == "kernels":
        if v is not None and v not in metal_kernels.available_backends():
            return (f"kernels must be empty (the default) or one of "
                    f"{', '.join(metal_kernels.available_backends())} here (got {v!r})")
    elif name == "threads":
        try:
            threads.parse(v)
        except threads.ThreadsError as e:
            return str(e)
    elif name == "engine_nice":
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 19:
            return f"engine_nice must be a whole number from 0 to 19 (got {v!r})"
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


def _kv_orphan(s: Settings) -> bool:
    """A K/V group size or start without K/V bits (they mean nothing then)."""
    return s.kv_bits is None and (s.kv_group_size is not None or bool(s.quantized_kv_start))


def _draft_orphan(s: Settings) -> bool:
    """Speculation with a draft model, and no draft model folder."""
    return s.speculation == "draft" and not s.draft_model


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
        data = load_json(p)  # NaN/Infinity parse; field checks reject them
    except FileNotFoundError:
        return Settings()
    except BadJSONFile as e:
        return _corrupt(p, str(e))
    return Settings.from_dict(data)


def _corrupt(p: Path, why: str) -> Settings:
    """Defaults for a file we cannot use; the file stays as it is until the user saves."""
    s = Settings()
    s.warnings.append(f"{why}; using default settings (the file is kept until you save)")
    return s


def _on_disk(p: Path) -> tuple[bool, dict[str, Any]]:
    """(whether `p` exists and would not load cleanly, its JSON object or {})."""
    try:
        data = load_json(p)
    except FileNotFoundError:
        return False, {}
    except BadJSONFile:
        return True, {}
    return bool(Settings.from_dict(data).warnings), data


def _backup(p: Path) -> Path:
    """Copy `p` to the first free settings.json.N.bak (never over an older backup)."""
    n = 1
    while (bak := p.with_name(f"{p.name}.{n}.bak")).exists():
        n += 1
    try:
        shutil.copyfile(p, bak)
    except OSError as e:
        raise SettingsError(
            f"cannot keep a backup of {p} ({e.strerror or e}); settings not saved"
        ) from None
    return bak


def _write(p: Path, data: dict[str, Any]) -> None:
    text = json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False)
    try:
        atomic_write_text(p, text + "\n")
    except OSError as e:
        raise SettingsError(f"cannot save settings to {p}: {e.strerror or e}") from None


def save_settings(s: Settings, path: str | os.PathLike[str] | None = None) -> Path:
    """The user saves: validate, keep a file with bad values as a numbered backup, carry
    unknown keys over, write atomically (a crash leaves the old file or the new one)."""
    s.validate()
    p = Path(path) if path is not None else settings_path()
    bad, old = _on_disk(p)
    if bad:
        _backup(p)
    known = set(_FIELD_NAMES)
    _write(p, {**{k: v for k, v in old.items() if k not in known}, **s.to_dict()})
    return p


def remember_model(s: Settings, path: str | os.PathLike[str] | None = None) -> bool:
    """Note `s.last_model` in the file (the app's own bookkeeping, not a user save): only
    that key changes, and a file with bad values is left alone. True when written."""
    p = Path(path) if path is not None else settings_path()
    bad, data = _on_disk(p)
    if bad:
        return False
    _write(p, {**data, "last_model": s.last_model})
    return True


__all__ = [
    "SETTINGS_FILE",
    "Settings",
    "SettingsError",
    "config_dir",
    "load_settings",
    "remember_model",
    "save_settings",
    "settings_path",
]
