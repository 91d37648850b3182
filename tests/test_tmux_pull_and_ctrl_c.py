"""In a real terminal (tmux): `kvchat pull` draws its progress bars in place,
the chat's footer at 80 columns ends cleanly, and Ctrl+C stops a streaming reply."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from tests.helpers.fake_hub import FakeHub, FakeRepo
from tests.helpers.paths import MINI, REPO_ROOT
from tests.helpers.paths import STORIES260K as STORIES
from tests.helpers.tmux import NEEDS_TMUX, Tmux, chat_env, command, session, wait_file

# the chat in tmux stays in the fast tier once (tests/test_tmux_chat.py)
pytestmark = [NEEDS_TMUX, pytest.mark.slow]


def test_pull_progress_bars_in_a_terminal(tmp_path: Path) -> None:
    status = tmp_path / "status"
    tmux = Tmux(f"kvchat-pull-{os.getpid()}")
    # ~1.3 MiB at 250 KB/s: a few seconds to watch the bars move
    with FakeHub({"demo/mini": FakeRepo.from_folder(MINI)}, throttle_bps=250_000) as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hf"),
               "TERM": "xterm-256color", "PYTHONPATH": str(REPO_ROOT)}
        try:
            session(tmux, "pull", (110, 10), command("pull demo/mini", env, status))
            mid = tmux.wait_screen(
                "pull", lambda s: "model.safetensors" in s and "ETA" in s
                and "total 2/7" in s, timeout=60)
            lines = [ln for ln in mid.splitlines() if ln.strip()]
            # two lines redrawn in place: the file's bar, then the total with speed and ETA
            assert lines[0].startswith("model.safetensors") and "░" in lines[0]
            assert lines[1].startswith("total 2/7 files") and "/s · ETA" in lines[1]
            assert wait_file(status, 90) == "0"
            # with the history: on exit tmux scrolls the pane a line to say "Pane is dead"
            done = tmux("capture-pane", "-p", "-S", "-", "-t", "pull")
        finally:
            tmux.kill_server()
    final = [ln for ln in done.splitlines() if ln.strip()]
    ready = next(i for i, ln in enumerate(final) if ln.startswith("demo/mini: ready"))
    last_file = final[ready - 2].split()[0]  # the file that finished last, at 100%
    assert (MINI / last_file).is_file() and "100%" in final[ready - 2], done
    assert final[ready - 1].startswith("total 7/7 files") and "100%" in final[ready - 1], done
    assert len([ln for ln in final if ln.startswith("total ")]) == 1, done  # redrawn in place
    assert ready == 2, done  # nothing printed above the two lines


def test_footer_at_80_columns_and_ctrl_c_stops(tmp_path: Path) -> None:
    env, status = chat_env(tmp_path, {"temp": 0.0, "max_tokens": 3000, "max_kv_size": 256})
    tmux = Tmux(f"kvchat-80-{os.getpid()}")
    try:
        session(tmux, "chat", (80, 24),
                 command(f"--model {shlex.quote(str(STORIES))}", env, status))
        # the model's name in the title: loaded (a message sent mid-load is refused)
        screen = tmux.wait_screen(
            "chat", lambda s: "palette" in s and "Message" in s and "stories260K" in s,
            timeout=90)
        footer = screen.splitlines()[-1]
        assert footer.rstrip().endswith("^p palette"), repr(footer)  # no stray letter after
        # "One day": a greedy reply of 857 tokens, so Ctrl+C lands while it streams
        tmux("send-keys", "-t", "chat", "-l", "One day")
        tmux("send-keys", "-t", "chat", "Enter")
        tmux.wait_screen("chat", lambda s: "generating…" in s, timeout=60)
        tmux("send-keys", "-t", "chat", "C-c")
        stopped = tmux.wait_screen("chat", lambda s: "■ stopped" in s, timeout=30)
        assert "ctrl+q" not in stopped.lower()
        tmux("send-keys", "-t", "chat", "C-q")
        assert wait_file(status, 30) == "0"
    finally:
        tmux.kill_server()
