"""JupyterLab's visual debugger on ranks of another host (issue 28): a real kernel driven through jupyter_client, as
JupyterLab drives it (DAP on the control channel), whose mesh's ranks run behind a host agent on a fake host (a
network namespace). A rank's debugpy adapter listens on that host's loopback only; the kernel reaches it through the
mesh's own signed connection (kernel/daprelay.py, monarch_worker.dapbridge), never through a port open to the
network. Without the relay no rank of another host stops at a breakpoint (the kernel's loopback is not theirs)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator

import pytest

from tests.conftest import reap
from tests.integration.dapclient import DapKernel
from tests.multihost.conftest import FakeHosts, start_agents

pytestmark = [pytest.mark.multihost, pytest.mark.kernel, pytest.mark.slow]

pytest.importorskip("debugpy")

HOST = 1  # the fake host of both ranks; the kernel runs outside it


@pytest.fixture(scope="module")
def k(fake_hosts: FakeHosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DapKernel]:
    """A kernel whose mesh has 2 ranks behind a host agent on fake host ``HOST``, its debugger on."""
    kernel = DapKernel(os.getcwd())
    procs: list[subprocess.Popen] = []
    try:
        kernel.debugger_on()
        run = kernel.execute(
            "%load_ext monarch\n%config MeshMagics.live_view = 'off'\nimport json\nfrom monarch_jupyter import Mesh\n"
            f"m = Mesh.listen(2, address={fake_hosts.bridge!r}, nproc_per_node=2, timeout=180, show=False)\n"
            "print('CMD', json.dumps(m.join_commands().torchrun))")
        assert run.reply["status"] == "ok", (run.stdout, run.errors)
        command = json.loads(run.stdout.split("CMD ", 1)[1].splitlines()[0])
        procs = start_agents(fake_hosts, command, tmp_path_factory.mktemp("dap-agents"), which=(HOST,))
        run = kernel.execute("print('READY', m.wait_ready(180), sorted(m.hosts()))")
        assert f"READY True ['{fake_hosts.name(HOST)}']" in run.stdout, (run.stdout, run.errors)
        yield kernel
        run = kernel.execute("m.stop()")
        assert run.reply["status"] == "ok", (run.stdout, run.errors)
    finally:
        kernel.close()
        reap(procs)
    assert not fake_hosts.left(HOST, timeout=30)


def _breakpoints(k: DapKernel, code: str, lines: list[int]) -> str:
    path = k.dap("dumpCell", code=code)["body"]["sourcePath"]
    rep = k.dap("setBreakpoints", source={"path": path}, breakpoints=[{"line": n} for n in lines],
                sourceModified=False)
    assert rep["success"], rep
    return path


def _stopped(k: DapKernel) -> tuple[int, dict]:
    """The next stopped event: (the rank named in its description, its body)."""
    ev = k.wait_event(lambda e: e.get("event") == "stopped", what="stopped event")
    return int(ev["body"]["description"].split(":")[0].split()[1]), ev["body"]


def _locals(k: DapKernel, thread: int) -> tuple[dict, dict[str, str]]:
    frame = k.dap("stackTrace", threadId=thread)["body"]["stackFrames"][0]
    scopes = k.dap("scopes", frameId=frame["id"])["body"]["scopes"]
    names = k.dap("variables", variablesReference=scopes[0]["variablesReference"])["body"]["variables"]
    return frame, {v["name"]: v["value"] for v in names}


def _listening(hosts: FakeHosts, k: int) -> set[tuple[str, str]]:
    """(address, port) of every TCP socket listening on fake host ``k`` (its own network namespace)."""
    out = subprocess.run(["ip", "netns", "exec", hosts.name(k), "ss", "-ltnH"], capture_output=True, text=True,
                         check=True).stdout
    found = set()
    for line in out.splitlines():
        addr, _, port = line.split()[3].rpartition(":")
        found.add((addr.strip("[]"), port))
    return found


def _relayed(k: DapKernel, expected: list[int], timeout: float = 30) -> list[int]:
    """The ranks with a relayed DAP stream whose pump thread still runs in the kernel, once they are ``expected``
    (a stream ends a moment after its rank did) or ``timeout`` seconds passed."""
    run = k.execute(f"import time\nt0 = time.monotonic()\n"
                    f"while m.parts.dap.ranks() != {expected!r} and time.monotonic() - t0 < {timeout}:\n"
                    f"    time.sleep(0.1)\nprint('RELAYED', json.dumps(m.parts.dap.ranks()))")
    return json.loads(run.stdout.split("RELAYED ", 1)[1].splitlines()[0])


def test_breakpoint_on_a_rank_of_another_host(k: DapKernel, fake_hosts: FakeHosts) -> None:
    before = _listening(fake_hosts, HOST)
    code = "%%mesh\nx = rank * 10\nif rank == 1:\n    y = x + 1\n    print('rank 1 went on', y)\nx + 5\n"
    path = _breakpoints(k, code, [4])
    run = k.submit(code)
    rank, stop = _stopped(k)
    assert rank == 1 and stop["reason"] == "breakpoint", stop
    names = [t["name"] for t in k.dap("threads")["body"]["threads"]]
    assert {"rank 0: MainThread", "rank 1: MainThread"} <= set(names), names
    frame, values = _locals(k, stop["threadId"])
    assert (frame["source"]["path"], frame["line"], frame["name"]) == (path, 4, "rank 1: <module>")
    assert values["rank"] == "1" and values["x"] == "10" and "y" not in values
    ev = k.dap("evaluate", expression="x + 1000", frameId=frame["id"], context="repl")
    assert ev["success"] and ev["body"]["result"] == "1010", ev
    # The ranks' adapters started listening for this cell, on the rank host's loopback only.
    new = _listening(fake_hosts, HOST) - before
    assert new, "no debug adapter listens on the rank's host"
    assert all(addr in ("127.0.0.1", "::1") for addr, _ in new), new
    assert k.dap("continue", threadId=stop["threadId"])["success"]
    k.wait(run)
    assert run.reply["status"] == "ok" and run.results == ["{0: 5, 1: 15}"], (run.stdout, run.errors)
    assert "[rank1]: rank 1 went on 11" in run.stdout
    _breakpoints(k, code, [])


def test_a_remote_rank_that_dies_while_stopped(k: DapKernel) -> None:
    code = "%%mesh --ranks 1\nimport os\nq = os.getpid()\nq\n"
    _breakpoints(k, code, [4])
    run = k.submit(code)
    rank, stop = _stopped(k)
    assert rank == 1
    frame, values = _locals(k, stop["threadId"])
    os.kill(int(values["q"]), 9)  # the fake host shares this machine's process ids
    # The frontend is told the rank's stopped thread is gone (the relay ended with the rank); the cell ends with
    # the rank's death, and no relay thread of it is left in the kernel.
    ev = k.wait_event(lambda e: e.get("event") == "continued" and e["body"]["threadId"] == stop["threadId"],
                      what="continued event of the dead rank")
    assert ev["body"]["allThreadsContinued"] is False
    k.wait(run)
    assert run.reply["status"] == "error", run
    rep = k.dap("variables", variablesReference=frame["id"])
    assert not rep["success"] and "rank 1 is not attached" in rep["message"], rep
    assert _relayed(k, [0]) == [0]  # rank 0's stream stays
    # Restarted by its agent, the rank is attached afresh and stops again.
    assert k.execute("m.restart(ranks=[1])").reply["status"] == "ok"
    run = k.submit(code)
    rank, stop = _stopped(k)
    assert rank == 1
    assert k.dap("continue", threadId=stop["threadId"])["success"]
    k.wait(run)
    assert run.reply["status"] == "ok", (run.stdout, run.errors)
    assert _relayed(k, [0, 1]) == [0, 1]  # the fresh process's stream
    _breakpoints(k, code, [])
