"""What a cell shows, through a real Jupyter kernel (jupyter_client): everything a rank wrote during a cell, at
the C level too and without a trailing newline, shows in that cell; the cell's name in tracebacks and pdb,
``<mesh In[N]>``, carries the number the notebook shows beside the cell (the execute_reply's execution_count)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import pytest
from jupyter_client.manager import KernelManager, start_new_kernel

from tests.integration.test_kernel import TIMEOUT, execute, streams

pytestmark = [pytest.mark.kernel, pytest.mark.slow]


@pytest.fixture(scope="module")
def kc() -> Iterator[Any]:
    """A kernel with a 2-rank mesh (output in rank order), shared by this module's tests."""
    km: KernelManager
    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=TIMEOUT, env=dict(os.environ), cwd=os.getcwd())
    try:
        # No live view: these tests read the streams the kernel writes (a cell's view would take them; its flat
        # text does not say which stream a line came from).
        reply, _ = execute(kc, "%load_ext monarch_jupyter\nm = %mesh start -n 2\n"
                               "%config MeshMagics.stream_order = 'rank'\n%config MeshMagics.live_view = 'off'")
        assert reply["status"] == "ok", reply
        yield kc
    finally:
        execute(kc, "%mesh stop")
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def lines(msgs: list[dict], name: str = "stdout") -> list[str]:
    return streams(msgs, name).splitlines()


def test_c_output_without_a_newline_shows_in_its_own_cell(kc: Any) -> None:
    setup = ("%%mesh\nimport ctypes, os\nlibc = ctypes.CDLL(None)\n"
             "c_stdout = ctypes.c_void_p.in_dll(libc, 'stdout')\nc_stderr = ctypes.c_void_p.in_dll(libc, 'stderr')\n")
    reply, _ = execute(kc, setup)
    assert reply["status"] == "ok", reply
    # C stdio, buffered in the rank (line-buffered stdout), no newline at the end: each write in a cell of its own.
    for code, out, err in [
        ("libc.printf(b'cprintf-%d', rank)", ["[rank0]: cprintf-0", "[rank1]: cprintf-1"], []),
        ("libc.fputs(b'fputs-' + str(rank).encode(), c_stdout)", ["[rank0]: fputs-0", "[rank1]: fputs-1"], []),
        ("libc.fprintf(c_stderr, b'cstderr-%d', rank)", [], ["[rank0]: cstderr-0", "[rank1]: cstderr-1"]),
    ]:
        reply, msgs = execute(kc, "%%mesh\n" + code)
        assert reply["status"] == "ok", reply
        assert (lines(msgs), lines(msgs, "stderr")) == (out, err), code
    # The next cell that writes from C starts clean: nothing of the previous cell shows up here.
    reply, msgs = execute(kc, "%%mesh\nlibc.printf(b'next-%d\\n', rank)\nos.write(1, b'os-write')\n")
    assert reply["status"] == "ok", reply
    assert lines(msgs) == ["[rank0]: next-0", "[rank0]: os-write", "[rank1]: next-1", "[rank1]: os-write"], msgs
    # Python's print without a newline: in its cell, and the next cell starts clean.
    reply, msgs = execute(kc, "%%mesh --ranks 0\nprint('py-no-newline', end='')\n")
    assert reply["status"] == "ok", reply
    assert lines(msgs) == ["[rank0]: py-no-newline"], msgs
    reply, msgs = execute(kc, "%%mesh --ranks 0\nprint('after')\n")
    assert lines(msgs) == ["[rank0]: after"], msgs


def test_cell_name_carries_the_number_beside_the_cell(kc: Any) -> None:
    for _ in range(2):  # twice: an off-by-one would show on every cell
        code = "%%mesh --ranks 1\nx = 1\nraise ValueError('where am I')\n"
        # stop_on_error=False: a cell of its own, not aborted after an earlier error (test_kernel.execute)
        msg_id = kc.execute(code, stop_on_error=False)
        reply, msgs = _collect(kc, msg_id)
        shown = [m["content"]["execution_count"] for m in msgs if m["msg_type"] == "execute_input"]
        assert reply["status"] == "error"
        tb = "\n".join(reply["traceback"])
        names = set(re.findall(r"<mesh In\[(\d+)\]>", re.sub(r"\x1b\[[0-9;]*m", "", tb)))
        assert names == {str(reply["execution_count"])}, (names, reply["execution_count"], tb)
        assert shown == [reply["execution_count"]]


