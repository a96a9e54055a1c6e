"""scripts/gpu-check.sh and its driver (bench/gpu_check.py) on a machine without GPUs: the skip path, and the
runner's own logic (independent checks, timeouts that end a check's process group, skips, the summary) with checks
that are plain Python commands. The CUDA bodies (bench/gpu_checks.py) run only where a GPU is lent."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gc = _load()


def _no_gpu() -> bool:
    return gc.cuda_devices()[0] == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not reaped yet by its parent) has ended too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not _no_gpu(), reason="a CUDA device is visible: the script would run the checks")
def test_script_without_a_gpu_says_skipped_and_exits_0():
    proc = subprocess.run(["bash", str(SCRIPT)], env=dict(os.environ, PYTHON=sys.executable), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("no CUDA device: skipped"), proc.stdout


def test_hidden_devices_are_skipped_like_none():
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(["bash", str(SCRIPT), "--only", "hang_force"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == 'no CUDA device: skipped (CUDA_VISIBLE_DEVICES="")', proc.stdout


def test_bad_arguments_name_the_problem():
    with pytest.raises(SystemExit) as e:
        gc.parse_args(["--only", "nccl_one_rank,warp_drive"])
    assert e.value.code == 2
    with pytest.raises(ValueError, match="unknown check.*warp_drive; known: cuda_then_start"):
        gc.select("nccl_one_rank,warp_drive")
    with pytest.raises(SystemExit):
        gc.parse_args(["--budget", "-5"])
    assert [c.name for c in gc.select("hang_force, cuda_then_start")] == ["cuda_then_start", "hang_force"]
    assert gc.parse_args([]).checks == list(gc.CHECKS)


def test_every_check_has_a_body_and_the_one_gpu_ones_fit_the_budget():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_checks
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert set(gpu_checks.BODIES) == {c.name for c in gc.CHECKS}
    assert gc.DEFAULT_BUDGET + 30 <= 8 * 60  # the 8 minutes, with room for start-up and one kill


@pytest.mark.skipif(not _no_gpu(), reason="a CUDA device is visible")
def test_a_body_run_here_skips_for_want_of_a_device():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--run-check", "cuda_then_start"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == gc.SKIP_CODE, proc.stdout + proc.stderr
    assert "SKIP no CUDA device" in proc.stdout


def _py(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def test_checks_run_independently_with_timeouts_skips_and_a_summary(tmp_path):
    pidfile = tmp_path / "grandchild"
    hang = (f"import subprocess, time; p = subprocess.Popen(['sleep', '300']); open({str(pidfile)!r}, 'w')"
            f".write(str(p.pid)); print('DETAIL started', flush=True); time.sleep(300)")
    checks = [
        gc.Check("ok", "passes", 1, 30, _py("print('DETAIL 3 MiB in 0.5 s')")),
        gc.Check("broken", "fails", 1, 30, _py("raise SystemExit('wrong sum: 3 != 4')")),
        gc.Check("hangs", "never ends", 1, 3, _py(hang)),
        gc.Check("skips", "says why", 1, 30, _py(f"print('SKIP needs NVLink'); raise SystemExit({gc.SKIP_CODE})")),
        gc.Check("two", "needs two GPUs", 2, 30, _py("raise SystemExit(1)")),
        gc.Check("after", "still runs after the others", 1, 30, _py("print('DETAIL fine')")),
        gc.Check("late", "no time left for it", 1, 600, _py("print('never')")),
    ]
    seen = []
    t0 = time.monotonic()
    outcomes = gc.run_checks(checks, gpus=1, budget=300, report=seen.append)
    assert seen == outcomes
    by = {o.name: o for o in outcomes}
    assert [(o.name, o.status) for o in outcomes] == [
        ("ok", "PASS"), ("broken", "FAIL"), ("hangs", "FAIL"), ("skips", "SKIP"), ("two", "SKIP"),
        ("after", "PASS"), ("late", "SKIP")]
    assert by["ok"].details == ["3 MiB in 0.5 s"] and by["after"].details == ["fine"]
    assert "wrong sum: 3 != 4" in by["broken"].reason
    assert by["hangs"].reason == "timed out after 3 s" and by["hangs"].details == ["started"]
    assert time.monotonic() - t0 < 120
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 30
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild), "the timed-out check's process group was left running"
    assert by["skips"].reason == "needs NVLink"
    assert by["two"].reason == "needs 2 GPUs, 1 visible"
    assert "budget left" in by["late"].reason
    text = gc.summary(outcomes, 1, 12.0)
    assert text.splitlines()[0] == "GPU check: 2 passed, 2 failed, 3 skipped on 1 GPU(s) in 12 s"
    assert "  PASS  ok: 3 MiB in 0.5 s" in text and "  FAIL  hangs: started (timed out after 3 s)" in text
    shown = gc.format_outcome(by["broken"])
    assert shown.startswith("FAIL  broken") and "| wrong sum: 3 != 4" in shown
