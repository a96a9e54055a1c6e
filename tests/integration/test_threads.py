"""Ranks run torch with the threads a fresh interpreter under torchrun would have (OMP_NUM_THREADS /
MKL_NUM_THREADS applied after the fork), on local and joined meshes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from monarch_jupyter import Mesh

pytestmark = pytest.mark.slow

PROBE = ("import json, torch; print(json.dumps([torch.get_num_threads(), torch.get_num_interop_threads(), "
         "torch.__config__.parallel_info()]))")


def fresh(env: dict[str, str]) -> list:
    """What a fresh interpreter with ``env`` reports (torchrun starts each rank that way)."""
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def on_ranks(mesh: Mesh) -> dict[int, tuple[list, dict[str, str]]]:
    code = ("import json, os, torch\n"
            "(json.loads(json.dumps([torch.get_num_threads(), torch.get_num_interop_threads(), "
            "torch.__config__.parallel_info()])), dict(os.environ))")
    return mesh.run(code)


def test_local_ranks_use_one_thread_as_under_torchrun(mesh: Mesh) -> None:
    for r, (seen, env) in on_ranks(mesh).items():
        assert env["OMP_NUM_THREADS"] == "1"
        assert seen[0] == 1, f"rank {r} runs {seen[0]} intra-op threads"
        assert seen == fresh(env), f"rank {r}: threads differ from a fresh interpreter with its environment"


@pytest.mark.parametrize("extra", [{"OMP_NUM_THREADS": "2"}, {"MKL_NUM_THREADS": "1", "OMP_NUM_THREADS": "2"}])
def test_the_users_own_thread_settings_win(extra: dict[str, str]) -> None:
    with Mesh(2, env=extra, start_timeout=120) as m:
        for r, (seen, env) in on_ranks(m).items():
            assert {k: env[k] for k in extra} == extra
            assert seen == fresh(env), f"rank {r}: threads differ from a fresh interpreter with its environment"


def test_a_single_rank_keeps_the_machine_default() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    with Mesh(1, start_timeout=120) as m:
        (seen, rank_env), = on_ranks(m).values()
        assert "OMP_NUM_THREADS" not in rank_env or "OMP_NUM_THREADS" in os.environ  # torchrun sets it only for N > 1
        assert seen == fresh({**env, **{k: rank_env[k] for k in ("OMP_NUM_THREADS",) if k in rank_env}})


def test_joined_ranks_use_one_thread_as_under_torchrun() -> None:
    with Mesh(2, launcher="torchrun", start_timeout=120) as m:
        for r, (seen, env) in on_ranks(m).items():
            assert env["OMP_NUM_THREADS"] == "1" and seen[0] == 1
            assert seen == fresh(env), f"rank {r}: threads differ from a fresh interpreter with its environment"


def test_ranks_started_by_hand_use_one_thread_per_rank_on_a_shared_host() -> None:
    """``python -m monarch_worker`` without LOCAL_WORLD_SIZE: the controller finds two ranks on this host, so each
    gets OMP_NUM_THREADS=1 when admitted (torchrun's rule), applied after torch was imported."""
    m = Mesh.listen(2, show=False, timeout=120)
    env = {k: v for k, v in {**os.environ, **m.join_commands().env}.items() if k != "OMP_NUM_THREADS"}
    procs = [subprocess.Popen([sys.executable, "-m", "monarch_worker"], env={**env, "MONARCH_RELAY_TEE": "0"})
             for _ in range(2)]
    try:
        assert m.wait_ready(120)
        for r, (seen, rank_env) in on_ranks(m).items():
            assert rank_env["OMP_NUM_THREADS"] == "1" and seen[0] == 1, f"rank {r}: {seen}"
            assert seen == fresh(rank_env), f"rank {r}: threads differ from a fresh interpreter with its environment"
    finally:
        m.stop()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