def _collect(kc: Any, msg_id: str) -> tuple[dict, list[dict]]:
    reply = kc.get_shell_msg(timeout=TIMEOUT)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=TIMEOUT)
    msgs = []
    while True:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
        msgs.append(msg)
    return reply["content"], msgs


def test_a_flood_of_output_reaches_the_cell_and_the_listeners_whole_and_in_order(kc: Any) -> None:
    """Lines are routed and told to listeners in batches (one "output" event per run of lines that came together);
    none is lost, duplicated or reordered, in the cell or in the events."""
    code = ("got = {0: [], 1: []}\n"
            "def listen(kind, data):\n"
            "    if kind == 'output' and data['stream'] == 'stdout':\n"
            "        assert data['text'] == '\\n'.join(data['lines'])\n"
            "        got[data['rank']].extend(data['lines'])\n"
            "m.add_listener(listen)\n")
    reply, _ = execute(kc, code)
    assert reply["status"] == "ok", reply
    reply, msgs = execute(kc, "%%mesh\nfor i in range(5000):\n    print(f'F {rank} {i}')\n")
    assert reply["status"] == "ok", reply
    assert lines(msgs) == [f"[rank{r}]: F {r} {i}" for r in (0, 1) for i in range(5000)]  # rank order
    reply, msgs = execute(kc, "m.remove_listener(listen)\n"
                              "print(all(got[r] == [f'F {r} {i}' for i in range(5000)] for r in (0, 1)))")
    assert reply["status"] == "ok", reply
    assert streams(msgs, "stdout").strip() == "True"


def test_a_huge_line_is_cut_with_its_size_and_file_and_messages_stay_bounded(kc: Any) -> None:
    """A rank prints one 40 MB line (issue 24, 6b): the cell shows its first ``output_line_limit`` bytes and a note
    with its size and the file that holds it whole; no stream message to the frontend is larger than the cap, and
    the lines around it show as they are."""
    code = ("%%mesh --ranks 1\nimport sys\nprint('before')\n"
            "sys.stdout.write('H' + 'x' * 39_999_998 + 'T\\n')\nprint('after')\n")
    reply, msgs = execute(kc, code)
    assert reply["status"] == "ok", reply
    sizes = [len(m["content"]["text"]) for m in msgs if m["msg_type"] == "stream"]
    assert max(sizes) <= 1 << 18, sizes
    shown = lines(msgs)
    assert shown[0] == "[rank1]: before" and shown[2] == "[rank1]: after", [s[:80] for s in shown]
    m = re.search(r"^\[rank1\]: Hx+ \.\.\. \[line of 40,000,000 bytes truncated to its first 65,536; the whole "
                  r"line: (\S+)\]$", shown[1])
    assert m and len(shown[1]) < 65_536 + 200, shown[1][-200:]
    path = m[1]
    try:
        assert os.path.getsize(path) == 40_000_000
        with open(path, "rb") as f:
            assert f.read(1) == b"H" and (f.seek(-1, 2), f.read(1))[1] == b"T"
    finally:
        os.unlink(path)


def test_a_ranks_stdout_and_stderr_come_in_the_order_it_wrote_them(kc: Any) -> None:
    """Issue 26: a progress bar on stderr and the prints around it, as the rank wrote them (Python-level stderr
    travels embedded in the stdout pipe; C-level writes to fd 2 keep their own pipe)."""
    code = ("%%mesh --ranks 0\nimport sys\nfor i in range(30):\n    print('out', i)\n"
            "    sys.stderr.write(f'err {i}\\n')\nprint('last', file=sys.stderr)\nprint('done')\n")
    reply, msgs = execute(kc, code)
    assert reply["status"] == "ok", reply
    seen = [(m["content"]["name"], line) for m in msgs if m["msg_type"] == "stream"
            for line in m["content"]["text"].splitlines()]
    expected = [pair for i in range(30) for pair in (("stdout", f"[rank0]: out {i}"), ("stderr", f"[rank0]: err {i}"))]
    assert seen == [*expected, ("stderr", "[rank0]: last"), ("stdout", "[rank0]: done")], seen
