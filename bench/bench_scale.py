"""The controller's cost per cell as meshes grow, before and after in one run (issue 30, "O(hosts) controller").

    python bench/bench_scale.py [--sizes 256,1024,4096] [--relays 2,4] [--reference DIR] [--json PATH]
                                [--no-local] [--no-sim]

Rows, each printed with its goal:

- simulated hosts (bench/simhosts.py: the real controller, agents whose ranks finish every cell at once, so what is
  measured is the controller and the messages, not rank work) at 256, 1,024 and 4,096 ranks, flat (one agent of 64
  ranks per host, each talking to the controller; 8 agents share a process) and as a tree with one relay level,
  2 and 4 relays (``--relays``; a count is tried where each relay has 2 agents or more; a relay's agents share
  one process):
  the controller's CPU (this process, every thread) per trivial cell (``x = 1``), its latency, and the time to
  ready. Goal: <= 1.5 ms at 1,024 and at 4,096 ranks (the better layout), and 4,096 within 1.5x of 256;
- a local mesh of 4 and 32 ranks: the controller's CPU per trivial cell, forked by the fork server (``Mesh(N)``) and
  behind one host agent on this host (``Mesh(N, launcher="agent")``, the layout of a host of a larger mesh). Goal: 32
  within 1.5x of 4. Their "ready" is from ``Mesh(N)`` to the end of its first cell, the kernel's fork server already
  running (as after ``%load_ext monarch``). (A reference from before the "agent" launcher has no "before" in the
  agent rows.)

Each row runs in a fresh interpreter; with ``--reference DIR`` (a checkout of the old code, e.g. /work/main) every
row runs there too, alternating with this checkout, so that load from elsewhere hits both alike: "before" is DIR,
"after" this checkout. The simulated agents and relays are this checkout's bench/simhosts.py for both: for this
checkout they answer a cell with one ``span`` event per host (what monarch_worker.hostlink sends for consecutive
ranks), for the reference with the ``done`` event that lists ranks and durations, which is what it reads. Rows stop
after ``--cells`` cells or ``--row-seconds`` seconds, whichever comes first (the old controller takes about a second
per cell at 4,096 ranks). On a shared 2-core machine every figure is noisy: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM = os.path.join(ROOT, "bench", "simhosts.py")
TRIVIAL = "x = 1"
PER_AGENT = 64  # simulated ranks per host agent
RELAYS = [2, 4]  # relay counts tried at each size (one relay level): the goals take the cheaper layout
PER_PROCESS = 8  # simulated agents per process (each its own connection): fewer processes share the 2 cores
GOAL_MS = 1.5  # controller CPU per trivial cell at 1,024 and 4,096 ranks
GOAL_RATIO = 1.5  # 4,096 / 256 ranks; local 32 / 4 ranks


def timed(mesh: object, cells: int, seconds: float) -> dict[str, float]:
    """Trivial cells: warm-up (up to 20 cells or a fifth of the budget), then up to ``cells`` cells or ``seconds``;
    median latency (s), the controller's CPU per cell (s, this process, every thread) and the cells timed."""
    t_end = time.monotonic() + seconds / 5
    for i in range(20):
        mesh.run(TRIVIAL)  # type: ignore[attr-defined]
        if i >= 2 and time.monotonic() > t_end:
            break
    lat = []
    t_end = time.monotonic() + seconds
    cpu0 = time.process_time()
    while len(lat) < cells and (len(lat) < 5 or time.monotonic() < t_end):
        t = time.perf_counter()
        mesh.run(TRIVIAL)  # type: ignore[attr-defined]
        lat.append(time.perf_counter() - t)
    return {"cell_s": statistics.median(lat), "cpu_s": (time.process_time() - cpu0) / len(lat), "cells": len(lat)}


