"""The torchft Lighthouse of a mesh, as a process the mesh owns: ``python -m monarch_worker.lighthouse``.

The controller (monarch_jupyter/kernel/lighthouse.py) starts it with the mesh when ``torchft=True``. It binds the
Lighthouse on every interface (``--port``, 0: any free port), writes one JSON line with its address
(``{"address": "http://host:port"}``) to stdout, and runs until its stdin closes (the controller stopped the mesh, or
died: no orphan) or it gets SIGTERM. It also dies with its parent (``PR_SET_PDEATHSIG``).

Quorum settings (milliseconds): ``--join-timeout-ms`` (how long a quorum waits for replicas that have not asked yet,
once enough have), ``--heartbeat-timeout-ms`` (a replica silent this long is out), ``--min-replicas``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import signal
import sys
import threading

__all__ = ["main", "JOIN_TIMEOUT_MS", "HEARTBEAT_TIMEOUT_MS"]

#: Milliseconds a quorum waits, once enough replicas asked, for the others (torchft's default is 60,000: a survivor
#: would wait a minute for a dead peer). A replacement that comes later joins at the next step's quorum.
JOIN_TIMEOUT_MS = 100
#: Milliseconds without a heartbeat (replicas send one every 100 ms) after which a replica is out of the quorum.
HEARTBEAT_TIMEOUT_MS = 5000


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m monarch_worker.lighthouse")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--join-timeout-ms", type=int, default=JOIN_TIMEOUT_MS)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=HEARTBEAT_TIMEOUT_MS)
    args = parser.parse_args(argv)
    _die_with_parent()
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind=f"[::]:{args.port}", min_replicas=args.min_replicas,
                              join_timeout_ms=args.join_timeout_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    sys.stdout.write(json.dumps({"address": server.address()}) + "\n")
    sys.stdout.flush()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: done.set())

    def watch_stdin() -> None:
        sys.stdin.buffer.read()  # returns at EOF: the controller is gone or stopped us
        done.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    while not done.wait(1.0):
        pass
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
