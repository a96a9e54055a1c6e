"""What a kernel killed by SIGKILL leaves (helper-49: its secret file in Jupyter's runtime folder, its launcher's log
in the temp folder) is removed by the next kernel on this host that writes one; a live kernel's files stay."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from monarch_jupyter.kernel.launch.join import sweep_stale, write_secret_file


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has it (until the pid is reused, which takes a while)


def test_a_killed_kernels_secret_file_is_swept_and_a_live_ones_stays(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    host = socket.gethostname()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = tmp_path / f"monarch-mesh-{host}-{dead_pid()}-0badcafe.key"
        kept = tmp_path / f"monarch-mesh-{host}-{live.pid}-0badcafe.key"
        other_host = tmp_path / f"monarch-mesh-elsewhere.example-{dead_pid()}-0badcafe.key"  # a shared home
        for f in (stale, kept, other_host):
            f.write_text("00\n")
        path = Path(write_secret_file(None, b"\x01" * 32))
        assert path.parent == tmp_path and path.name.startswith(f"monarch-mesh-{host}-{os.getpid()}-")
        assert not stale.exists() and kept.exists() and other_host.exists() and path.exists()
    finally:
        live.kill()
        live.wait()


def test_launcher_logs_of_dead_kernels_are_swept(tmp_path: Path) -> None:
    stale = tmp_path / f"monarch-torchrun-{dead_pid()}-abcd1234.log"
    mine = tmp_path / f"monarch-torchrun-{os.getpid()}-abcd1234.log"
    unrelated = tmp_path / "monarch-torchrun-notapid.log"
    for f in (stale, mine, unrelated):
        f.write_text("log\n")
    sweep_stale(str(tmp_path), "monarch-torchrun-", ".log")
    assert not stale.exists() and mine.exists() and unrelated.exists()
