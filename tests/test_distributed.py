"""Pipeline parallelism on loopback: two and three real mx.distributed ranks (ring backend).

Rank 0 runs either `tests/helpers/distributed_driver.py` (what `kvchat --hosts` does: it starts
the other ranks with app.core.hosts and drives the real Engine) or the CLI under mlx.launch.
References are the single-process Engine's greedy ids on the same folder.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import processes
from tests.helpers.checkpoints import TinySpec, build_tiny_checkpoint
from tests.helpers.paths import REPO_ROOT

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="ring backend needs POSIX")

STORY = "Once upon a time, there was a little girl named Lily. She liked to play outside. " * 2
WORDS = " ".join(f"w{3 + (i * 7) % 250}" for i in range(70))  # 70 tokens, tiny tokenizer
MLX_LAUNCH = Path(sys.executable).parent / "mlx.launch"


def _env(port: int, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "KVCHAT_RING_PORT": str(port)}
    env.update(extra)
    return env


def _free_port(n: int) -> int:
    """A port p with p .. p+n-1 free right now (the ring listens on one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + n < 65000:
            try:
                socks = []
                for i in range(n):
                    t = socket.socket()
                    socks.append(t)
                    t.bind(("127.0.0.1", p + i))
                return p
            except OSError:
                continue
            finally:
                for t in socks:
                    t.close()
    raise RuntimeError("no free ports")


def _hostfile(tmp: Path, n: int, models: dict[int, Path] | None = None) -> Path:
    hosts: list[dict[str, Any]] = [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]} for _ in range(n)]
    for r, m in (models or {}).items():
        hosts[r]["model"] = str(m)
    f = tmp / f"hosts{n}.json"
    f.write_text(json.dumps({"hosts": hosts}))
    return f


def _driver(hostfile: Path, model: Path, *args: str, **popen: Any) -> subprocess.Popen[str]:
    popen.setdefault("env", _env(_free_port(4)))
    return processes.popen(
        [sys.executable, "-m", "tests.helpers.distributed_driver", str(hostfile), str(model),
         *args],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, **popen,
    )


