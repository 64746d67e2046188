"""Finding and ending the processes a federated run started, by a marker in their environment (Linux).

Flower's SuperLink and SuperNodes, their ClientApps and node workers, and Ray's simulation
processes (raylet, GCS, agents, actors) all inherit the environment of whoever started them, while
several rename themselves (``ray::DashboardAgent``): a ``NAME=TOKEN`` variable set before they
start finds every one of them in ``/proc/PID/environ``, whatever they are called now.

Run as ``python -m federation.runtime.processes --watch-pid PID --marker NAME --token TOKEN
[--remove DIR]``, it is a watchdog: once process PID has exited, however it ended (``kill -9``
included), it kills the marked processes and removes DIR.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

WATCH_S = 0.5
GRACE_S = 5.0
"""How long :func:`end_marked` gives marked processes to exit on SIGTERM before it kills them."""
PROCESS_GROUP_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""A process group's variables, set by a launcher or by a one-process group this process formed: never
passed to the processes of a federated run, or every client would try to join this process's group."""


def marked_processes(marker: str, token: str, exclude: set[int] | None = None) -> set[int]:
    """Live processes whose environment holds ``marker=token`` (zombies and ``exclude`` left out)."""
    entry = f"{marker}={token}".encode()
    found = set()
    for path in Path("/proc").iterdir():
        if not path.name.isdigit() or int(path.name) in (exclude or set()):
            continue
        try:
            if entry in (path / "environ").read_bytes().split(b"\0") and not is_zombie(int(path.name)):
                found.add(int(path.name))
        except OSError:
            continue
    return found


def kill_marked(
    marker: str, token: str, exclude: set[int] | None = None, sig: signal.Signals = signal.SIGKILL
) -> set[int]:
    """Send ``sig`` (SIGKILL) to every marked process; returns the pids signalled."""
    killed = set()
    for pid in marked_processes(marker, token, exclude):
        try:
            os.kill(pid, sig)
            killed.add(pid)
        except ProcessLookupError:
            continue
    return killed


def end_marked(marker: str, token: str, grace_s: float = GRACE_S) -> None:
    """SIGTERM every marked process, and SIGKILL those still there after ``grace_s``.

    SIGTERM first lets a process clean up: a node worker removes its socket, key and lock file,
    which SIGKILL would leave behind.
    """
    deadline = time.monotonic() + grace_s
    kill_marked(marker, token, sig=signal.SIGTERM)
    while marked_processes(marker, token) and time.monotonic() < deadline:
        time.sleep(WATCH_S)
    kill_marked(marker, token)


def start_watchdog(watch_pid: int, marker: str, token: str, remove: Path | None = None) -> subprocess.Popen:
    """Start the watchdog (detached, unmarked itself) for ``watch_pid``; kill it once the watched process
    has cleaned up by itself."""
    command = [sys.executable, "-m", __name__, "--watch-pid", str(watch_pid), "--marker", marker, "--token", token]
    env = {key: value for key, value in os.environ.items() if key != marker}
    return subprocess.Popen(
        [*command, *(["--remove", str(remove)] if remove else [])],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )


def stat_fields(pid: int) -> list[str] | None:
    """Fields of ``/proc/PID/stat`` after the command name (state first), or None once the pid is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def start_time(pid: int) -> str | None:
    """When the process started (clock ticks since boot), telling a pid's process from a later one reusing it."""
    fields = stat_fields(pid)
    return fields[19] if fields else None


def is_zombie(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is None or fields[0] == "Z"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="kill a run's marked processes once the run's process is gone")
    parser.add_argument("--watch-pid", type=int, required=True)
    parser.add_argument("--marker", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--remove", type=Path)
    args = parser.parse_args(argv)
    started = start_time(args.watch_pid)
    while started is not None and start_time(args.watch_pid) == started and not is_zombie(args.watch_pid):
        time.sleep(WATCH_S)
    while kill_marked(args.marker, args.token, exclude={os.getpid()}):
        time.sleep(WATCH_S)  # what was starting while we killed
    if args.remove:
        shutil.rmtree(args.remove, ignore_errors=True)


if __name__ == "__main__":
    main()
