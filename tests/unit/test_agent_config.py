"""What a host agent reads (agentconfig.agent_config) and gives its ranks (rank_environment), the rules that admit
or refuse it (launch/admission.py), and how it batches what its ranks did (hostlink.EventBatch). No processes."""

from __future__ import annotations

import pytest

from monarch_jupyter.kernel.launch.admission import Joiner, agent_refusal, rank_refusal
from monarch_worker import protocol as P
from monarch_worker.agentconfig import agent_config, rank_environment
from monarch_worker.hostlink import EventBatch
from monarch_worker.join import JoinConfigError

BASE = {"MONARCH_CONTROLLER": "tcp://10.0.0.1:5555", "MONARCH_SECRET": "ab" * 32}


def test_agent_takes_its_host_number_from_its_launcher() -> None:
    torchrun = {**BASE, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "h1", "MASTER_PORT": "29500"}
    cfg = agent_config(torchrun, ["--nproc-per-node", "4"])
    assert (cfg.launcher, cfg.group_rank, cfg.group_world_size, cfg.nproc) == ("torchrun", 1, 2, 4)
    assert cfg.launcher_env["MASTER_ADDR"] == "h1"
    slurm = {**BASE, "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
             "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "MONARCH_NPROC_PER_NODE": "8"}
    cfg = agent_config(slurm, [])
    assert (cfg.launcher, cfg.group_rank, cfg.group_world_size, cfg.nproc) == ("slurm", 1, 2, 8)
    assert agent_config(BASE, ["--nproc-per-node", "2"]).group_rank == -1  # by hand: the controller numbers it


@pytest.mark.parametrize(("env", "argv", "match"), [
    ({}, [], "how many ranks"),
    ({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "4"}, ["--nproc-per-node", "2"],
     "torchrun started 4 agents on this host"),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1"}, ["--nproc-per-node", "2"],
     "srun started several agents"),
    ({}, ["--nproc-per-node", "2", "--secret", "x"], "unknown arguments"),
    ({"MONARCH_NPROC_PER_NODE": "many"}, [], "is not a number"),
])
def test_bad_agent_configurations_name_the_fix(env: dict, argv: list, match: str) -> None:
    with pytest.raises(JoinConfigError, match=match):
        agent_config({**BASE, **env}, argv)


def test_ranks_see_torchruns_variables_for_n_workers_per_host() -> None:
    agent_env = {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "ROLE_RANK": "1",
                 "ROLE_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_PORT": "29500",
                 "TORCHELASTIC_ERROR_FILE": "/tmp/tr/attempt_0/0/error.json", "MONARCH_SECRET": "s"}
    env = rank_environment(agent_env, "torchrun", [4, 5, 6, 7], 2, 8, 1, 2)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_RANK",
                                "ROLE_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_PORT")} == {
        "RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "ROLE_RANK": "6",
        "ROLE_WORLD_SIZE": "8", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_PORT": "29500"}
    assert env["TORCHELASTIC_ERROR_FILE"] == "/tmp/tr/attempt_0/2/error.json" and "MONARCH_SECRET" not in env
    assert env["OMP_NUM_THREADS"] == "1"
    slurm = rank_environment({"SLURM_PROCID": "1", "SLURM_NODEID": "1"}, "slurm", [2, 3], 1, 4, 1, 2)
    assert (slurm["SLURM_PROCID"], slurm["SLURM_LOCALID"], slurm["SLURM_NTASKS"]) == ("3", "1", "4")
    assert slurm["SLURM_TASKS_PER_NODE"] == "2(x2)" and slurm["SLURM_GTIDS"] == "2,3"
    assert rank_environment({"OMP_NUM_THREADS": "4"}, "none", [0, 1], 0, 2, 0, 1)["OMP_NUM_THREADS"] == "4"


def _agent(host: str, group: int = -1, hosts: int = -1, nproc: int = 2) -> Joiner:
    return Joiner(host.encode(), P.AgentHello(host=host, pid=1, nproc=nproc, addr="10.0.0.2", group_rank=group,
                                              group_world_size=hosts), 1, 0.0, count=nproc, agent=True)


def test_admission_refusals_name_the_host_and_the_fix() -> None:
    def refuse(hello: P.AgentHello, pending: list[Joiner], complete: bool = False, failed: str = "") -> str:
        return agent_refusal(b"new", hello, 4, {j.identity: j for j in pending}, complete, failed)

    hello = P.AgentHello(host="h2", pid=7, nproc=2, addr="10.0.0.3", group_rank=0, group_world_size=2)
    assert refuse(hello, []) == ""
    assert "host slot 0 is taken: the host agent of h1" in refuse(hello, [_agent("h1", 0, 2)])
    assert "h2 came too late" in refuse(hello, [], complete=True)
    assert "came too late" in refuse(hello, [], failed="0 of 4 ranks joined")
    old = P.AgentHello(host="h2", pid=7, nproc=2, addr="x", version=P.PROTOCOL_VERSION - 1)
    assert "speaks protocol" in refuse(old, [])
    assert "3 hosts with 2 ranks each (6 ranks), but the mesh listens for 4" in refuse(
        P.AgentHello(host="h2", pid=7, nproc=2, addr="x", group_rank=1, group_world_size=3), [])
    assert "brings 4 ranks, but only 2" in refuse(P.AgentHello(host="h2", pid=7, nproc=4, addr="x"),
                                                  [_agent("h1")])
    rank = P.Hello(rank=0, pid=3, host="h3")
    assert "joining through host agents" in rank_refusal(b"r", rank, 4, {b"h1": _agent("h1")}, False, "")


def test_a_host_answers_a_cell_in_one_batch() -> None:
    batch = EventBatch(hold=0.02)
    batch.expect[7] = {0, 1, 2}
    batch.result(0, P.Result(7, "ok", duration=0.1), b"", [])
    batch.line(1, "stdout", "hello")
    batch.result(1, P.Result(7, "ok", duration=0.2), b"", [])
    assert batch.due(batch.since) > 0  # rank 2 still owes its result: held (up to 20 ms)
    batch.result(2, P.Result(7, "ok", duration=0.3), b"", [])
    assert batch.due(batch.since) == 0.0  # everyone answered: goes now
    msg, payload, buffers = batch.take()
    # the line stays between the results it came between; ranks 1 and 2 ended alike: one event, a span (consecutive)
    assert msg.events == [("done", 7, [0], [0.1]), ("out", 1, "stdout", "hello"),
                          ("span", 7, 1, 3, P.pack_durations([0.2, 0.3]))]
    assert batch.due(0.0) is None and payload == b"" and buffers == []
    batch.expect[8] = {0}
    batch.result(0, P.Result(8, "ok", has_value=True), b"PICKLE", [b"buf"])
    msg, payload, buffers = batch.take()
    assert msg.events == [("res", 0, 8, "ok", True, None, 0.0, 6, 1)] and payload == b"PICKLE" and buffers == [b"buf"]
