"""Shared fixtures: one real mesh per session (starting torch is slow), and a check that no rank outlives
the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from monarch_jupyter import Mesh
from monarch_jupyter.kernel.launch import local as launcher

# Every process this test session starts (kernels, fork servers, ranks) inherits this tag, so the orphan check
# finds exactly ours even when other meshes run on the machine.
SESSION_TAG = f"MJ_TEST_SESSION={os.getpid()}-{time.time_ns()}"
os.environ["MJ_TEST_SESSION"] = SESSION_TAG.split("=", 1)[1]


def worker_pids() -> set[int]:
    """Pids of this session's fork servers and ranks (ranks share the fork server's command line)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            if b"monarch_worker" not in cmd:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                tagged = SESSION_TAG.encode() in f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if tagged and state != "Z":
            pids.add(int(entry))
    return pids


def wait_gone(pids: set[int], timeout: float = 10.0) -> set[int]:
    """Wait up to ``timeout`` seconds for ``pids`` to exit; returns those still alive."""
    deadline = time.monotonic() + timeout
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive &= worker_pids()
        if alive:
            time.sleep(0.05)
    return alive


def reap(procs: list[subprocess.Popen], timeout: float = 30) -> list[int | None]:
    """Exit codes of ``procs``, each waited for up to ``timeout`` s (None: it was still running and is killed)."""
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append(None)
    return codes


def cell_text(msgs: list[dict]) -> str:
    """What a cell's plain view holds, from its IOPub messages: its stream text, then the last ``text/plain`` of each
    cell dashboard (``mj-dash-*`` display ids), where the lines a cell's ranks wrote are (widgets.celldash)."""
    streams = "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream")
    dashboards: dict[str, str] = {}
    for m in msgs:
        display_id = m["content"].get("transient", {}).get("display_id", "") if m["msg_type"] in (
            "display_data", "update_display_data") else ""
        if display_id.startswith("mj-dash-"):
            dashboards[display_id] = m["content"]["data"].get("text/plain", "")
    return streams + "".join(text + "\n" for text in dashboards.values())


def magic_shell() -> object:
    """IPython's shared InteractiveShell with %mesh registered (another test module may have unloaded it)."""
    from IPython.core.interactiveshell import InteractiveShell

    from monarch_jupyter.magics import load

    shell = InteractiveShell.instance()
    load(shell)
    return shell


@pytest.fixture(scope="session")
def _shared_mesh() -> Iterator[Mesh]:
    m = Mesh(4, start_timeout=120)
    yield m
    m.stop()


@pytest.fixture()
def mesh(_shared_mesh: Mesh) -> Mesh:
    """A 4-rank gloo mesh shared by the tests that only run code (they must leave it usable). Started again, with
    fresh namespaces, when a test that ran before in this process took its ranks (the tests that kill the kernel's
    fork server do: where they run first depends on how pytest-xdist shares the files out)."""
    if not _shared_mesh.running or any(s["state"] == "dead" for s in _shared_mesh.status().values()):
        _shared_mesh.restart()
    return _shared_mesh


@pytest.fixture(scope="session", autouse=True)
def _no_orphans() -> Iterator[None]:
    before = worker_pids()
    yield
    launcher.shutdown()
    left = wait_gone(worker_pids() - before, timeout=10)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"worker processes outlived the test session: {sorted(left)}"
