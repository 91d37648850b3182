"""kvchat across several hosts: joining a pipeline, and starting one for the chat.

Two ways in, one runtime (model/distributed/pipeline.py):

- `mlx.launch --backend ring --hostfile hosts.json -- kvchat generate --model M ...`:
  every rank runs the same command line; `join_if_launched()` (called by the CLI right
  after parsing) makes rank 0 run the command as usual, over a `PipelineModel`, while
  every other rank serves its layers and prints nothing.
- `kvchat --hosts hosts.json [--model M]` (the chat; `kvchat serve --hosts` alike): this
  process is rank 0 and keeps the terminal; ranks 1..N-1 are started with MLX's own
  launch script (ssh, or a local shell for 127.0.0.1), their output goes to log files,
  and they exit with the chat (app/core/engine_service.py starts and stops them).

hosts.json is mlx.launch's format, plus an optional per-host "model" (the folder's path
on that host when it differs):

    {"backend": "ring", "envs": ["PYTHONPATH=/opt/kvchat"],
     "hosts": [{"ssh": "mac-a.local", "ips": ["192.168.1.10"]},
               {"ssh": "mac-b.local", "ips": ["192.168.1.11"], "model": "/Volumes/m/M"}]}
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from kvchat.app.core.errors import debug
from kvchat.model.errors import KVChatError
from kvchat.model.files import BadJSONFile, load_json

RING_PORT = int(os.environ.get("KVCHAT_RING_PORT", "32323"))  # mlx.launch's default
TERM_GRACE_S = 10.0  # after mlx.launch's SIGTERM, time for rank 0 to print its error line


class HostsError(KVChatError):
    """A hostfile we cannot use."""


def _quiet_native_stderr() -> None:
    """Keep Python's stderr (our one-line errors, Textual's screen) on the terminal and
    send MLX's native prints ("[ring] Socket 4 was closed by the peer" × 10) elsewhere."""
    if debug():
        return
    keep = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    stream = os.fdopen(keep, "w", buffering=1, errors="backslashreplace")
    sys.stderr = sys.__stderr__ = stream


def _grace_on_sigterm() -> None:
    """mlx.launch terminates every rank once one exits with an error; give rank 0 a few
    seconds to finish the turn with its error line instead of dying silently."""

    def on_term(signum: int, frame: Any) -> None:
        t = threading.Timer(TERM_GRACE_S, lambda: os._exit(128 + signal.SIGTERM))
        t.daemon = True
        t.start()

    signal.signal(signal.SIGTERM, on_term)


def join_if_launched(model: str | Path | None) -> int | None:
    """None when this process is not one of several ranks, or is rank 0 (the command then
    runs as usual and its engine loads the pipeline); else serve the layers of `model`
    (None: the shipped model) for rank 0 and return this rank's exit status."""
    from kvchat.model.distributed import link as pipeline_link
    from kvchat.model.distributed import pipeline

    if not pipeline_link.launched():
        return None
    _quiet_native_stderr()
    link = pipeline_link.join()
    if link.rank == 0 or link.size < 2:
        _grace_on_sigterm()
        return None
    try:
        if model is None:
            from kvchat.app.core.discovery import DEFAULT_MODEL

            model = DEFAULT_MODEL
        pipeline.serve(link, str(model))
    except Exception:  # rank 0 reports; a rank's own traceback only when debugging
        if debug():
            raise
        return 1
    return 0


# ---- kvchat --hosts hosts.json --------------------------------------------------------
def read_hostfile(path: str | Path) -> dict[str, Any]:
    """mlx.launch's hostfile (a list of hosts or {"backend", "envs", "hosts"})."""
    p = Path(path).expanduser()
    try:
        data = load_json(p, (dict, list))
    except FileNotFoundError:
        raise HostsError(f"hostfile {p} not found") from None
    except BadJSONFile as e:
        raise HostsError(f"cannot read hostfile {e}") from None
    hosts = data.get("hosts") if isinstance(data, dict) else data
    if not isinstance(hosts, list) or not all(isinstance(h, dict) and h.get("ssh")
                                              for h in hosts):
        raise HostsError(f"hostfile {p}: expected a list of hosts like"
                         ' {"ssh": "name", "ips": ["10.0.0.2"]}')
    if len(hosts) < 2:
        raise HostsError(f"hostfile {p} lists {len(hosts)} host; a split needs two or more")
    for i, h in enumerate(hosts):
        ips, ssh, model = h.get("ips"), h.get("ssh"), h.get("model")
        if not isinstance(ssh, str):
            raise HostsError(f"hostfile {p}: host {i}'s \"ssh\" is not a host name")
        if not ips or not isinstance(ips, list) or not all(isinstance(a, str) for a in ips):
            raise HostsError(f"hostfile {p}: host {i} ({ssh}) needs \"ips\" (a list of"
                             " addresses) for the ring backend")
        if model is not None and not isinstance(model, str):
            raise HostsError(f"hostfile {p}: host {i} ({ssh}): \"model\" is not a path")
    backend = data.get("backend", "ring") if isinstance(data, dict) else "ring"
    if backend not in ("", "ring"):
        raise HostsError(f"kvchat --hosts starts the ring backend; for {backend!r} use"
                         " mlx.launch -- kvchat generate")
    envs = data.get("envs", []) if isinstance(data, dict) else []
    if not isinstance(envs, list):
        raise HostsError(f"hostfile {p}: \"envs\" is not a list of NAME=value strings")
    return {"hosts": hosts, "envs": [str(e) for e in envs]}


