"""The GPU check: one prepared command for a machine with NVIDIA GPUs (issue 30, item 7).

    PYTHON=python3 bash scripts/gpu-check.sh            # every check, within --budget seconds (default 450)
    python3 bench/gpu_check.py --list                   # the checks, what each needs, its timeout
    python3 bench/gpu_check.py --only nccl_one_rank,dashboard_cuda [--json PATH]

Each check runs in its own fresh interpreter (``python bench/gpu_check.py --run-check NAME``, so a check that hangs
or crashes takes nothing else with it) under its own timeout, and prints ``DETAIL`` lines (sizes, seconds, ratios)
that the summary repeats. A check passes when its process exits 0, is skipped when it exits 77 (it says why: for
example it needs two GPUs), and fails otherwise: an error, a wrong result, or its timeout (its whole process group
is then ended). One failing check never stops the others. The total stays within ``--budget`` seconds: a check
that would start with less time left than it may need is skipped and says so.

Where no CUDA device is visible (no GPU, no CUDA build of torch, ``CUDA_VISIBLE_DEVICES=""``) it prints
``no CUDA device: skipped`` and exits 0. Otherwise it exits 0 when no check failed, 1 when some did; 2 for a bad
argument. The check bodies are in bench/gpu_checks.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SKIP_CODE = 77  # a check's exit status for "skipped" (automake's convention)
DEFAULT_BUDGET = 450.0  # seconds: the whole run, within the 8 minutes the issue allows


@dataclass(frozen=True)
class Check:
    """One check: ``name``, what it shows (``about``), GPUs it needs, its timeout (seconds) and the command that
    runs it (default: this file with ``--run-check NAME``)."""

    name: str
    about: str
    gpus: int = 1
    timeout: float = 60.0
    argv: tuple[str, ...] = ()

    def command(self) -> list[str]:
        return list(self.argv) or [sys.executable, os.path.abspath(__file__), "--run-check", self.name]


@dataclass
class Outcome:
    """What one check gave: ``status`` PASS, FAIL or SKIP, seconds it took, its DETAIL lines, why (fail/skip)."""

    name: str
    status: str
    seconds: float = 0.0
    details: list[str] = field(default_factory=list)
    reason: str = ""
    output: str = ""


CHECKS: tuple[Check, ...] = (
    Check("cuda_then_start", "%mesh start after the kernel touched CUDA (the fork trap)", 1, 60),
    Check("nccl_one_rank", "1-rank NCCL group, all_reduce; --device rank push/pull vs device memcpy", 1, 75),
    Check("dashboard_cuda", "the dashboard's CUDA memory columns follow an allocation", 1, 45),
    Check("hang_force", "a collective that never completes, released by %mesh interrupt --force", 1, 75),
    Check("ddp_vs_torchrun", "a DDP step on CUDA, %mesh run against torchrun (median step)", 1, 90),
    Check("lightning_gpu", 'Lightning fit with accelerator="gpu", devices=1, strategy="mesh"', 1, 120),
    Check("raise_release_nccl", "a rank that raises releases the other from its NCCL collective", 2, 60),
    Check("hang_force_two", "rank 0 in an all_reduce rank 1 never joins, released by --force", 2, 60),
    Check("nccl_two_ranks", "2-rank NCCL all_reduce and --device rank push/pull", 2, 60),
    Check("busbw_vs_torchrun", "all_reduce busbw on 2 ranks, %mesh run against torchrun", 2, 90),
)


def cuda_devices() -> tuple[int, str]:
    """(number of visible CUDA devices, why 0 when it is 0). Asks torch (NVML; no CUDA context is made)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return 0, 'CUDA_VISIBLE_DEVICES=""'
    try:
        import torch
    except ImportError:
        return 0, "torch is not importable"
    if not torch.backends.cuda.is_built():
        return 0, f"torch {torch.__version__} is built without CUDA"
    n = torch.cuda.device_count()
    return n, "" if n else "torch sees no CUDA device"


