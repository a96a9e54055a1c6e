"""What the ranks see is what torchrun's workers see (issue 11): the same script, run by a real
``torchrun --nproc-per-node 2`` and on each kind of mesh (local, torchrun launcher, ranks started by hand with
``python -m monarch_worker``), reports its environment, torch's threads, torchelastic and what Lightning makes of
it; the reports must be the same but for values that legitimately differ (ports, run id, error-file path)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from monarch_jupyter import Mesh
from monarch_worker.elastic_env import TORCHRUN_VARIABLES

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "torchrun_scripts"
REPORT = SCRIPTS / "env_report.py"
# Variables a mesh adds for itself (docs/torchrun.md says why); torchrun has none of them.
MESH_EXTRAS = {"GLOO_SOCKET_IFNAME", "TORCH_FR_BUFFER_SIZE"}
# Values that legitimately differ between two launches: where the store listens, the run's id, a temporary path.
DIFFERENT_VALUES = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "MASTER_ADDR"}


def read_reports(out: Path, n: int) -> dict[int, dict]:
    return {r: json.loads(Path(f"{out}.{r}").read_text()) for r in range(n)}


@pytest.fixture(scope="module")
def torchrun_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """The reference: the script under a real torchrun, started with this test's environment; each report's
    "added" holds what torchrun added to (or changed in) that environment."""
    out = tmp_path_factory.mktemp("torchrun") / "report"
    base = dict(os.environ)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(REPORT),
                           str(out), "--lightning"], capture_output=True, text=True, timeout=240, env=base)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r: added(report, base) for r, report in read_reports(out, 2).items()}


def added(report: dict, base: dict[str, str]) -> dict:
    """``report`` with "env" narrowed to what the launcher added to or changed in ``base``, its environment
    (PYTEST_CURRENT_TEST changes between a fixture's start and the test: pytest's, not a launcher's)."""
    return {**report, "env": {k: v for k, v in report["env"].items()
                              if base.get(k) != v and k != "PYTEST_CURRENT_TEST"}}


def compare(mesh_report: dict, reference: dict, allowed_extra: set[str]) -> None:
    """Assert that a rank's report equals torchrun's but for the values listed above (and ``allowed_extra``
    variables only the mesh has). Both reports' "env" hold only what their launcher added (``added``)."""
    env, ref = mesh_report["env"], reference["env"]
    missing = {k for k in ref if k not in env}
    extra = {k for k in env if k not in ref} - allowed_extra
    assert not missing, f"torchrun's variables missing on the mesh: {sorted(missing)}"
    assert not extra, f"variables torchrun does not set: {sorted(extra)}"
    differ = {k for k in ref if env[k] != ref[k]}
    assert differ <= DIFFERENT_VALUES, {k: (env[k], ref[k]) for k in differ - DIFFERENT_VALUES}
    assert socket.gethostbyname(env["MASTER_ADDR"]) == socket.gethostbyname(ref["MASTER_ADDR"])
    tail = os.path.join("attempt_0", env["LOCAL_RANK"], "error.json")
    assert env["TORCHELASTIC_ERROR_FILE"].endswith(tail) and ref["TORCHELASTIC_ERROR_FILE"].endswith(tail)
    assert set(TORCHRUN_VARIABLES) - set(os.environ) <= set(ref), "torchrun exports fewer than elastic_env lists"
    for key in ("threads", "torchelastic", "rank", "world_size", "lightning"):
        assert mesh_report.get(key) == reference.get(key), key


def test_local_ranks_see_what_torchrun_workers_see(torchrun_reports: dict[int, dict], tmp_path: Path) -> None:
    out = tmp_path / "report"
    base = dict(os.environ)
    with Mesh(2, start_timeout=120) as m:
        assert m.run_script(REPORT, out, "--lightning") == {0: 0, 1: 0}
        mesh = {r: added(report, base) for r, report in read_reports(out, 2).items()}
    for r in (0, 1):
        compare(mesh[r], torchrun_reports[r], MESH_EXTRAS)
        assert mesh[r]["torchelastic"] is True
        if "OMP_NUM_THREADS" not in os.environ:
            assert mesh[r]["threads"][0] == 1  # OMP_NUM_THREADS=1 applied after the fork
        # Lightning picks TorchElasticEnvironment and its world-size check fires as under torchrun.
        assert mesh[r]["lightning"]["environment"] == "TorchElasticEnvironment"
        assert "does not match the world size (2)" in mesh[r]["lightning"]["devices_4"]  # equal to torchrun's
    assert mesh[0]["env"]["TORCHELASTIC_RUN_ID"] == mesh[1]["env"]["TORCHELASTIC_RUN_ID"]


@pytest.fixture()
def hand_started() -> Iterator[tuple[Mesh, list[subprocess.Popen]]]:
    """Two ranks started by hand with the printed generic command (no RANK or LOCAL_* variables)."""
    m = Mesh.listen(2, show=False, timeout=120)
    env = {**os.environ, **m.join_commands().env, "MONARCH_RELAY_TEE": "0"}
    procs = [subprocess.Popen([sys.executable, "-m", "monarch_worker"], env=env) for _ in range(2)]
    try:
        assert m.wait_ready(120)
        yield m, procs
    finally:
        m.stop()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_ranks_started_by_hand_see_what_torchrun_workers_see(
        torchrun_reports: dict[int, dict], hand_started: tuple[Mesh, list], tmp_path: Path) -> None:
    m, _ = hand_started
    out = tmp_path / "report"
    m.run_script(REPORT, out)
    mesh = {r: added(report, dict(os.environ)) for r, report in read_reports(out, 2).items()}
    extras = MESH_EXTRAS | {k for k in mesh[0]["env"] if k.startswith("MONARCH_")}
    for r in (0, 1):
        reference = {k: v for k, v in torchrun_reports[r].items() if k != "lightning"}
        compare(mesh[r], reference, extras)  # threads included: OMP_NUM_THREADS=1 once admitted, unless set


def test_ranks_under_the_torchrun_launcher_keep_torchruns_values(
        torchrun_reports: dict[int, dict], tmp_path: Path) -> None:
    out = tmp_path / "report"
    with Mesh(2, launcher="torchrun", start_timeout=120) as m:
        m.run_script(REPORT, out)
        mesh = {r: added(report, dict(os.environ)) for r, report in read_reports(out, 2).items()}
    extras = MESH_EXTRAS | {k for k in mesh[0]["env"] if k.startswith("MONARCH_")}
    for r in (0, 1):
        reference = {k: v for k, v in torchrun_reports[r].items() if k != "lightning"}
        compare(mesh[r], reference, extras)
