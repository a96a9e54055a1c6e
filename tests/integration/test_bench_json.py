"""Every bench's ``--json PATH`` (issue 30): each bench runs in its quickest mode (one or two ranks, one repetition,
no peers) and the file it writes is read back: the same figures as the printed table, and its goals with whether
they were met. Timing values are not judged (a shared machine), only that the file says what the table printed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

# bench -> (quick arguments, figures the file must hold, goals, (printed label, figure, unit scale, decimals))
QUICK = {
    "bench_backpressure": (["--n", "1", "--mb", "1", "--rate", "0", "--launchers", "local"], {"local_after"},
                           {"local_held_MiB"}, ("local  after   flood", "local_after.flood_s", 1, 3)),
    "bench_interrupt": (["--n", "2", "--grace", "2", "--repeat", "1"], {"after"}, {"usable_s", "forced"},
                        ("after   interrupt", "after.interrupt_s", 1, 2)),
    "bench_core": (["--n", "1", "--cells", "5", "--repeat", "1", "--no-peers"],
                   {"import_torch_s", "cold_start_s", "restart_s", "api_s", "magic_s", "cpu_kernel_s"},
                   {"cold_start_x_import_torch", "magic_cell_s"},
                   ("trivial cell, %%mesh magic (median)", "magic_s", 1e3, 3)),
    "bench_dap": (["--n", "1", "--hits", "1", "--cells", "2"],
                  {"first_stopped_s", "stopped_s", "sidebar_s", "trivial_debugger_off_s", "trivial_debugger_on_s"},
                  {"stopped_s"},
                  ("trivial cell, debugger off (median)", "trivial_debugger_off_s", 1e3, 2)),
    "bench_faults": (["--ddp-only", "--n", "2", "--repeat", "1"], {"ddp"}, set(),
                     ("rank raises inside DDP: raise -> cell's MeshError", "ddp.ddp_raise_ours_s", 1, 3)),
    "bench_parity": (["--nproc", "1", "--steps", "4", "--repeat", "1"],
                     {"step_torchrun_s", "step_mesh_run_s", "step_ratio", "edit_to_first_step_torchrun_s",
                      "edit_to_first_step_run_s", "edit_to_first_step_cell_s"},
                     {"step_mesh_over_torchrun", "loop_speedup_run", "loop_speedup_cell"},
                     ("steady step, torchrun", "step_torchrun_s", 1e3, 2)),
    "bench_tensors": (["--n", "1", "--reps", "1", "--no-peers"],
                      {"memcpy_256MiB_s", "clone_256MiB_s", "push_256MiB_s", "push_64MiB_socket_1rank_s",
                       "agent_push_64MiB_socket_s", "gather_64MiB_s", "pull_64MiB_s"},
                      {"push_256MiB_over_memcpy", "push_64MiB_socket_1rank_s"},
                      ("monarch_jupyter: push_256MiB_s", "push_256MiB_s", 1, 4)),
}


@pytest.mark.parametrize("bench", sorted(QUICK))
def test_a_bench_writes_the_figures_it_prints_as_json(bench: str, tmp_path: Path) -> None:
    args, figures, goals, (label, key, scale, decimals) = QUICK[bench]
    path = tmp_path / f"{bench}.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / f"{bench}.py"), *args, "--json", str(path)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(path.read_text())
    assert data["bench"] == bench and data["cpus"] and data["python"]
    assert figures <= set(data["figures"]), sorted(data["figures"])
    assert set(data["goals"]) == goals
    for name, g in data["goals"].items():
        assert isinstance(g["value"], float) and g["goal"][0] in "<>" and g["met"] in (True, False), (name, g)
    value = data["figures"]
    for part in key.split("."):
        value = value[part]
    assert isinstance(value, float) and math.isfinite(value) and value > 0
    printed = next(line for line in proc.stdout.splitlines() if label in line)
    assert f"{value * scale:.{decimals}f}" in printed, (printed, value)
    assert f"figures written to {path}" in proc.stdout
