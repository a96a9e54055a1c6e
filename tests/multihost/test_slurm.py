"""SLURM's own daemons (slurmctld here, one slurmd per fake host): ``%mesh start --launcher slurm`` from inside
an allocation runs srun, ranks join across the hosts, restart and stop cancel the job step; the printed sbatch
script works as printed; ranks that cannot reach the controller are reported and their step cancelled."""

from __future__ import annotations

import os
import re
import subprocess
import textwrap
from collections.abc import Iterator

import pytest

from monarch_jupyter import Mesh, MeshError, MeshStartError, RankDiedError
from monarch_jupyter.kernel import registry
from monarch_jupyter.kernel.launch.slurm import SlurmLauncher
from tests.conftest import magic_shell
from tests.multihost.conftest import SlurmCluster

pytestmark = [pytest.mark.multihost, pytest.mark.slow]


@pytest.fixture()
def allocation(slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A job allocation on both nodes, as a notebook started inside ``salloc`` sees it (SLURM_JOB_ID set)."""
    res = slurm.run("salloc", "--no-shell", "-N2", "-n4", "--job-name=mjt-notebook")
    m = re.search(r"Granted job allocation (\d+)", res.stderr)
    assert m, res.stderr
    job = m.group(1)
    for k, v in slurm.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SLURM_JOB_ID", job)
    try:
        yield job
    finally:
        slurm.run("scancel", job)


def monarch_steps(slurm: SlurmCluster) -> list[str]:
    out = slurm.run("squeue", "-h", "-s", "-o", "%i %j").stdout
    return [line.split()[0] for line in out.splitlines() if " monarch-" in line]


def test_start_restart_stop_through_srun(slurm: SlurmCluster, allocation: str) -> None:
    shell = magic_shell()
    saved = registry.peek_current()
    registry.set_current(None)
    host1, host2 = slurm.hosts.name(1), slurm.hosts.name(2)
    try:
        m = shell.run_line_magic(
            "mesh", f"start --launcher slurm -n 4 --nodes 2 --address {slurm.hosts.bridge} --timeout 120")
        try:
            assert m.hosts() == {host1: [0, 1], host2: [2, 3]}  # SLURM's block placement, SLURM_PROCID order
            first = m.state.launcher.step_id()
            assert first.startswith(f"{allocation}.") and monarch_steps(slurm) == [first]
            out = shell.run_cell_magic("mesh", "--order rank", textwrap.dedent("""
                import os, socket
                t = torch.ones(1) * (rank + 1)
                dist.all_reduce(t)
                print("task", os.environ["SLURM_PROCID"], "on", os.environ["SLURMD_NODENAME"])
                (t.item(), int(os.environ["SLURM_LOCALID"]), os.environ["LOCAL_WORLD_SIZE"])
            """))
            assert out == {0: (10.0, 0, "2"), 1: (10.0, 1, "2"), 2: (10.0, 0, "2"), 3: (10.0, 1, "2")}
            m.run("secret = 42")
            m.restart()
            second = m.state.launcher.step_id()
            assert second != first and monarch_steps(slurm) == [second]  # the old step is gone
            assert m.run("'secret' in globals()") == dict.fromkeys(range(4), False)  # fresh processes
        finally:
            m.stop()
        assert monarch_steps(slurm) == []  # nothing outlives the mesh
        for _ in range(50):  # on the nodes only slurmd stays (slurmstepd reaps the tasks, then exits)
            left = [p for k in (1, 2) for p in slurm.hosts.pids(k) if _comm(p) != "slurmd"]
            if not left:
                break
            subprocess.run(["sleep", "0.2"])
        assert not left, [(p, _comm(p)) for p in left]
    finally:
        registry.set_current(saved)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def test_printed_sbatch_script(slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    for k, v in slurm.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    m = Mesh.listen(2, address=slurm.hosts.bridge, nproc_per_node=1, timeout=120, show=False)
    job = ""
    try:
        script = f"{tmp_path}/mesh.sbatch"
        with open(script, "w") as f:
            f.write(m.join_commands().sbatch + "\n")
        res = slurm.run("sbatch", "--parsable", f"--output={tmp_path}/job.out", script)
        assert res.returncode == 0, res.stderr
        job = res.stdout.strip()
        assert m.wait_ready(120)
        assert sorted(m.hosts()) == [slurm.hosts.name(1), slurm.hosts.name(2)]
        assert m.run("t = torch.ones(1); dist.all_reduce(t); t.item()") == {0: 2.0, 1: 2.0}
    finally:
        m.stop()
        if job:
            state = ""
            for _ in range(300):  # up to a minute: slurmd can be slow to finish a job on a loaded machine
                out = slurm.run("scontrol", "show", "job", job).stdout
                if "JobState=" in out:  # a record caught mid-update can lack the field: ask again
                    state = out
                if "JobState=COMPLETED" in state or "JobState=FAILED" in state:
                    break
                subprocess.run(["sleep", "0.2"])
            slurm.run("scancel", job)
    assert "JobState=COMPLETED" in state  # the ranks exited 0 when the mesh stopped


def test_unreachable_controller_is_reported_and_the_step_cancelled(slurm: SlurmCluster, allocation: str) -> None:
    # 127.0.0.1 is the controller's own loopback: tasks on the other hosts cannot reach it
    with pytest.raises(MeshStartError) as info:
        Mesh(2, launcher=SlurmLauncher(nodes=2), address="127.0.0.1", start_timeout=8)
    text = str(info.value)
    assert "0 of 2 ranks joined within 8 s" in text and "missing: ranks 0,1" in text
    assert "reach tcp://127.0.0.1:" in text
    assert monarch_steps(slurm) == []
    assert os.environ["SLURM_JOB_ID"] == allocation


def test_kill9_of_an_agent_reports_its_ranks_and_restart_brings_the_host_back(slurm: SlurmCluster,
                                                                               allocation: str) -> None:
    """srun starts one host agent per node; SIGKILL of one agent: its ranks are reported dead at once (its
    connection drops), the controller goes on, and a full restart (a fresh job step) brings both hosts back."""
    host2 = slurm.hosts.name(2)
    m = Mesh(4, launcher=SlurmLauncher(nodes=2), address=slurm.hosts.bridge, start_timeout=120)
    try:
        assert m.hosts() == {slurm.hosts.name(1): [0, 1], host2: [2, 3]}
        agents = [p for p in slurm.hosts.pids(2) if b"monarch_worker.agent" in _cmdline(p)
                  and b"srun" not in _cmdline(p)]
        assert len(agents) == 1, [(_cmdline(p)) for p in slurm.hosts.pids(2)]
        handle = m.run("import time; time.sleep(60)", block=False)
        os.kill(agents[0], 9)
        with pytest.raises(MeshError) as info:
            handle.result(timeout=60)
        assert {2, 3} <= {r for r, e in info.value.errors.items() if isinstance(e, RankDiedError)}
        assert "host agent" in str(info.value.errors[2]) or "died" in str(info.value.errors[2])
        m.restart()  # srun's step ended (--kill-on-bad-exit); a fresh step starts an agent on each node again
        assert m.hosts() == {slurm.hosts.name(1): [0, 1], host2: [2, 3]}
        assert m.run("t = torch.ones(1); dist.all_reduce(t); t.item()") == dict.fromkeys(range(4), 4.0)
    finally:
        m.stop()
    assert monarch_steps(slurm) == []


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ")
    except OSError:
        return b""