def _end_group(proc: subprocess.Popen) -> None:
    """End a check's process group: SIGTERM, then SIGKILL after 5 s (a mesh's fork server ends its ranks when its
    controller is gone)."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_one(check: Check, timeout: float) -> Outcome:
    """Run ``check`` in its own process group for at most ``timeout`` seconds; never raises for what it does."""
    # This checkout's packages first (monarch_worker through its .typecheck link), whatever is installed.
    path = (ROOT, os.path.join(ROOT, ".typecheck"), os.environ.get("PYTHONPATH", ""))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p), PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    proc = subprocess.Popen(check.command(), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        _end_group(proc)
        out, _ = proc.communicate()
        code = None
    took = time.monotonic() - t0
    lines = (out or "").splitlines()
    details = [ln[len("DETAIL "):] for ln in lines if ln.startswith("DETAIL ")]
    tail = "\n".join(lines[-25:])
    if code is None:
        return Outcome(check.name, "FAIL", took, details, f"timed out after {timeout:.0f} s", tail)
    if code == 0:
        return Outcome(check.name, "PASS", took, details, "", tail)
    said = [ln for ln in lines if ln.startswith("SKIP ")]
    if code == SKIP_CODE:
        return Outcome(check.name, "SKIP", took, details, said[-1][5:] if said else "skipped", tail)
    last = next((ln for ln in reversed(lines) if ln.strip()), "")
    return Outcome(check.name, "FAIL", took, details, f"exit status {code}: {last[:300]}", tail)


def run_checks(checks: Sequence[Check], gpus: int, budget: float,
               report: Callable[[Outcome], None] = lambda o: None) -> list[Outcome]:
    """Run each check in turn (skipping those that need more than ``gpus`` GPUs, and those that would start with
    less than their timeout left of ``budget`` seconds); ``report`` sees each outcome as it comes."""
    deadline = time.monotonic() + budget
    outcomes = []
    for check in checks:
        left = deadline - time.monotonic()
        if check.gpus > gpus:
            outcome = Outcome(check.name, "SKIP", reason=f"needs {check.gpus} GPUs, {gpus} visible")
        elif left < check.timeout:
            outcome = Outcome(check.name, "SKIP", reason=f"{left:.0f} s of the {budget:.0f} s budget left, "
                                                         f"it may need {check.timeout:.0f} s")
        else:
            outcome = run_one(check, check.timeout)
        outcomes.append(outcome)
        report(outcome)
    return outcomes


def format_outcome(o: Outcome, verbose: bool = False) -> str:
    head = f"{o.status:4}  {o.name:20} {o.seconds:6.1f} s" + (f"  {o.reason}" if o.reason else "")
    lines = [head, *(f"        {d}" for d in o.details)]
    if o.status == "FAIL" and (verbose or o.output):
        lines += [f"        | {ln}" for ln in o.output.splitlines()]
    return "\n".join(lines)


def summary(outcomes: Sequence[Outcome], gpus: int, took: float) -> str:
    count = {s: sum(o.status == s for o in outcomes) for s in ("PASS", "FAIL", "SKIP")}
    lines = [f"GPU check: {count['PASS']} passed, {count['FAIL']} failed, {count['SKIP']} skipped "
             f"on {gpus} GPU(s) in {took:.0f} s"]
    for o in outcomes:
        lines.append(f"  {o.status:4}  {o.name}" + (f": {'; '.join(o.details)}" if o.details else "")
                     + (f" ({o.reason})" if o.reason else ""))
    return "\n".join(lines)


def select(only: str | None) -> list[Check]:
    """The checks named in ``only`` (comma-separated), in the table's order; all when None.

    Raises ValueError naming the unknown names and the known ones.
    """
    if not only:
        return list(CHECKS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = {c.name for c in CHECKS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(unknown)}; known: {', '.join(c.name for c in CHECKS)}")
    return [c for c in CHECKS if c.name in names]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="comma-separated check names (default: all; see --list)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                        help=f"seconds for the whole run (default {DEFAULT_BUDGET:.0f})")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("--json", default=None, help="also write the outcomes to this file")
    parser.add_argument("--run-check", default=None, help=argparse.SUPPRESS)  # inside a check's own process
    args = parser.parse_args(argv)
    if args.budget <= 0:
        parser.error(f"--budget must be a positive number of seconds, got {args.budget:g}")
    try:
        args.checks = select(args.only)
    except ValueError as e:
        parser.error(str(e))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.run_check:
        sys.path.insert(0, HERE)
        import gpu_checks  # bench/gpu_checks.py: the bodies, imported only inside a check's process

        return gpu_checks.run(args.run_check)
    if args.list:
        for c in CHECKS:
            print(f"{c.name:20} {c.gpus} GPU(s)  {c.timeout:4.0f} s  {c.about}")
        return 0
    gpus, why = cuda_devices()
    if gpus == 0:
        print(f"no CUDA device: skipped ({why})")
        return 0
    print(f"GPU check: {gpus} CUDA device(s), {len(args.checks)} check(s), budget {args.budget:.0f} s", flush=True)
    t0 = time.monotonic()
    outcomes = run_checks(args.checks, gpus, args.budget, lambda o: print(format_outcome(o), flush=True))
    print()
    print(summary(outcomes, gpus, time.monotonic() - t0))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpus": gpus, "outcomes": [asdict(o) for o in outcomes]}, f, indent=1)
    return 1 if any(o.status == "FAIL" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