SSH_CHECK_S = 20  # a host that does not answer ssh within this is reported, not waited on


def check_hosts(spec: dict[str, Any], model: str) -> None:
    """Before any rank starts: the ranks fit the model's layers (one or more each), and
    every host has the model folder it is to load (locally, or over ssh). HostsError, one
    line naming the host and the folder; without this a missing folder or too many ranks
    left the chat waiting 65-100 s for a ring that never formed."""
    from kvchat.model.decoder.config import load_config

    hosts = spec["hosts"]
    layers = load_config(Path(model)).num_hidden_layers
    if len(hosts) > layers:
        raise HostsError(f"the hostfile lists {len(hosts)} hosts but {Path(model).name} has"
                         f" {layers} layers; a split needs at least one layer per host")
    for rank, h in enumerate(hosts):
        if rank == 0:
            continue  # this process: its folder was checked when the model was chosen
        folder = str(h.get("model") or model)
        where = f"host {h['ssh']} (rank {rank})"
        if h["ssh"] == "127.0.0.1":
            if not (Path(folder).expanduser() / "config.json").is_file():
                raise HostsError(f"{where}: no model folder at {folder} (no config.json there)")
            continue
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CHECK_S // 2}",
               h["ssh"], f"test -f {shlex.quote(folder.rstrip('/') + '/config.json')}"]
        try:
            r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True,
                               timeout=SSH_CHECK_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise HostsError(f"{where}: cannot check it over ssh ({type(e).__name__})") from None
        if r.returncode == 255:
            why = r.stderr.decode(errors="replace").strip().splitlines()
            raise HostsError(f"{where}: ssh failed ({why[-1] if why else 'no answer'})")
        if r.returncode != 0:
            raise HostsError(f"{where}: no model folder at {folder} (no config.json there)")


def ring_addresses(hosts: list[dict[str, Any]], port: int = RING_PORT) -> list[list[str]]:
    """The ring hostfile mlx.launch writes: one ip:port per host, ports counting up."""
    out = []
    for h in hosts:
        out.append([f"{h['ips'][0]}:{port}"])
        port += 1
    return out


def start_ranks(
    hostfile: str | Path, model: str, log_dir: Path
) -> list[subprocess.Popen[bytes]]:
    """Start ranks 1..N-1 of `hostfile` serving `model` and make this process rank 0
    (its environment then says so; call `join_if_launched` next). Each rank runs in a
    session of its own, so a Ctrl+C at this terminal never reaches it; `stop_ranks`
    ends it."""
    from mlx._distributed_utils.launch import RemoteProcess

    spec = read_hostfile(hostfile)
    check_hosts(spec, model)
    ring = json.dumps(ring_addresses(spec["hosts"]))
    procs = []
    for rank, h in enumerate(spec["hosts"]):
        if rank == 0:
            continue
        command = [sys.executable, "-m", "kvchat.app", "--model", str(h.get("model") or model)]
        local = h["ssh"] == "127.0.0.1"
        script = RemoteProcess.make_launch_script(
            rank, None, None, {"MLX_HOSTFILE": ring}, spec["envs"], command, local
        )
        # as mlx.launch does: a forced tty, so ending ssh hangs up the remote rank too
        cmd = ["bash", "-c", script] if local else \
            ["ssh", "-tt", "-o", "LogLevel=QUIET", h["ssh"], script]
        log = open(log_dir / f"rank{rank}.log", "wb")  # noqa: SIM115 (lives with the rank)
        procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    ring_file = log_dir / "ring.json"
    ring_file.write_text(ring)
    os.environ["MLX_RANK"] = "0"
    os.environ["MLX_HOSTFILE"] = str(ring_file)
    for e in spec["envs"]:
        key, _, value = e.partition("=")
        os.environ.setdefault(key, value)
    return procs


def stop_ranks(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
