"""In-process checks of the torchrun-parity pieces (issue 11): the environment torchrun's agent would export, what
a user's init_process_group asks of the mesh's group, NameError hints, and the checks of %mesh run before anything
runs. The real processes are in tests/integration/test_torchrun_env.py, test_scripts.py, test_torchrun_parity.py."""

from __future__ import annotations

import threading
import types
from pathlib import Path

import pytest
from IPython.core.magic_arguments import parse_argstring

from monarch_jupyter.errors import MeshError, RemoteError
from monarch_jupyter.kernel.hints import hint_for, name_hints
from monarch_jupyter.kernel.scripts import script_call
from monarch_jupyter.magics import scripts as script_magics
from monarch_worker import elastic_env
from monarch_worker.group import MeshGroup


def env_for(local_world_size: int, environ: dict[str, str], **kw: object) -> dict[str, str]:
    args = {"rank": 1, "world_size": 4, "local_rank": 1, "local_world_size": local_world_size, "group_rank": 0,
            "group_world_size": 4 // local_world_size, "run_id": "rid", "error_file": "/e", **kw}
    return elastic_env.torchrun_env(environ=environ, **args)  # type: ignore[arg-type]


def test_torchrun_env_has_every_variable_with_torchruns_values() -> None:
    env = env_for(2, {})
    assert set(elastic_env.TORCHRUN_VARIABLES) - set(env) == {"MASTER_ADDR", "MASTER_PORT"}  # the rendezvous's
    assert env["ROLE_RANK"] == "1" and env["ROLE_WORLD_SIZE"] == "4" and env["ROLE_NAME"] == "default"
    assert env["GROUP_WORLD_SIZE"] == "2" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert env["TORCHELASTIC_RESTART_COUNT"] == env["TORCHELASTIC_MAX_RESTARTS"] == "0"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


@pytest.mark.parametrize(("local_world_size", "environ", "omp"), [
    (2, {}, "1"),  # several ranks on a host: one thread each
    (1, {}, None),  # alone on its host: the machine's default
    (2, {"OMP_NUM_THREADS": "3"}, None),  # the user's own value wins (it stays in the environment as it is)
])
def test_omp_num_threads_follows_torchruns_rule(local_world_size: int, environ: dict, omp: str | None) -> None:
    assert env_for(local_world_size, environ).get("OMP_NUM_THREADS") == omp


def test_the_users_values_of_passed_through_variables_win() -> None:
    env = env_for(2, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM"})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM"


def test_apply_keeps_what_torchrun_exported() -> None:
    environ = {"TORCHELASTIC_RUN_ID": "torchruns", "GROUP_RANK": "3", "RANK": "9"}
    elastic_env.apply(rank=1, world_size=2, local_rank=1, local_world_size=2, elastic={"run_id": "ours"},
                      launched_by_torchrun=True, environ=environ)
    assert environ["TORCHELASTIC_RUN_ID"] == "torchruns" and environ["GROUP_RANK"] == "3" and environ["RANK"] == "1"
    fresh: dict[str, str] = {}
    elastic_env.apply(rank=1, world_size=2, local_rank=1, local_world_size=2,
                      elastic={"run_id": "ours", "group_rank": 0, "group_world_size": 1}, launched_by_torchrun=False,
                      environ=fresh)
    try:
        assert fresh["TORCHELASTIC_RUN_ID"] == "ours" and fresh["GROUP_RANK"] == "0"
        error_file = Path(fresh["TORCHELASTIC_ERROR_FILE"])
        assert error_file.parts[-3:] == ("attempt_0", "1", "error.json") and error_file.parent.is_dir()
    finally:
        elastic_env.cleanup()
    assert not error_file.parent.exists()


def group(backend: str = "gloo", world_size: int = 2, rank: int = 1) -> MeshGroup:
    g = MeshGroup(lambda: True, lambda msg: None)
    g.backend, g.world_size, g.rank = backend, world_size, rank
    return g


@pytest.mark.parametrize(("kwargs", "differs"), [
    ({}, []),
    ({"backend": "gloo", "world_size": 2, "rank": 1}, []),
    ({"backend": "GLOO"}, []),
    ({"backend": "cpu:gloo,cuda:nccl"}, []),  # the name for the mesh's device type is gloo
    ({"backend": "nccl"}, ["backend nccl"]),
    ({"world_size": 4, "rank": 3}, ["world size 4", "rank 3"]),
])
def test_what_an_init_process_group_asks_that_the_group_is_not(kwargs: dict, differs: list[str]) -> None:
    g = group()
    got = g.differences(kwargs.get("backend"), kwargs.get("world_size", -1), kwargs.get("rank", -1))
    assert got == differs
    if differs:
        assert ("--backend" in g.fix(got)) == differs[0].startswith("backend")


def test_an_nccl_mesh_refuses_a_gloo_request() -> None:
    assert group("nccl").differences("gloo", -1, -1) == ["backend gloo"]
    assert group("nccl").differences("cpu:gloo,cuda:nccl", -1, -1) == []


def test_hints_say_what_is_safe() -> None:
    assert "import it in the cell (import types)" in hint_for("types", types)
    assert "(import json.decoder as p)" in hint_for("p", __import__("json.decoder").decoder)
    assert "%mesh push model" in hint_for("model", [1.0, 2.0])
    assert "cannot be sent" in hint_for("lock", threading.Lock())


def test_name_hints_only_for_names_the_notebook_has() -> None:
    errors = {0: RemoteError(0, "NameError", "name 'model' is not defined"),
              1: RemoteError(1, "NameError", "name 'model' is not defined"),
              2: RemoteError(2, "NameError", "name 'other' is not defined"),
              3: RemoteError(3, "ValueError", "name 'model' is not defined")}
    e = MeshError(errors, hint="earlier hint")
    name_hints(e, {"model": [1]})
    assert e.hint.splitlines() == ["earlier hint", "hint: 'model' exists in the notebook, not on the ranks: send it "
                                   "with  %mesh push model  (mesh.push(model=model) in Python), or create it in a "
                                   "%%mesh cell"]
    quiet = MeshError({0: RemoteError(0, "NameError", "name 'x' is not defined")})
    name_hints(quiet, {})
    assert quiet.hint == ""


def test_script_call_checks_before_anything_runs(tmp_path: Path) -> None:
    (tmp_path / "s.py").write_text("")
    fn, args, kwargs = script_call(tmp_path / "s.py", ["--n", 3, tmp_path], module=False, local=True)
    assert args == (str(tmp_path / "s.py"), ["--n", "3", str(tmp_path)]) and kwargs["path"] == str(tmp_path / "s.py")
    assert fn.__module__ == "monarch_worker.scripts"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        script_call(tmp_path / "missing.py", [], module=False, local=True)
    # Ranks on other hosts look for the file themselves.
    assert script_call(tmp_path / "missing.py", [], module=False, local=False)[2]["path"].endswith("missing.py")
    with pytest.raises(ValueError, match="module name"):
        script_call("not a module", [], module=True, local=True)
    with pytest.raises(ValueError, match="script path"):
        script_call("", [], module=False, local=True)
    with pytest.raises(TypeError, match="command-line strings"):
        script_call(tmp_path / "s.py", [None], module=False, local=True)


def test_mesh_run_passes_everything_after_the_script_to_it() -> None:
    args = parse_argstring(script_magics.run, "--ranks 0,1 train.py --lr 0.1 -m x --ranks 3")
    assert (args.ranks, args.module, args.target, args.args) == ("0,1", False, "train.py",
                                                                 ["--lr", "0.1", "-m", "x", "--ranks", "3"])
    args = parse_argstring(script_magics.run, "-m pkg.train --epochs 2")
    assert (args.module, args.target, args.args) == (True, "pkg.train", ["--epochs", "2"])


def test_group_status_tells_the_truth() -> None:
    from monarch_jupyter.kernel.events import EventBus
    from monarch_jupyter.kernel.state import MeshState, RankState
    from monarch_worker.options import MeshOptions

    state = MeshState(2, MeshOptions(), EventBus())
    assert state.group_status() == "none: the mesh is not running"
    state.new_generation(b"s")
    state.running = True
    for info in state.ranks.values():
        info.state, info.group = RankState.IDLE, "gloo"
    assert state.group_status() == "up (gloo, 2 of 2 ranks)"
    assert state.status()[1]["group"] == "gloo"
    state.ranks[1].group = ""  # what rank 1's heartbeat said
    assert state.group_status().startswith("down on rank 1: no default process group there")
    state.group_down = "rank 1 died"
    assert state.group_status() == "down: rank 1 died"
