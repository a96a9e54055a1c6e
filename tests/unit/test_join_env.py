"""What a joined rank reads from its launcher's environment, the controller's address resolution and the
printed commands (no processes)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from monarch_jupyter.kernel.launch.join import JoinCommands, resolve_address
from monarch_worker import join as wjoin

SECRET = "ab" * 32
BASE = {"MONARCH_CONTROLLER": "tcp://10.0.0.1:5555", "MONARCH_SECRET": SECRET}


def cfg(**env: str) -> object:
    return wjoin.config_from_env({**BASE, **env})


def test_torchrun_variables() -> None:
    c = cfg(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="h1", MASTER_PORT="29500",
            TORCHELASTIC_RUN_ID="r1")
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size) == (3, 4, 1, 2)
    assert c.launcher_env["MASTER_ADDR"] == "h1" and c.launcher_env["TORCHELASTIC_RUN_ID"] == "r1"
    assert c.relay_output and c.relay_tee and c.secret == SECRET


def test_slurm_variables_and_tasks_per_node() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
               "SLURM_STEP_TASKS_PER_NODE": "3(x2),1", "SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0"}
    c = cfg(**env)
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size) == (5, 7, 0, 1)
    assert cfg(**{**env, "SLURM_NODEID": "1"}).local_world_size == 3
    assert c.launcher_env["SLURM_JOB_ID"] == "12"
    assert "MASTER_ADDR" not in c.launcher_env  # srun sets none: the controller relays rank 0's store


def test_torchrun_under_srun_uses_torchrun_numbers() -> None:
    # one torchrun agent per node started by srun: SLURM_* describe the agents, RANK/WORLD_SIZE the ranks
    c = cfg(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="0", RANK="5", WORLD_SIZE="8", LOCAL_RANK="1",
            LOCAL_WORLD_SIZE="4")
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size) == (5, 8, 1, 4)


def test_openmpi_and_no_launcher() -> None:
    c = cfg(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="1",
            OMPI_COMM_WORLD_LOCAL_SIZE="2")
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size) == (1, 2, 1, 2)
    c = cfg(MASTER_ADDR="x", MASTER_PORT="1")
    assert (c.rank, c.world_size) == (-1, -1)
    assert "MASTER_ADDR" not in c.launcher_env  # env:// needs a rank from the launcher


@pytest.mark.parametrize("env, match", [
    ({"MONARCH_CONTROLLER": ""}, "MONARCH_CONTROLLER is not set"),
    ({"MONARCH_CONTROLLER": "10.0.0.1:5555"}, "not an address like tcp://"),
    ({"MONARCH_SECRET": ""}, "no secret"),
    ({"MONARCH_SECRET": "abc"}, "at least 32 hex digits"),
    ({"RANK": "x"}, "RANK='x' is not a number"),
    ({"RANK": "4", "WORLD_SIZE": "4"}, "rank 4 of world size 4"),
    ({"MONARCH_SECRET_FILE": "/nonexistent/key"}, "cannot read MONARCH_SECRET_FILE"),
])
def test_bad_environment_names_the_variable(env: dict[str, str], match: str) -> None:
    with pytest.raises(wjoin.JoinConfigError, match=match):
        wjoin.config_from_env({**BASE, **env})


def test_secret_file_wins_and_loose_mode_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "k"
    key.write_text("cd" * 16 + "\n")
    key.chmod(0o600)
    assert cfg(MONARCH_SECRET_FILE=str(key)).secret == "cd" * 16
    assert "readable by other users" not in capsys.readouterr().err
    key.chmod(0o644)
    cfg(MONARCH_SECRET_FILE=str(key))
    assert "chmod 600" in capsys.readouterr().err


def test_module_refuses_arguments_and_explains_environment() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MONARCH_")}
    res = subprocess.run([sys.executable, "-m", "monarch_worker", "--secret", SECRET], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "takes no arguments" in res.stderr and "MONARCH_SECRET_FILE" in res.stderr
    res = subprocess.run([sys.executable, "-m", "monarch_worker"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "MONARCH_CONTROLLER is not set" in res.stderr
    res = subprocess.run([sys.executable, "-m", "monarch_worker", "--help"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and "MONARCH_CONTROLLER" in res.stdout


def test_resolve_address() -> None:
    assert resolve_address(None) == ("127.0.0.1", "127.0.0.1")
    assert resolve_address("lo") == ("127.0.0.1", "127.0.0.1")
    bind, advertised = resolve_address("*")
    assert bind == "0.0.0.0" and advertised
    checked = 0
    for _, name in socket.if_nameindex():
        try:
            ip, advertised = resolve_address(name)
        except ValueError as e:
            assert "has no IPv4 address" in str(e)
            continue
        assert ip == advertised and wjoin.interface_of(ip) == name  # an interface, its address, and back
        checked += 1
    assert checked >= 1  # lo at least
    with pytest.raises(ValueError, match="neither an interface of this host") as info:
        resolve_address("no-such-host.invalid")
    assert "lo" in str(info.value)


def test_commands_name_the_secret_file_never_the_secret() -> None:
    c = JoinCommands("tcp://10.0.0.1:5555", "/home/u/.key", 8, 4, curve_serverkey="Z" * 40,
                     rdzv_endpoint="10.0.0.1:4000", rdzv_id="monarch-1", python="python")
    text = str(c)
    # one host agent per host (it forks the host's 4 ranks) ...
    assert ("torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:4000 --rdzv-id "
            "monarch-1 --max-restarts 0 -m monarch_worker.agent --nproc-per-node 4") in text
    assert "#SBATCH --nodes=2" in c.sbatch and "#SBATCH --ntasks-per-node=1" in c.sbatch
    assert c.sbatch.endswith("srun python -m monarch_worker.agent --nproc-per-node 4")
    assert c.generic.endswith("python -m monarch_worker.agent --nproc-per-node 4")
    # ... and the one-process-per-rank form, still offered
    assert "torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d" in text
    assert text.count("-m monarch_worker\n") == 1
    assert "MONARCH_SECRET_FILE=/home/u/.key" in c.generic and "MONARCH_CURVE_SERVERKEY=" + "Z" * 40 in c.generic
    assert "MONARCH_SECRET=" not in c.generic.replace("MONARCH_SECRET_FILE", "")
    one = JoinCommands("tcp://127.0.0.1:1", "/k", 2, 2)
    assert "--standalone" in one.torchrun_args() and one.nnodes == 1


def test_address_toward_and_interface_of_loopback() -> None:
    assert wjoin.address_toward("tcp://127.0.0.1:9") == "127.0.0.1"
    assert wjoin.interface_of("127.0.0.1") == "lo"
