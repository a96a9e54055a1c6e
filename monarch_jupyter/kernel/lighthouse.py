"""The torchft Lighthouse a mesh owns (``torchft=True``): ``Lighthouse``.

torchft's Lighthouse forms a quorum of replica groups at every step; the mesh runs it as a child process of the
kernel (``python -m monarch_worker.lighthouse``), one per generation: started before the ranks, its address given to
every rank as ``TORCHFT_LIGHTHOUSE`` (``env``), ended with the generation (``stop``: stdin closed, then SIGTERM, then
SIGKILL). It also ends when the kernel dies (its stdin closes; ``PR_SET_PDEATHSIG``).

A Lighthouse that dies while the mesh runs (``check``, on the I/O thread once per heartbeat interval) is started
again on the same port, so the ranks' Managers find it at the address they have; the notebook gets one line
saying so (``lighthouse_note``). Until it is back, torchft's quorums wait (a step needs one), and training goes on
once it is.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from ..errors import MeshStartError
from .hints import lighthouse_note

log = logging.getLogger(__name__)

__all__ = ["Lighthouse", "LighthouseError", "START_TIMEOUT"]

#: Seconds the Lighthouse process gets to import torchft and bind its port.
START_TIMEOUT = 60.0


class LighthouseError(MeshStartError):
    """The Lighthouse did not start (the message says why and what to do)."""


class Lighthouse:
    """The Lighthouse process of one mesh (see the module docstring).

    ``min_replicas``: returns the quorum's minimum (the option, read at each start); ``note``: writes one line to the
    notebook (any thread, no lock held).
    """

    def __init__(self, min_replicas: Callable[[], int], note: Callable[[str], None]) -> None:
        self.min_replicas = min_replicas
        self.note = note
        self.proc: subprocess.Popen | None = None
        self.address = ""  # http://host:port, once started
        self.port = 0
        self.restarts = 0  # times it was started again after it died
        self._lock = threading.Lock()  # proc, address, port (the I/O thread checks while the caller stops)

    def env(self) -> dict[str, str]:
        """What every rank gets in its environment (empty when no Lighthouse runs): its address, and torchft's
        Rust log at warnings only (its INFO lines, several per step, would flood the cell), unless set."""
        if not self.address:
            return {}
        return {"TORCHFT_LIGHTHOUSE": self.address, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}

    def start(self, port: int = 0) -> str:
        """Start the Lighthouse on ``port`` (0: any free port); returns its address.

        Raises LighthouseError when it does not report its address within ``START_TIMEOUT`` seconds."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "monarch_worker.lighthouse", "--port", str(port),
             "--min-replicas", str(self.min_replicas())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")})
        line = _read_line(proc, START_TIMEOUT)
        try:
            address = str(json.loads(line)["address"])
        except (ValueError, KeyError, TypeError):
            proc.kill()
            _, err = proc.communicate(timeout=5)
            tail = err.decode(errors="replace").strip()[-2000:]
            raise LighthouseError("the torchft Lighthouse did not start: "
                                  + (tail or f"no address within {START_TIMEOUT:g} s")
                                  + f"; run  {sys.executable} -c 'import torchft'  to see why, or start the mesh "
                                  "without --torchft") from None
        with self._lock:
            self.proc, self.address = proc, address
            self.port = int(address.rsplit(":", 1)[1])
        threading.Thread(target=_drain, args=(proc,), name="monarch-lighthouse", daemon=True).start()
        return address

    def stop(self) -> None:
        """End the Lighthouse and wait for it (5 s, then SIGKILL)."""
        with self._lock:
            proc, self.proc, self.address, self.port = self.proc, None, "", 0
        if proc is None:
            return
        try:
            assert proc.stdin is not None
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.terminate()
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def check(self, now: float) -> None:
        """(I/O thread, once per heartbeat interval) A Lighthouse that died is started again on its port."""
        with self._lock:
            proc, port = self.proc, self.port
        if proc is None or proc.poll() is None:
            return
        code = proc.returncode
        with self._lock:
            if self.proc is not proc:
                return  # stopped meanwhile
            self.proc = None
        try:
            self.start(port)
            self.restarts += 1
            self.note(lighthouse_note(proc.pid, code, self.address, ""))
        except (LighthouseError, OSError) as e:
            self.note(lighthouse_note(proc.pid, code, "", str(e)))


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first line ``proc`` writes to stdout, or "" when it exits or ``timeout`` seconds pass first."""
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.readline() if proc.stdout else b""), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while reader.is_alive() and time.monotonic() < deadline and proc.poll() is None:
        reader.join(0.05)
    reader.join(0.5)
    return out[0].decode(errors="replace") if out else ""


def _drain(proc: subprocess.Popen) -> None:
    """Read what the Lighthouse writes (its log), so that a full pipe never blocks it; debug log only."""
    for stream in (proc.stderr,):
        if stream is None:
            continue
        for line in stream:
            log.debug("lighthouse: %s", line.decode(errors="replace").rstrip())
