"""Soak: one mesh through a long session, and what grew. Nothing may leak and no cell may lose or misroute output.

    python bench/soak.py [--n 4] [--scale 1.0] [--json FILE]

At --scale 1.0 (the issue's figures): 10,000 cells with output (every 7th also writes a line without a newline at
the fd level), 200 interrupts of running cells, 500 pushes and 500 pulls of 1 to 64 MiB (tensors, through shared
memory), 100 ``restart(ranks=R)``, 20 rank deaths (the dying rank first starts a ``setsid sleep``, which must end
with it), and 50 full restarts. Every cell's output is captured and checked line by line (its token, its rank, its
cell), every result by value, every pulled tensor by its contents.

Printed: for the controller (this process, the kernel's role), the fork server, each rank and the system, the
growth of RSS, open fds, threads, shared-memory segments (memfd segments of monarch's transfers; /dev/shm entries on
the system) and processes (this process's descendants; every process on the system), from a baseline taken after a
warm-up to the end. Ranks are measured twice: the same processes before and after the phases that keep them
(cells, interrupts, transfers), and fresh ones after the restarts against the first ones. Snapshots are taken once
the transfer caches are idle (shm.CACHE_IDLE) so they compare like with like. Goal: growth under 5%, no leaked fd,
segment or process, no lost or misrouted cell.

Wall-clock figures on a shared machine are noisy; the counts are not.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time
from collections import Counter
from typing import Any

import psutil
import torch

from monarch_jupyter import Mesh, MeshError
from monarch_jupyter.kernel.launch import local
from monarch_worker import shm

MiB = 1 << 20
FD_KINDS: list[Counter[str]] = []  # the controller's fds by kind, at each snapshot


def proc_stats(pid: int) -> dict[str, float]:
    """RSS (bytes), open fds, threads and memfd segments (fds + mappings) of one process."""
    p = psutil.Process(pid)
    return {"rss": p.memory_info().rss, "fds": p.num_fds(), "threads": p.num_threads(),
            "segments": len(shm.memfd_fds(pid)) + len(shm.memfd_mappings(pid))}


def fd_kinds(pid: int) -> Counter[str]:
    """What the open fds of ``pid`` are: 'socket', 'pipe', 'anon_inode:[eventfd]', a path ... (for leak reports)."""
    kinds: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        kinds[re.sub(r":\[\d+\]$", "", target)] += 1
    return kinds


def system_stats() -> dict[str, float]:
    ours = psutil.Process().children(recursive=True)
    return {"processes (ours)": len([p for p in ours if _alive(p)]), "processes (system)": len(psutil.pids()),
            "/dev/shm entries": len(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else 0}


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def snapshot(mesh: Mesh) -> dict[str, dict[str, float]]:
    settle(mesh)
    FD_KINDS.append(fd_kinds(os.getpid()))
    out = {"controller": proc_stats(os.getpid())}
    fs = local.fork_server_pid()
    if fs is not None:
        out["fork server"] = proc_stats(fs)
    for r, s in sorted(mesh.status().items()):
        out[f"rank {r}"] = proc_stats(s["pid"])
    out["system"] = system_stats()
    return out


def settle(mesh: Mesh, timeout: float = shm.CACHE_IDLE * 2 + 5) -> None:
    """Wait until no transfer segment is held anywhere (caches trimmed after shm.CACHE_IDLE s)."""
    pids = [os.getpid()] + [s["pid"] for s in mesh.status().values()]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(shm.memfd_fds(p) or shm.memfd_mappings(p) for p in pids):
            return
        time.sleep(0.5)


class Soak:
    def __init__(self, n: int, scale: float) -> None:
        self.n = n
        self.scale = scale
        self.mesh = Mesh(n, start_timeout=300)
        self.errors: list[str] = []  # every lost or misrouted output, wrong result, failed check
        self.counts: Counter[str] = Counter()
        self.timings: dict[str, float] = {}

    def times(self, k: int) -> int:
        return max(1, round(k * self.scale))

    def fail(self, what: str) -> None:
        self.errors.append(what)
        if len(self.errors) <= 20:
            print(f"soak: FAILED {what}", file=sys.stderr)

    def run_checked(self, code: str, expect_lines: list[str], expect: dict[int, Any], what: str, **kw: Any) -> None:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            got = self.mesh.run(code, **kw)
        lines = out.getvalue().splitlines()
        if Counter(lines) != Counter(expect_lines):
            self.fail(f"{what}: output {sorted(lines)[:6]} != expected {sorted(expect_lines)[:6]}")
        if dict(got or {}) != expect:
            self.fail(f"{what}: result {got} != {expect}")

    # ------------------------------------------------------------------ phases

    def cells(self, count: int) -> None:
        for i in range(count):
            tok = os.urandom(4).hex()
            code = f"print('c{i}', rank, {tok!r})\n"
            lines = [f"[rank{r}]: c{i} {r} {tok}" for r in range(self.n)]
            if i % 7 == 0:  # a line without a newline, written at the fd level
                code += f"import os\nos.write(1, b'p{i}-' + str(rank).encode())\n"
                lines += [f"[rank{r}]: p{i}-{r}" for r in range(self.n)]
            self.run_checked(code + f"({i}, rank)", lines, {r: (i, r) for r in range(self.n)}, f"cell {i}")
            self.counts["cells"] += 1

    def interrupts(self, count: int) -> None:
        self.mesh.run("kept = 'still here'")
        for k in range(count):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                handle = self.mesh.run(f"print('i{k}', rank, flush=True)\nimport time\ntime.sleep(120)\n",
                                       block=False)
                deadline = time.monotonic() + 60
                while out.getvalue().count(f": i{k} ") < self.n and time.monotonic() < deadline:
                    time.sleep(0.002)
                self.mesh.interrupt()
                try:
                    handle.result(60)
                    self.fail(f"interrupt {k}: the cell was not interrupted")
                except KeyboardInterrupt:
                    pass
            if sorted(out.getvalue().splitlines()) != [f"[rank{r}]: i{k} {r}" for r in range(self.n)]:
                self.fail(f"interrupt {k}: output {out.getvalue()!r}")
            if k % 20 == 19 and self.mesh.run("kept") != dict.fromkeys(range(self.n), "still here"):
                self.fail(f"interrupt {k}: state lost")
            self.counts["interrupts"] += 1

    def transfers(self, count: int) -> None:
        sizes = [1, 2, 4, 8, 16, 32, 64]
        for k in range(count):
            mib = sizes[k % len(sizes)]
            self.mesh.push({"x": torch.full((mib * MiB // 4,), float(k))})
            self.counts["pushes"] += 1
            self.mesh.run("y = x + rank")
            pulled = self.mesh.pull("y")
            self.counts["pulls"] += 1
            for r in range(self.n):
                y = pulled[r]
                if y.numel() != mib * MiB // 4 or y[0].item() != k + r or y[-1].item() != k + r:
                    self.fail(f"transfer {k}: rank {r} pulled {y.numel()} x {y[0].item()}")
            del pulled
        self.mesh.run("del x, y")  # a pushed value maps its segment for as long as the namespace holds it

    def restart_ranks(self, count: int) -> None:
        self.mesh.run("kept = rank * 10")
        for k in range(count):
            r = k % self.n
            self.mesh.restart(ranks=r)
            expect = {q: (None if q == r else q * 10, float(self.n)) for q in range(self.n)}
            got = self.mesh.run("t = torch.ones(1)\ndist.all_reduce(t)\n(globals().get('kept'), t.item())")
            if got != expect:
                self.fail(f"restart --rank {r} ({k}): {got} != {expect}")
            self.mesh.run(f"kept = rank * 10 if rank == {r} else kept")
            self.counts["restart --rank"] += 1

    def deaths(self, count: int) -> None:
        for k in range(count):
            r = k % self.n
            code = (f"import os, subprocess, time\nif rank == {r}:\n"
                    f"    print('PID', subprocess.Popen(['setsid', 'sleep', '600']).pid, flush=True)\n"
                    f"    os._exit(9)\ntime.sleep(60)\n")
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    self.mesh.run(code)
                self.fail(f"death {k}: the cell did not fail")
            except MeshError as e:
                if f"[rank{r}] died (exit code 9)" not in str(e):
                    self.fail(f"death {k}: {str(e)[:200]}")
            pid = re.search(r"PID (\d+)", out.getvalue())
            self.mesh.restart(ranks=r)
            if pid is None:
                self.fail(f"death {k}: no pid printed: {out.getvalue()!r}")
            elif psutil.pid_exists(int(pid.group(1))) and _alive(psutil.Process(int(pid.group(1)))):
                self.fail(f"death {k}: the dead rank's setsid sleep {pid.group(1)} outlived it")
            self.counts["deaths"] += 1

    def full_restarts(self, count: int) -> None:
        for k in range(count):
            self.mesh.restart()
            if self.mesh.run("rank") != {r: r for r in range(self.n)}:
                self.fail(f"restart {k}")
            self.counts["restarts"] += 1

    def timed(self, name: str, fn: Any, count: int) -> None:
        start = time.perf_counter()
        fn(count)
        self.timings[name] = time.perf_counter() - start
        print(f"soak: {name}: {count} in {self.timings[name]:.1f} s", file=sys.stderr)


def growth_table(base: dict, end: dict, rows: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """One line per (process, metric): baseline, end, growth (absolute and %)."""
    out = []
    for label, key in rows:
        if label not in base or label not in end:
            continue
        for metric, b in base[label].items():
            e = end[label][metric]
            pct = 100.0 * (e - b) / b if b else (0.0 if e == b else float("inf"))
            out.append({"process": key, "metric": metric, "baseline": b, "end": e, "growth": e - b, "growth_%": pct})
    return out


def fmt(metric: str, v: float) -> str:
    return f"{v / MiB:.1f} MiB" if metric == "rss" else f"{v:g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4, help="ranks")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the issue's counts (1.0: all of them)")
    ap.add_argument("--json", default=None, help="write the figures here too")
    args = ap.parse_args()
    started = time.perf_counter()
    soak = Soak(args.n, args.scale)
    m = soak.mesh
    # Warm-up (5% of each phase, at least every size once): imports, caches and pools exist in the baseline. The
    # restarts come first, so the ranks measured at the baseline are the processes that then run the phases.
    soak.restart_ranks(soak.times(5))
    soak.full_restarts(soak.times(3))
    soak.cells(soak.times(500))
    soak.interrupts(soak.times(10))
    soak.transfers(max(7, soak.times(25)))
    base = snapshot(m)
    soak.timed("cells", soak.cells, soak.times(10_000))
    soak.timed("interrupts", soak.interrupts, soak.times(200))
    soak.timed("pushes and pulls", soak.transfers, soak.times(500))
    kept_ranks = snapshot(m)  # the same rank processes as the baseline's
    soak.timed("restart --rank", soak.restart_ranks, soak.times(100))
    soak.timed("rank deaths", soak.deaths, soak.times(20))
    soak.timed("full restarts", soak.full_restarts, soak.times(50))
    end = snapshot(m)
    m.stop()
    local.shutdown()
    time.sleep(1)
    after = system_stats()

    ranks = [f"rank {r}" for r in range(args.n)]
    table = (growth_table(base, end, [("controller", "controller"), ("fork server", "fork server")])
             + growth_table(base, kept_ranks, [(r, f"{r} (same process)") for r in ranks])
             + growth_table(base, end, [(r, f"{r} (fresh after restarts)") for r in ranks])
             + growth_table(base, end, [("system", "system (mesh running)")]))
    print(f"\nsoak: {dict(soak.counts)}; {time.perf_counter() - started:.0f} s in all (shared machine: noisy)")
    print(f"{'process':<34} {'metric':<20} {'baseline':>12} {'end':>12} {'growth':>10} {'%':>7}")
    for row in table:
        print(f"{row['process']:<34} {row['metric']:<20} {fmt(row['metric'], row['baseline']):>12} "
              f"{fmt(row['metric'], row['end']):>12} {fmt(row['metric'], row['growth']):>10} {row['growth_%']:>6.1f}%")
    leaked = after["processes (ours)"]
    print(f"after stop: {leaked} processes of ours left, /dev/shm entries {after['/dev/shm entries']} "
          f"(baseline {base['system']['/dev/shm entries']})")
    print(f"cells with lost or misrouted output or a wrong result: {len(soak.errors)}")
    grown = FD_KINDS[-1] - FD_KINDS[0]
    if grown:
        print(f"the controller's fds that grew, by kind: {dict(grown)}")
    leaks = [r for r in table if r["metric"] in ("fds", "segments", "processes (ours)") and r["growth"] > 0]
    rss = [r for r in table if r["metric"] in ("rss", "threads") and r["growth_%"] > 5 and not r["process"].startswith(
        "system")]
    verdict = not soak.errors and not leaks and not leaked and not rss
    print(f"goal (growth < 5%, no fd/segment/process leaked, nothing lost): {'met' if verdict else 'NOT met'}"
          + ("" if verdict else f" - leaks {[(r['process'], r['metric']) for r in leaks]}, over 5% "
             f"{[(r['process'], r['metric']) for r in rss]}, processes left {leaked}, errors {len(soak.errors)}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"counts": soak.counts, "timings_s": soak.timings, "table": table, "errors": soak.errors,
                       "processes_left": leaked}, f, indent=1)
    sys.exit(0 if verdict else 1)


if __name__ == "__main__":
    main()
