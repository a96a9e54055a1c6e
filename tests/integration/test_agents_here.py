"""A host agent on this host (``python -m monarch_worker.agent``, the printed plain command), without network
namespaces or root: it forks its ranks from one fork server, restarts one of them, reports a death with its signal,
and when the agent itself is killed its ranks are reported dead at once and nothing is left. (The same across
simulated hosts, with torchrun and SLURM, is in tests/multihost.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from monarch_jupyter import Mesh, MeshError, RankDiedError
from tests.conftest import wait_gone, worker_pids

pytestmark = pytest.mark.slow


def test_agent_restart_death_and_loss_on_this_host() -> None:
    before = worker_pids()
    m = Mesh.listen(2, nproc_per_node=2, timeout=120, show=False)
    env = {**os.environ, **m.join_commands().env}
    agent = subprocess.Popen([sys.executable, "-m", "monarch_worker.agent", "--nproc-per-node", "2"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert m.wait_ready(120)
        out = m.run("import os\nprint('tee', rank)\n(os.getppid(), os.environ['LOCAL_WORLD_SIZE'])")
        assert out[0][0] == out[1][0] and out[0][1] == "2"  # both forked by the agent's one fork server
        m.run("kept = rank + 10")
        old = m.status()[1]["pid"]
        m.restart(ranks=[1])
        assert m.status()[1]["pid"] != old
        assert m.run("globals().get('kept')") == {0: 10, 1: None}
        with pytest.raises(MeshError) as info:
            m.run("import os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n")
        err = info.value.errors[1]
        assert isinstance(err, RankDiedError) and err.returncode == -signal.SIGKILL
        m.restart(ranks=[1])
        handle = m.run("import time; time.sleep(60)", block=False)
        t0 = time.monotonic()
        agent.kill()  # SIGKILL: the fork server sees its control socket close and kills both ranks
        with pytest.raises(MeshError) as info:
            handle.result(timeout=30)
        assert time.monotonic() - t0 < 15  # from the dropped connection, not a 30 s heartbeat window
        assert all(isinstance(e, RankDiedError) and "host agent" in str(e) for e in info.value.errors.values())
        assert not wait_gone(worker_pids() - before, timeout=15)
    finally:
        m.stop()
        agent.kill()
        agent.wait()
    assert agent.stdout is not None and b"[rank0]: tee 0" in agent.stdout.read()  # the launcher's log sees it
