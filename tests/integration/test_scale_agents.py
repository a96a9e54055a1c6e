"""``mesh.scale(N)`` on ranks behind a host agent (issue 27, item 5), on this host: ``--launcher torchrun`` starts one
host agent (``python -m monarch_worker.agent``) under torchrun's elastic agent, and the agent forks every rank. Growing
adds ranks on that host through its agent, shrinking stops the highest ones through it; the ranks that stay keep
their processes and namespaces; every rank has torchrun's numbers of the new world and is in a fresh process group of
the new size. A new rank that does not start in time (its host's fork server stopped) is stopped and forgotten, and
the mesh stays as it was. tests/multihost/test_agent_scale.py does the same across fake hosts."""

from __future__ import annotations

import ast
import os
import signal
import time
from typing import Any

import pytest
from jupyter_client.manager import KernelManager

from monarch_jupyter import Mesh, MeshStartError
from tests.integration.test_kernel_faults import execute, kernel, wait_gone

__all__ = ["kernel"]  # the fixture, imported

pytestmark = pytest.mark.slow

WAIT = 120.0
KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
ENV = ("import os\nt = torch.ones(1)\ndist.all_reduce(t)\n"
       f"(rank, world_size, t.item(), tuple(os.environ[k] for k in {KEYS!r}), os.getpid(), os.getppid())")


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (none once it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def wait_children(pid: int, count: int, timeout: float = 30) -> list[int]:
    """Wait until ``pid`` has ``count`` children; returns them (whatever they are at ``timeout``)."""
    deadline = time.monotonic() + timeout
    while len(kids := children(pid)) != count and time.monotonic() < deadline:
        time.sleep(0.1)
    return kids


def test_scale_through_a_host_agent_keeps_namespaces_and_gives_torchruns_numbers_of_the_new_world() -> None:
    with Mesh(2, launcher="torchrun", on_rank_death="restart", start_timeout=WAIT) as m:
        m.push(lr=0.5)
        m.run("kept = rank * 10")
        before = m.run(ENV)
        run_id = before[0][3][8]
        forkserver = before[0][5]  # the agent's fork server: every rank of the host is its child

        report = m.scale(4)
        assert (report.before, report.after, report.started, report.stopped) == (2, 4, [2, 3], [])
        assert "got 1 pushed value" in report.text, report.text
        after = m.run(ENV)
        for r, (rank, world, total, env, _pid, parent) in after.items():
            # LOCAL_RANK/LOCAL_WORLD_SIZE: numbered on the one host; GROUP_*: the host keeps its place (0 of 1)
            assert (rank, world, total, env) == (r, 4, 4.0, (str(r), "4", str(r), "4", "0", "1", str(r), "4",
                                                             run_id)), after[r]
            assert parent == forkserver, "a new rank was not forked by the host's agent"
        assert [after[r][4] for r in (0, 1)] == [before[r][4] for r in (0, 1)], "a surviving rank was replaced"
        assert m.run("(globals().get('kept'), lr)") == {0: (0, 0.5), 1: (10, 0.5), 2: (None, 0.5), 3: (None, 0.5)}
        (host,) = m.hosts()
        assert m.hosts() == {host: [0, 1, 2, 3]}
        assert m.state.group_status() == "up (gloo, 4 of 4 ranks)"
        assert {r: s["state"] for r, s in m.status().items()} == dict.fromkeys(range(4), "idle")

        report = m.scale(1)
        assert (report.started, report.stopped) == ([], [1, 2, 3])
        assert wait_gone([after[r][4] for r in (1, 2, 3)]) == [], "a stopped rank is still running"
        assert m.run(ENV) == {0: (0, 1, 1.0, ("0", "1", "0", "1", "0", "1", "0", "1", run_id), before[0][4],
                                  forkserver)}
        assert m.hosts() == {host: [0]} and sorted(m.status()) == [0] and m.nproc == 1
        assert m.run("kept") == {0: 0}
        with pytest.raises(ValueError, match="more than the hosts of this mesh can carry"):
            m.scale(1_000_000)

        # A new rank that does not start in time: the host's fork server is stopped, so the agent cannot fork it.
        os.kill(forkserver, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(MeshStartError, match=r"new rank 1 did not start within 3 s: the new ranks were stopped "
                                                     r"and the mesh is as it was, 1 ranks") as info:
                m.scale(2, timeout=3)
            assert "--timeout" in str(info.value)
            assert time.monotonic() - t0 < 60
            assert m.nproc == 1 and sorted(m.status()) == [0] and m.hosts() == {host: [0]}
            assert m.run("(world_size, kept)") == {0: (1, 0)}
        finally:
            os.kill(forkserver, signal.SIGCONT)
        # The fork that was queued runs now, and the agent ends it: nothing is left but rank 0.
        assert wait_children(forkserver, 1) == [before[0][4]], "the rank that came late was not ended"
        assert m.scale(3).started == [1, 2]
        got = m.run(ENV)
        assert {r: v[:3] for r, v in got.items()} == {r: (r, 3, 3.0) for r in range(3)}
        assert m.run("globals().get('kept')") == {0: 0, 1: None, 2: None}


@pytest.mark.kernel
def test_scale_through_a_host_agent_in_the_notebook(kernel: tuple[KernelManager, Any]) -> None:
    """%mesh scale -n N on ranks behind a host agent, through a real kernel: its report, %mesh status at each size."""
    _, kc = kernel
    r = execute(kc, "%load_ext monarch_jupyter\nm = %mesh start -n 2 --launcher torchrun\n"
                    "%config MeshMagics.live_view = 'off'")
    assert r.status == "ok", r.traceback
    assert execute(kc, "%%mesh\nkept = rank + 100").status == "ok"
    r = execute(kc, "%mesh scale -n 3")
    assert r.status == "ok" and "scaled from 2 to 3 ranks" in r.results[0], (r.results, r.traceback)
    r = execute(kc, "%%mesh\nimport os\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                    "(t.item(), os.environ['LOCAL_WORLD_SIZE'], globals().get('kept'))")
    assert r.status == "ok", r.traceback
    assert ast.literal_eval(r.results[0]) == {0: (3.0, "3", 100), 1: (3.0, "3", 101), 2: (3.0, "3", None)}
    shown = "".join(execute(kc, "%mesh status").results)
    assert "mesh: world size 3; ranks 0-2: idle on ranks 0-2" in shown and "up (gloo, 3 of 3 ranks)" in shown, shown
    r = execute(kc, "%mesh scale -n 0")
    assert r.status == "error" and "at least 1 rank" in r.stderr, r.stderr
    r = execute(kc, "%mesh scale -n 1")
    assert r.status == "ok" and "stopped ranks 1,2" in r.results[0], (r.results, r.traceback)
    shown = "".join(execute(kc, "%mesh status").results)
    assert "mesh: world size 1; ranks 0: idle on rank 0" in shown and "up (gloo, 1 of 1 ranks)" in shown, shown
    assert execute(kc, "%mesh stop").status == "ok"
