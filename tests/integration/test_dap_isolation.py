"""The mesh works with JupyterLab's debugger switched on, in either order (issue 28, item 0): the fork server and
the ranks never inherit the kernel's debugpy session. Driven as JupyterLab drives it: DAP on the control channel."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import wait_gone, worker_pids
from tests.integration.dapclient import DapKernel

pytestmark = [pytest.mark.kernel, pytest.mark.slow]

pytest.importorskip("debugpy")  # the kernel's debugger is debugpy

# What each process of the mesh says of the debugger: its command line and whether pydevd is loaded in it.
PROBE = ("import json, sys\nfrom monarch_jupyter.kernel.launch.local import fork_server_pid as _fsp\n"
         "print('FS', json.dumps(open(f'/proc/{_fsp()}/cmdline', 'rb').read().decode().split(chr(0))))\n")
# m.run, not a %%mesh cell: a %%mesh cell run while the debugger is on attaches the ranks to it (on purpose).
RANK_PROBE = ("import sys, os, torch\n"
              "(sorted(m for m in ('pydevd', 'debugpy') if m in sys.modules),\n"
              " sorted(k for k in os.environ if k.startswith(('PYDEVD_', 'DEBUGPY_'))),\n"
              " int(torch.ones(3).sum()) + rank)")


def _check_mesh_clean(k: DapKernel, nproc: int) -> None:
    run = k.execute(PROBE)
    assert run.reply["status"] == "ok", run
    cmd = json.loads(run.stdout.split("FS ", 1)[1].splitlines()[0])
    assert not any("pydevd" in part or "debugpy" in part for part in cmd), cmd
    run = k.execute(f"m.run({RANK_PROBE!r})")
    assert run.reply["status"] == "ok", (run.stdout, run.errors)
    want = {r: ([], [], 3 + r) for r in range(nproc)}
    assert run.results == [repr(want)], run


@pytest.mark.parametrize("order", ["debugger first", "mesh first"])
def test_mesh_with_the_kernel_debugger_on(order: str) -> None:
    k = DapKernel(os.getcwd())
    pids: set[int] = set()
    try:
        if order == "debugger first":
            k.debugger_on()
            # the kernel is debugged: its own process now carries pydevd's settings and patches
            run = k.execute("import os, sys\nprint(sorted(k for k in os.environ if k.startswith('PYDEVD_')),"
                            " '_pydev_bundle.pydev_monkey' in sys.modules)")
            assert "True" in run.stdout, run
        run = k.execute("%load_ext monarch\n%config MeshMagics.live_view = 'off'\nm = %mesh start -n 2\n"
                        "import json; print('PIDS', json.dumps([s['pid'] for s in m.status().values()]))")
        assert run.reply["status"] == "ok", (run.stdout, run.errors)
        pids = set(json.loads(run.stdout.split("PIDS ", 1)[1].splitlines()[0]))
        if order == "mesh first":
            k.debugger_on()
        _check_mesh_clean(k, 2)
        # A restart forks fresh ranks (and a fresh fork server, when the old one is gone) with the debugger on.
        run = k.execute("from monarch_jupyter.kernel.launch import local as _l\n_l.shutdown()\n%mesh restart")
        assert run.reply["status"] == "ok", (run.stdout, run.errors)
        _check_mesh_clean(k, 2)
        run = k.execute("print('PIDS', json.dumps([s['pid'] for s in m.status().values()]))")
        pids |= set(json.loads(run.stdout.split("PIDS ", 1)[1].splitlines()[0]))
        # The kernel's own debugger still answers.
        rep = k.dap("threads")
        assert rep["success"] and any(t["name"] == "MainThread" for t in rep["body"]["threads"]), rep
    finally:
        k.close()
    assert not wait_gone(pids & worker_pids(), timeout=30)
