"""Ctrl+C is never lost inside an import (app/core/sigint.py): delivered again once the
import is done, raised at once anywhere else."""

from __future__ import annotations

import signal
import threading
from types import SimpleNamespace

import pytest

from kvchat.app.core import sigint


def frames(*files: str) -> SimpleNamespace | None:
    """A stack (innermost first) of frames in `files`, as the handler walks it."""
    frame = None
    for name in reversed(files):
        frame = SimpleNamespace(f_code=SimpleNamespace(co_filename=name), f_back=frame)
    return frame


def test_outside_an_import_it_raises_as_python_does() -> None:
    with pytest.raises(KeyboardInterrupt):
        sigint._on_sigint(signal.SIGINT, frames("/app/cli/generate.py", "/app/main.py"))


def test_inside_an_import_it_is_delivered_again(monkeypatch: pytest.MonkeyPatch) -> None:
    again = threading.Event()
    monkeypatch.setattr(sigint._thread, "interrupt_main", lambda signum: again.set())
    monkeypatch.setattr(sigint, "RETRY_S", 0.0)
    # the weakref callback of importlib's module lock, where an exception would be lost
    sigint._on_sigint(signal.SIGINT, frames("<frozen importlib._bootstrap>", "/app/main.py"))
    assert again.wait(5)


def test_install_leaves_an_ignored_sigint_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    before = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sigint.install()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sigint.install()
        assert signal.getsignal(signal.SIGINT) is sigint._on_sigint
    finally:
        signal.signal(signal.SIGINT, before)