def _lines(proc: subprocess.Popen[str], timeout: float = 60) -> list[dict[str, Any]]:
    out, _ = proc.communicate(timeout=timeout)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _single(model: Path, prompt: str, max_tokens: int, max_kv: int | None
            ) -> tuple[list[int], dict[str, Any]]:
    """The single-process Engine's greedy ids and model info: the reference."""
    from kvchat.model.runtime.client import EngineClient
    from kvchat.model.runtime.events import GenParams

    with EngineClient(model) as runner:
        done = runner.run(prompt, GenParams(max_tokens=max_tokens, max_kv_size=max_kv))
        return done.ids, runner.info


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untied llama big enough (≈ 20 MB fp32, 6 layers) that per-rank memory is
    dominated by weights, not by MLX's fixed overheads."""
    spec = TinySpec("llama", {"tie_word_embeddings": False, "hidden_size": 256,
                              "intermediate_size": 512, "num_hidden_layers": 6,
                              "vocab_size": 2048, "num_attention_heads": 8,
                              "num_key_value_heads": 2}, seed=11)
    return build_tiny_checkpoint(spec, tmp_path_factory.mktemp("wide_llama"))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 (sliding, sliding, global, sliding; sandwich blocks, offset norms,
    scaled embedding, tied head) built by transformers (tests/helpers/families.py)."""
    from tests.helpers.families import FAMILY_SPECS, build

    return build(FAMILY_SPECS["gemma3_text"], tmp_path_factory.mktemp("gemma3"))


@pytest.mark.slow  # ranks on loopback
def test_split_gemma3_equals_single_process(gemma3: Path, tmp_path: Path) -> None:
    """Every rank runs Transformer's own embed / blocks / head: a family with sliding and
    global layers, sandwich norms and a scaled embedding gives the single process's ids
    split across two ranks (the prompt is longer than the sliding window)."""
    prompt = " ".join(f"w{3 + (i * 11) % 200}" for i in range(24))
    want, _ = _single(gemma3, prompt, 16, None)
    lines = _lines(_driver(_hostfile(tmp_path, 2), gemma3, "--prompt", prompt,
                           "--max-tokens", "16"))
    loaded, turns = lines[0]["loaded"], lines[1:]
    assert len(loaded["ranks"]) == 2 and len(turns) == 1
    assert turns[0]["finish_reason"] in ("length", "eos"), turns[0]["error"]
    assert turns[0]["ids"] == want


# ---- the plan --------------------------------------------------------------------------
def test_plan_is_the_byte_optimal_contiguous_split(stories260k: Path) -> None:
    from itertools import combinations

    from kvchat.model.decoder.config import load_config
    from kvchat.model.distributed.pipeline import plan
    from kvchat.model.files import tensor_bytes

    cfg, sizes = load_config(stories260k), tensor_bytes(stories260k)
    total_layer = sum(b for k, b in sizes.items() if k.startswith("model.layers."))
    embed = sizes["model.embed_tokens.weight"]
    for n in (2, 3):
        slices = plan(cfg, sizes, n)
        assert [s.start for s in slices][0] == 0 and slices[-1].stop == cfg.num_hidden_layers
        pairs = zip(slices, slices[1:], strict=False)
        assert all(a.stop == b.start and a.stop > a.start for a, b in pairs)
        # tied head: the last rank holds the embedding again, rank 0 holds it too
        assert slices[0].embed and slices[-1].embed and slices[-1].head
        assert sum(s.weight_bytes for s in slices) == total_layer + 2 * embed + sizes[
            "model.norm.weight"]
        # brute force over every contiguous split: none has a smaller largest rank
        per = [sum(b for k, b in sizes.items() if k.startswith(f"model.layers.{i}."))
               for i in range(cfg.num_hidden_layers)]
        best = min(
            max(sum(per[a:b]) + (embed if r == 0 else 0)
                + (embed + sizes["model.norm.weight"] if r == n - 1 else 0)
                for r, (a, b) in enumerate(zip((0, *cuts), (*cuts, len(per)), strict=True)))
            for cuts in combinations(range(1, len(per)), n - 1)
        )
        assert max(s.weight_bytes for s in slices) == best


def test_inspect_hosts_shows_each_ranks_bytes_beside_the_totals(stories260k: Path) -> None:
    r = processes.run(
        [sys.executable, "-m", "kvchat.app", "inspect", "--model", str(stories260k), "--hosts", "3",
         "--json"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        env=_env(0),
    )
    d = json.loads(r.stdout)
    ranks = d["ranks"]
    assert [x["rank"] for x in ranks] == [0, 1, 2]
    # K/V: the ranks' layers add up to the whole model's bytes at the context
    assert sum(x["kv_bytes_at_context"] for x in ranks) == d["bytes_at_context"]
    assert sum(x["kv_bytes_per_token"] for x in ranks) == d["bytes_per_token"]
    # weights: every tensor once, plus the tied head's second copy of the embedding
    embed = 512 * 64 * 4  # vocab × hidden × fp32
    assert sum(x["weight_bytes"] for x in ranks) == d["weights_bytes"] + embed
    text = processes.run(
        [sys.executable, "-m", "kvchat.app", "inspect", "--model", str(stories260k),
         "--hosts", "2"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, env=_env(0),
    ).stdout
    assert "rank 0: layers 0-2 + embedding" in text
    assert "rank 1: layers 3-4 + norm/head (tied: embedding)" in text


# ---- greedy ids equal the single process ----------------------------------------------
CASES = [  # (model, ranks, prompt, max tokens, max kv size)
    ("stories260k", 2, STORY, 40, None),
    ("stories260k", 3, STORY, 60, 48),  # rotating: the prompt alone passes the window
    ("llama", 2, WORDS, 40, 32),
    ("wide_llama", 3, WORDS, 30, None),  # untied head, 6 layers
]


@pytest.mark.parametrize("name,ranks,prompt,max_tokens,max_kv", [
    # the fast tier runs one 2-rank loopback pipeline (llama, rotating); the rest are slow
    pytest.param(*c, id=f"{c[0]}-{c[1]}ranks-{'rot' if c[4] else 'full'}",
                 marks=() if c[:2] == ("llama", 2) else pytest.mark.slow)
    for c in CASES])
def test_greedy_ids_equal_single_process(
    name: str, ranks: int, prompt: str, max_tokens: int, max_kv: int | None,
    request: pytest.FixtureRequest, tiny_checkpoint: Callable[[str], Path], tmp_path: Path,
) -> None:
    model = (request.getfixturevalue(name) if name in ("stories260k", "wide_llama")
             else tiny_checkpoint(name))
    want, info = _single(model, prompt, max_tokens, max_kv)
    args = ["--prompt", prompt, "--max-tokens", str(max_tokens), "--turns", "2"]
    if max_kv:
        args += ["--max-kv-size", str(max_kv)]
    lines = _lines(_driver(_hostfile(tmp_path, ranks), model, *args))
    loaded, turns = lines[0]["loaded"], lines[1:]
    assert [r["layers"] for r in loaded["ranks"]][0][0] == 0 and len(loaded["ranks"]) == ranks
    # the model panel shows the whole model (each rank's share beside it)
    assert loaded["parameters"] == info["parameters"] and loaded["dtype"] == info["dtype"]
    assert len(turns) == 2
    for t in turns:  # the second turn reuses the cache prefix: ranks trim in step
        assert t["finish_reason"] in ("length", "eos"), t["error"]
        assert t["ids"] == want
    # full cache: the prefix is reused (remote ranks trim); rotated past it: a fresh cache
    assert (turns[1]["stats"]["cached_tokens"] > 0) == (max_kv is None)
    pipe = turns[0]["stats"]["pipeline"]
    assert [r["rank"] for r in pipe["ranks"]] == list(range(ranks))
    # K/V bytes per rank add up to the total, and each is its layers' share
    assert sum(r["kv_bytes"] for r in pipe["ranks"]) == turns[0]["stats"]["cache_bytes"]
    assert pipe["kv_bytes"] == turns[0]["stats"]["cache_bytes"]
    assert pipe["weight_bytes"] == loaded["weight_bytes"]
    L = sum(b - a for a, b in (r["layers"] for r in pipe["ranks"]))
    for r in pipe["ranks"]:
        a, b = r["layers"]
        assert r["kv_bytes"] * L == turns[0]["stats"]["cache_bytes"] * (b - a)
        assert r["compute_ms"] > 0
    assert pipe["step_ms"] >= sum(r["compute_ms"] for r in pipe["ranks"])
    if max_kv:
        assert turns[0]["stats"]["evicted_tokens"] > 0  # the window really rotated
    # the layer view names the rank holding each layer's K/V
    owners = [row.get("rank", 0) for row in turns[0]["layers"]]
    assert owners == [r["rank"] for r in pipe["ranks"] for _ in range(*r["layers"])]


# ---- memory: each rank holds its slice ------------------------------------------------
@pytest.mark.slow  # ranks on loopback
@pytest.mark.parametrize("ranks", [2, 3])
def test_rank_weight_bytes_are_its_slice(ranks: int, wide_llama: Path, tmp_path: Path) -> None:
    """Tolerance: MLX active memory after load within 5 % + 1 MiB of the slice's bytes
    planned from the safetensors headers (lazy loading: no rank reads others' tensors)."""
    from kvchat.model.explain.facts import model_facts

    total = model_facts(wide_llama).file_bytes
    lines = _lines(_driver(_hostfile(tmp_path, ranks), wide_llama, "--max-tokens", "2"))
    rows = lines[0]["loaded"]["ranks"]
    for r in rows:
        assert r["weight_bytes"] == r["planned_weight_bytes"]  # fp32 stays fp32 on the CPU
        assert r["weight_bytes"] <= r["active_memory"] <= r["weight_bytes"] * 1.05 + (1 << 20)
        assert r["active_memory"] < total * (0.5 if ranks == 3 else 0.75)
    assert sum(r["weight_bytes"] for r in rows) == total  # untied: every tensor once
    assert lines[0]["loaded"]["weight_bytes"] == total
    assert lines[1]["finish_reason"] in ("length", "eos")


# ---- faults ------------------------------------------------------------------------------
@pytest.mark.slow  # ranks on loopback
@pytest.mark.parametrize("ranks,victim,at", [(2, 1, "token"), (3, 1, "token"),
                                             (3, 2, "prefill")])
def test_killed_rank_ends_the_turn_with_one_line(
    ranks: int, victim: int, at: str, tiny_checkpoint: Callable[[str], Path],
    wide_llama: Path, tmp_path: Path,
) -> None:
    model = tiny_checkpoint("llama") if ranks == 2 else wide_llama  # 2 layers / 6 layers
    first, second, exits = _fault_mid_turn(tmp_path, ranks, victim, model, signal.SIGKILL,
                                           "--pause-at", at)
    assert first["error"].startswith(f"rank {victim} (127.0.0.1) exited")
    if at == "token":  # the reply so far is kept, with its ids
        assert first["finish_reason"] == "error" and first["ids"]
    # the other ranks exit by themselves (the killed one by the signal)
    assert all(code is not None for code in exits), exits


@pytest.mark.slow  # ranks on loopback
def test_hung_rank_is_named_within_the_heartbeat_timeout(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """A stopped process keeps its sockets open: MLX alone would wait forever."""
    first, _, _ = _fault_mid_turn(tmp_path, 2, 1, tiny_checkpoint("llama"), signal.SIGSTOP,
                                  env={"KVCHAT_HEARTBEAT_TIMEOUT": "3"})
    assert first["error"].startswith("rank 1 (127.0.0.1) stopped responding")
    assert first["at"] < 10


def _fault_mid_turn(
    tmp_path: Path, ranks: int, victim: int, model: Path, sig: int, *args: str,
    env: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    """Signal rank `victim` while rank 0 is mid-generation; return both turns' results
    (the second one asked after the fault) and the other ranks' exit codes."""
    wait = "10" if sig == signal.SIGKILL else "0"
    proc = _driver(_hostfile(tmp_path, ranks), model, "--pause", "--turns", "2",
                   "--max-tokens", "200", "--prompt", WORDS, "--exit-wait", wait, *args,
                   stdin=subprocess.PIPE, env=_env(_free_port(4), **(env or {})))
    assert proc.stdout is not None and proc.stdin is not None
    lines, t_fault, pids, exits = [], 0.0, [], []
    try:
        for raw in proc.stdout:
            d = json.loads(raw)
            if "paused" in d:  # the engine is mid-turn, blocked in our callback
                pids = d["paused"]
                os.killpg(pids[victim - 1], sig)
                t_fault = time.monotonic()
                proc.stdin.write("go\n")
                proc.stdin.flush()
            elif "finish_reason" in d:
                d["at"] = time.monotonic() - t_fault
                lines.append(d)
                if sig != signal.SIGKILL and len(lines) == 2:
                    os.killpg(pids[victim - 1], signal.SIGKILL)  # do not leave it stopped
            elif "rank_exit" in d:
                exits = d["rank_exit"]
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    first, second = lines
    assert first["finish_reason"] == "error" and first["at"] < 30
    assert "\n" not in first["error"]
    # the chat survives: the next turn is answered at once with the same line
    assert second["finish_reason"] == "error" and second["error"] == first["error"]
    return first, second, exits


@pytest.mark.slow  # ranks on loopback
def test_mismatched_model_folders_are_refused_naming_the_rank(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    import shutil

    import mlx.core as mx

    base = tiny_checkpoint("llama")
    other = tiny_checkpoint("llama_tied")  # another config.json
    tweaked = tmp_path / "tweaked"  # same config, one weight changed
    shutil.copytree(base, tweaked)
    w = mx.load(str(tweaked / "model.safetensors"))
    w["model.layers.1.mlp.up_proj.weight"] = w["model.layers.1.mlp.up_proj.weight"] * 1.01
    mx.save_safetensors(str(tweaked / "model.safetensors"), w, metadata={"format": "pt"})
    # two hosts: the model has 2 layers, and --hosts refuses more hosts than layers
    for folder, what in ((other, "config.json"), (tweaked, "weights")):
        lines = _lines(_driver(_hostfile(tmp_path, 2, {1: folder}), base))
        msg = lines[0]["load_failed"]
        assert msg.startswith("rank 1 (127.0.0.1) has a different model") and what in msg


@pytest.mark.slow  # ranks on loopback
def test_rank_that_never_connects_fails_in_bounded_time(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    port = _free_port(2)
    ring = tmp_path / "ring.json"
    ring.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    t0 = time.monotonic()
    r = processes.run(
        [sys.executable, "-m", "kvchat.app", "generate", "--model", str(tiny_checkpoint("llama")),
         "--prompt", "w5", "--raw"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        env=_env(port, MLX_RANK="0", MLX_HOSTFILE=str(ring), KVCHAT_CONNECT_TIMEOUT="3"),
    )
    assert time.monotonic() - t0 < 20
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "did not connect within 3 s" in lines[0]


# ---- the documented command: mlx.launch -- kvchat generate ---------------------------
@pytest.mark.slow  # ranks on loopback
@pytest.mark.skipif(not MLX_LAUNCH.exists(), reason="mlx.launch not installed")
def test_mlx_launch_generate_json_rank0_alone_prints(stories260k: Path) -> None:
    want, _ = _single(stories260k, STORY, 30, None)
    port = _free_port(2)
    r = processes.run(
        [str(MLX_LAUNCH), "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1",
         "--starting-port", str(port), sys.executable, "-m", "kvchat.app", "generate",
         "--model", str(stories260k), "--prompt", STORY, "--raw", "--max-tokens", "30",
         "--json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=90, env=_env(port),
    )
    out = r.stdout.strip().splitlines()
    assert len(out) == 1, r.stdout + r.stderr  # exactly one JSON object: rank 0's
    d = json.loads(out[0])
    assert d["ids"] == want and d["finish_reason"] in ("length", "eos")
    assert [x["rank"] for x in d["pipeline"]["ranks"]] == [0, 1]
    assert sum(x["kv_bytes"] for x in d["pipeline"]["ranks"]) == d["cache_bytes"]
