"""Rank output faster than the controller's own stdout takes it (IPython in a terminal, a script piped to a slow
reader): the controller holds a bounded backlog (output.Backlog) and the ranks wait in their writes, as they would
on a slow terminal; no line is lost, and no rank or host agent takes the pause for a lost controller.

Before, the lines piled up in the controller without bound (300 MiB for 100 MB printed through a 5 MB/s pipe, 2.9 GB
in a longer flood), and behind a host agent the pause of a blocked agent could outlast the ranks' heartbeat
timeout."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from monarch_jupyter.kernel.output import BACKLOG_LIMIT

pytestmark = pytest.mark.slow

# per rank, 5 KB each: 2 ranks print 80 MB, more than the backlog's limit and ZeroMQ's queues on both sides of a host
# agent (64 messages of up to 256 KB each) together
LINES = 8000
STALL = 8.0  # seconds the reader of the controller's stdout takes nothing: past the ranks' heartbeat timeout (3 s)

CONTROLLER = textwrap.dedent(f"""
    import json, sys
    from monarch_jupyter import Mesh
    with Mesh(2, launcher=sys.argv[1], heartbeat_timeout=3, start_timeout=120) as m:
        print("FLOOD-START", flush=True)
        m.run("import os\\nfor i in range({LINES}): os.write(1, b'L%d ' % i + b'x' * 5000 + b'\\\\n')", timeout=300)
        m.run("print('tail', rank)", timeout=60)
        backlog = m.parts.cells.writer.backlog
        sys.stderr.write("STATS " + json.dumps({{"peak": backlog.peak, "pauses": backlog.pauses}}) + "\\n")
""")


@pytest.mark.parametrize("launcher", ["local", "agent"])
def test_a_slow_stdout_holds_up_the_ranks_with_a_bounded_backlog_and_loses_no_line(launcher: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", CONTROLLER, launcher], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    deadline = threading.Timer(300, proc.kill)  # a hang fails the test instead of holding it
    deadline.start()
    out = []
    try:
        assert proc.stdout is not None
        while (line := proc.stdout.readline()) and b"FLOOD-START" not in line:
            out.append(line)
        assert line, b"".join(out).decode(errors="replace")
        time.sleep(STALL)  # the stimulus: nobody reads the controller's stdout meanwhile
        rest = proc.stdout.read()
        proc.wait()
    finally:
        deadline.cancel()
        proc.kill()
        proc.wait()
    reader.join(10)
    stderr = b"".join(err).decode(errors="replace")
    assert proc.returncode == 0, stderr[-3000:]
    text = rest.decode()
    for rank in (0, 1):
        seen = [int(ln.split()[1][1:]) for ln in text.splitlines() if ln.startswith(f"[rank{rank}]: L")]
        assert seen == list(range(LINES)), f"rank {rank}: {len(seen)} lines, first gaps {_gaps(seen)[:5]}"
        assert f"[rank{rank}]: tail {rank}" in text
    stats = json.loads(stderr.split("STATS ", 1)[1].splitlines()[0])
    assert stats["pauses"] >= 1, stats  # the flood filled the backlog, and the ranks were held up
    # At most the limit, plus what one read or one message of a host agent adds before the reads pause.
    assert stats["peak"] <= BACKLOG_LIMIT + (1 << 20), stats


def _gaps(seen: list[int]) -> list[int]:
    have = set(seen)
    return [i for i in range(LINES) if i not in have]