def sim_row(world: int, relays: int, cells: int, seconds: float) -> dict[str, float]:
    """``world`` simulated ranks, agents of PER_AGENT ranks: flat (``relays`` 0) or under ``relays`` relays."""
    from monarch_jupyter import Mesh

    m = Mesh.listen(world, timeout=300, heartbeat_timeout=0, show=False)
    with open(m.join_commands().secret_file) as f:
        secret = f.read().strip()
    agents = world // PER_AGENT
    if relays:
        argv = [[sys.executable, SIM, "relay", m.address, secret, str(agents // relays), str(PER_AGENT)]
                for _ in range(relays)]
    else:
        argv = [[sys.executable, SIM, "agents", m.address, secret, str(PER_AGENT), str(min(PER_PROCESS, agents - i))]
                for i in range(0, agents, PER_PROCESS)]
    procs = [subprocess.Popen(a) for a in argv]
    try:
        t0 = time.perf_counter()
        if not m.wait_ready(240):
            raise RuntimeError("simulated hosts did not join")
        return {"ready_s": time.perf_counter() - t0, **timed(m, cells, seconds)}
    finally:
        m.stop()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def local_row(n: int, cells: int, seconds: float, launcher: str = "local") -> dict[str, float]:
    """The local rows. "ready_s": seconds from ``Mesh(n)`` to the end of its first trivial cell, the kernel's fork
    server already running with torch imported (as in a notebook after ``%load_ext monarch``)."""
    from monarch_jupyter import Mesh
    from monarch_jupyter.kernel.launch.local import ForkServer

    ForkServer.get(600).wait_ready(600)
    t0 = time.perf_counter()
    m = Mesh(n, start_timeout=600, launcher=launcher)
    try:
        m.run(TRIVIAL)
        ready = time.perf_counter() - t0
        return {"ready_s": ready, **timed(m, cells, seconds)}
    finally:
        m.stop()


def has_agent_launcher(package: str) -> bool:
    """The checkout at ``package`` has ``launcher="agent"`` (one host agent on this host)."""
    try:
        with open(os.path.join(package, "monarch_jupyter", "kernel", "launch", "__init__.py")) as f:
            return '"agent"' in f.read()
    except OSError:
        return False


def run_row(package: str | None, kind: str, *args: int | float) -> dict[str, float]:
    """One row in a fresh interpreter that imports monarch_jupyter from ``package`` (None: this checkout)."""
    env = dict(os.environ)
    # The simulated agents answer as this checkout's agents do (one "span" event per host and cell), or, for the
    # reference, as agents that speak its protocol (a "done" event that lists ranks and durations)
    env["SIMHOSTS_SPANS"] = "0" if package else "1"
    if package:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--row", kind, *map(str, args)],
                         capture_output=True, text=True, env=env, timeout=1800, cwd="/")
    lines = [line for line in out.stdout.splitlines() if line.startswith("ROW")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"row {kind} {args} failed ({out.returncode}): {out.stderr.strip()[-800:]}")
    return json.loads(lines[-1][3:])


def row_main(kind: str, args: list[str]) -> None:
    import monarch_jupyter

    if kind == "sim":
        res = sim_row(int(args[0]), int(args[1]), int(args[2]), float(args[3]))
    else:
        res = local_row(int(args[0]), int(args[1]), float(args[2]), "agent" if kind == "agent" else "local")
    res["package"] = os.path.dirname(os.path.dirname(monarch_jupyter.__file__))
    print("ROW" + json.dumps(res), flush=True)


def fmt(r: dict[str, float] | None) -> str:
    if r is None:
        return "-"
    return f"CPU {r['cpu_s'] * 1e3:6.2f} ms, cell {r['cell_s'] * 1e3:6.2f} ms" + (
        f", ready {r['ready_s']:5.1f} s" if "ready_s" in r else "") + f" ({r['cells']} cells)"


def positive_ints(text: str) -> list[int]:
    """``--sizes`` and ``--relays``: a comma-separated list of positive integers."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers (e.g. 2,4)")
    return values


def layouts(world: int, relay_counts: list[int]) -> tuple[list[int], list[str]]:
    """The relay counts that split ``world``'s agents evenly, 2 agents or more to a relay, and a note for each other."""
    agents = world // PER_AGENT
    ok = [r for r in relay_counts if agents % r == 0 and agents // r >= 2]
    notes = [f"{world} ranks under {r} relays skipped: {agents} agents do not split into {r} equal groups of 2 or more"
             for r in relay_counts if r not in ok]
    return ok, notes


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=[256, 1024, 4096], type=positive_ints,
                    help="simulated mesh sizes (ranks; multiples of 64), comma-separated")
    ap.add_argument("--cells", type=int, default=200, help="trivial cells timed per row, at most")
    ap.add_argument("--row-seconds", type=float, default=20.0, help="seconds of cells per row, at most")
    ap.add_argument("--reference", default=None, help="a checkout (folder) of monarch_jupyter: the 'before'")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every figure to PATH as JSON")
    ap.add_argument("--no-local", action="store_true", help="skip the local 4- and 32-rank rows")
    ap.add_argument("--no-agent", action="store_true", help="local rows: skip those behind one host agent")
    ap.add_argument("--no-sim", action="store_true", help="skip the simulated rows")
    ap.add_argument("--no-flat", action="store_true", help="simulated rows: only the tree")
    ap.add_argument("--relays", default=RELAYS, type=positive_ints,
                    help="relay counts tried at each size, comma-separated (a count is tried where it splits the "
                         "agents evenly, 2 or more to a relay)")
    args = ap.parse_args()
    if bad := [w for w in args.sizes if w % PER_AGENT]:
        ap.error(f"--sizes: {', '.join(map(str, bad))} not a multiple of {PER_AGENT} (ranks per simulated agent)")
    ref = os.path.abspath(args.reference) if args.reference else None
    versions = [("after", None)] + ([("before", ref)] if ref else [])
    print(f"scale benchmark: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, load average "
          f"{os.getloadavg()[0]:.1f}; after = {ROOT}" + (f", before = {ref}" if ref else ""), flush=True)
    figures: dict[str, dict] = {"rows": {}, "goals": {}}
    rows = figures["rows"]

    def measure(name: str, kind: str, *a: int | float) -> None:
        rows[name] = {}
        order = versions if len(rows) % 2 else versions[::-1]  # alternate who goes first
        for label, package in order:
            if kind == "agent" and package and not has_agent_launcher(package):
                rows[name][label] = None  # a reference from before the "agent" launcher
                continue
            try:
                rows[name][label] = run_row(package, kind, *a)
            except RuntimeError as e:
                rows[name][label] = None
                print(f"  {name} ({label}): failed: {e}", flush=True)
        line = f"  {name:34s} after: {fmt(rows[name].get('after'))}"
        before = rows[name].get("before")
        if ref:
            line += f"\n  {'':34s} before: {fmt(before)}"
            if before and rows[name].get("after"):
                line += f"; after/before CPU {rows[name]['after']['cpu_s'] / before['cpu_s']:.3f}x"
        print(line, flush=True)

    sizes = args.sizes
    if not args.no_sim:
        print("simulated hosts (agents of 64 ranks that answer at once; the controller is real):", flush=True)
        for world in sizes:
            if not args.no_flat:
                measure(f"{world} flat ({world // PER_AGENT} agents)", "sim", world, 0, args.cells,
                        args.row_seconds)
            tree, notes = layouts(world, args.relays)
            for note in notes:
                print(f"  ({note})", flush=True)
            for relays in tree:
                measure(f"{world} tree ({relays} relays x {world // PER_AGENT // relays} agents)", "sim", world,
                        relays, args.cells, args.row_seconds)
    if not args.no_local:
        print("local meshes (ranks on this host: forked by the fork server, or behind one host agent):", flush=True)
        for n in (4, 32):
            measure(f"local {n}", "local", n, args.cells, args.row_seconds)
        if not args.no_agent:
            for n in (4, 32):
                measure(f"local {n} behind one agent", "agent", n, args.cells, args.row_seconds)

    print("goals:")
    for label, _ in versions:
        best: dict[int, float] = {}
        for world in sizes:
            cpus = [r[label]["cpu_s"] for name, r in rows.items() if name.startswith(f"{world} ") and r.get(label)]
            if cpus:
                best[world] = min(cpus)
        goals: dict[str, object] = {"best_cpu_ms": {w: c * 1e3 for w, c in best.items()}}
        parts = []
        for w in (1024, 4096):
            if w in best:
                goals[f"cpu_{w}_ok"] = best[w] * 1e3 <= GOAL_MS
                parts.append(f"{w}: {best[w] * 1e3:.2f} ms (goal <= {GOAL_MS} ms: {verdict(best[w] * 1e3 <= GOAL_MS)})")
        if 256 in best and 4096 in best:
            ratio = best[4096] / best[256]
            goals["ratio_4096_256"] = ratio
            parts.append(f"4,096 / 256: {ratio:.2f}x (goal <= {GOAL_RATIO}x: {verdict(ratio <= GOAL_RATIO)})")
        for key, suffix in (("local_32_4", ""), ("agent_32_4", " behind one agent")):
            loc = rows.get(f"local 4{suffix}", {}).get(label), rows.get(f"local 32{suffix}", {}).get(label)
            if loc[0] and loc[1]:
                ratio = loc[1]["cpu_s"] / loc[0]["cpu_s"]
                goals[key] = ratio
                parts.append(f"local 32 / 4{suffix}: {ratio:.2f}x "
                             f"(goal <= {GOAL_RATIO}x: {verdict(ratio <= GOAL_RATIO)})")
        figures["goals"][label] = goals
        shown = "; ".join(parts) or "no row a goal is about (1,024 or 4,096 simulated ranks; local 4 and 32)"
        print(f"  {label}: controller CPU per trivial cell, best layout: {shown}", flush=True)
    if args.json:
        figures["load_average"] = os.getloadavg()[0]
        figures["reference"] = ref
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
        print(f"figures written to {args.json}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--row":
        row_main(sys.argv[2], sys.argv[3:])
    else:
        main()
