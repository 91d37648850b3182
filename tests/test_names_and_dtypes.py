"""Names, bytes and dtypes that are not what they seem: bidi and
zero-width characters in names are shown, a folder name that is not UTF-8 never breaks a
listing or reaches MLX, Ctrl+Y copies only visible text, and int/bool weights are refused
naming the tensor."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest

from kvchat.app.core.text import clipboard_text, literal, visible, visible_name
from kvchat.model.decoder.weights import load_model
from kvchat.model.errors import ModelLoadError
from tests.helpers import processes
from tests.helpers.app import make_app, ready, turn
from tests.helpers.hostile_text import CONTROLS, RAW_CONTROL
from tests.helpers.paths import MINI, REPO_ROOT
from tests.helpers.scripted_engine import async_test


def test_bidi_and_zero_width_are_shown_in_names_but_kept_in_text() -> None:
    name = "evil\u202egpj.exe \u2066x\u2069 mi\u200bni \ufeffa\u200db"
    shown = visible_name(name)
    assert shown == ("evil<U+202E>gpj.exe <U+2066>x<U+2069> mi<U+200B>ni <U+FEFF>a<U+200D>b")
    assert str(literal(name)) == shown  # table cells, labels, titles
    # a reply or typed text keeps them: a ZWJ joins an emoji sequence
    assert visible("👩\u200d💻") == "👩\u200d💻"
    # bytes that are not UTF-8 (lone surrogates in Python) become U+FFFD everywhere
    assert visible_name("m\udcffx") == visible("m\udcffx") == "m\ufffdx"
    assert visible_name("\x1b]0;t\x07") == "␛]0;t␇"


def test_listing_shows_odd_names_and_never_breaks(tmp_path: Path) -> None:
    from kvchat.app.cli.models import format_table
    from kvchat.app.core.discovery import model_rows

    root = tmp_path / "models"
    names = [b"evil\xe2\x80\xaegpj", b"mi\xe2\x80\x8bni", b"m\xffx"]  # RLO, ZWSP, not UTF-8
    for n in names:
        shutil.copytree(MINI, root / os.fsdecode(n))
    table = format_table(model_rows([str(root)]))
    table.encode("utf-8")  # printable: no lone surrogate left
    for shown in ("evil<U+202E>gpj", "mi<U+200B>ni", "m\ufffdx"):
        assert shown in table
    assert "\u202e" not in table and "\u200b" not in table


def test_models_json_with_a_non_utf8_name_is_valid_utf8_json(tmp_path: Path) -> None:
    import json
    import sys

    shutil.copytree(MINI, tmp_path / "models" / os.fsdecode(b"m\xffx"))
    r = processes.run([sys.executable, "-m", "kvchat.app", "models", "--json", "--dir",
                        str(tmp_path / "models")], capture_output=True, cwd=REPO_ROOT,
                      env={**os.environ, "KVCHAT_CONFIG_DIR": str(tmp_path / "c")}, timeout=60)
    assert r.returncode == 0, r.stderr
    names = [m["name"] for m in json.loads(r.stdout.decode("utf-8"))["models"]]
    assert "m\ufffdx" in names


def test_folder_name_that_is_not_utf8_is_one_line_not_bad_cast(tmp_path: Path) -> None:
    folder = tmp_path / os.fsdecode(b"m\xffodel")
    shutil.copytree(MINI, folder)
    with pytest.raises(ModelLoadError, match="the path is not valid UTF-8") as e:
        load_model(os.fsdecode(folder))
    assert "m\ufffdodel" in str(e.value) and "bad_cast" not in str(e.value)


@pytest.mark.parametrize("dtype", [mx.int32, mx.bool_, mx.uint8])
def test_non_float_weights_are_refused_naming_the_tensor(
        copy_checkpoint: Callable[[str], Path], dtype: mx.Dtype) -> None:
    folder = copy_checkpoint("llama")
    f = next(folder.glob("*.safetensors"))
    arrays, meta = mx.load(str(f), return_metadata=True)
    name = sorted(k for k in arrays if k.endswith("norm.weight"))[0]
    arrays[name] = arrays[name].astype(dtype)
    mx.save_safetensors(str(f), arrays, meta)
    with pytest.raises(ModelLoadError) as e:
        load_model(folder)
    want = str(dtype).removeprefix("mlx.core.")
    assert str(e.value).startswith(f"tensor {name!r} is {want} in the checkpoint")


@async_test
async def test_ctrl_y_copies_visible_text_only(env: Path) -> None:
    reply = f"Here: {CONTROLS}\r\nline two\tend"
    app = make_app(reply=reply)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await turn(pilot, "go")
        await pilot.press("ctrl+y")
        copied = app.clipboard
    assert not RAW_CONTROL.findall(copied)
    assert copied == clipboard_text(reply)
    assert copied.startswith("Here: ]52;c;aGVsbG8=]0;pwned[31mred[0m")
    assert copied.endswith("end\nline two\tend")


# a folder name with a bidi override (reads "evil" + reversed "gpj.exe"), a zero-width
# space and a raw C1 CSI (U+009B): what `inspect`, `explain` and `models` show of it
ODD = "evil\u202egpj\u200b\u009b2Jx"
ODD_SHOWN = "evil<U+202E>gpj<U+200B><9B>2Jx"
UNSAFE = re.compile("[\u202e\u200b\u009b]")


def _kvchat(*args: str, cfg: Path) -> str:
    import sys

    r = processes.run([sys.executable, "-m", "kvchat.app", *args], capture_output=True,
                      cwd=REPO_ROOT, env={**os.environ, "KVCHAT_CONFIG_DIR": str(cfg)},
                      timeout=180)
    assert r.returncode == 0, r.stderr.decode("utf-8", "replace")
    out = r.stdout.decode("utf-8")
    assert not UNSAFE.search(out) and not RAW_CONTROL.search(out.replace("\n", ""))
    return out


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("odd") / ODD
    shutil.copytree(MINI, folder)
    return folder


@pytest.mark.parametrize("command", ["inspect", "explain", "models"])
def test_names_are_shown_in_plain_output_and_escaped_in_json(
        odd_model: Path, tmp_path: Path, command: str) -> None:
    """Plain output shows the name as visible_name does; --json holds the exact name,
    with the bidi override, the zero-width space and the C1 byte as \\u escapes."""
    import json

    where = ["--dir", str(odd_model.parent)] if command == "models" else [
        "--model", str(odd_model)]
    plain = _kvchat(command, *where, cfg=tmp_path)
    assert ODD_SHOWN in plain
    raw = _kvchat(command, *where, "--json", cfg=tmp_path)
    assert "\\u202e" in raw and "\\u009b" in raw and "\\u200b" in raw
    assert ODD in json.dumps(json.loads(raw), ensure_ascii=False)


def test_generate_keeps_a_reply_exact_and_escapes_it_in_json() -> None:
    """generate's plain output is a reply: bidi and ZWJ stay (an emoji sequence), C1 is
    made visible; its --json escapes them and reads back exact."""
    import io
    import json

    from kvchat.app.core.text import VisibleWriter, json_text

    reply = "👩\u200d💻 \u202eabc \u009b2J"
    out = io.StringIO()
    VisibleWriter(out).write(reply)
    assert out.getvalue() == "👩\u200d💻 \u202eabc <9B>2J"
    names = io.StringIO()
    VisibleWriter(names, names=True).write(reply)
    assert names.getvalue() == "👩<U+200D>💻 <U+202E>abc <9B>2J"
    text = json_text({"text": reply})
    assert not UNSAFE.search(text) and "\u200d" not in text
    assert json.loads(text) == {"text": reply}


@async_test
async def test_the_chat_title_shows_a_bidi_model_name(env: Path) -> None:  # noqa: F811
    """The header's title and model name are names: a bidi override in the folder's name
    is shown, never applied."""
    from kvchat.app.core.settings import Settings
    from kvchat.app.tui.app import KVChatApp
    from tests.helpers.scripted_engine import ScriptedEngine

    app = KVChatApp(f"/models/{ODD}", Settings(),
                    engine_factory=lambda on_event, path: ScriptedEngine(on_event, path))
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        assert app.chat.sub_title == ODD  # the name as it is
        shown = str(app.query_one("HeaderTitle").render())  # the header's title widget
        assert ODD_SHOWN in shown and not UNSAFE.search(shown)
