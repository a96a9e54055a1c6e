"""Rank output faster than the controller's own stdout takes it: the controller's memory, measured in one run.

    python bench/bench_backpressure.py [--n 4] [--mb 25] [--rate 5] [--launchers local,agent] [--reference DIR]
        [--json PATH]

A controller process (the Python API, as in a script or IPython in a terminal) starts a mesh of N ranks and runs one
cell in which every rank writes MB megabytes of 5 KB lines with ``os.write``. Its stdout is a pipe that this bench
reads at RATE MB/s (0: as fast as it can). Printed per launcher (``local``: the kernel's fork server; ``agent``: one
host agent on this host), and for ``--reference DIR`` (a checkout, e.g. of main: "before") in the same run:

- the flood cell's time (seconds);
- the controller's peak RSS during the flood (VmHWM, reset once the mesh is up) less its RSS then, MiB: what the
  flood held;
- whether every line came, in order, for every rank.

There is no peer row: notebook launchers (ipyparallel, accelerate's ``notebook_launcher``) do not bound what their
controller holds either, and measuring them needs their own kernels. The goal is a bound that does not grow with the
flood: at most ``HELD_GOAL`` MiB held; run a larger ``--mb`` to see whether it stays there. It is not met yet
(docs/architecture.md, "Running a cell", "A flood of output"): a bound that stops reading the ranks' pipes and
socket also holds up what must get through meanwhile (an idle rank's result, stack replies, an interrupt's results,
a restart's hellos).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from figures import add_json_option, goal, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = 5000  # bytes of x per line (plus its number and a newline)
HELD_GOAL = 32.0  # MiB of controller memory a flood may hold, whatever its size (see the module docstring)

CONTROLLER = textwrap.dedent("""
    import json, sys, time
    from monarch_jupyter import Mesh

    def vm(key):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

    launcher, n, cell = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with Mesh(n, launcher=launcher, start_timeout=300) as m:
        m.run("x = 1")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS: the peak from here on
        base = vm("VmRSS")
        t0 = time.perf_counter()
        m.run(cell, timeout=900)
        flood = time.perf_counter() - t0
        m.run("x = 2")
        stats = {"flood_s": flood, "rss_base": base, "rss_peak": vm("VmHWM")}
    sys.stderr.write("STATS" + json.dumps(stats) + "\\n")
""")


def run_one(tree: str, launcher: str, n: int, lines: int, rate: float) -> dict[str, Any]:
    """One controller process of checkout ``tree`` whose stdout is read at ``rate`` bytes a second (0: at once)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, os.path.join(tree, ".typecheck"), env.get("PYTHONPATH"))
                                        if p)
    # each rank's lines differ from the others' (R<rank>): identical lines of several ranks would be folded
    cell = f"import os\nfor i in range({lines}): os.write(1, b'R%d L%d ' % (rank, i) + b'x' * {LINE} + b'\\n')"
    proc = subprocess.Popen([sys.executable, "-c", CONTROLLER, launcher, str(n), cell], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=tree)
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    killer = threading.Timer(1800, proc.kill)
    killer.start()
    seen: dict[int, int] = {}  # rank -> lines in order so far
    in_order, got, start, part = True, 0, time.monotonic(), b""
    try:
        assert proc.stdout is not None
        while chunk := proc.stdout.read1(1 << 16):
            got += len(chunk)
            *done, part = (part + chunk).split(b"\n")
            for line in done:
                if line.startswith(b"[rank") and b"]: R" in line:
                    _, r, number_text, _ = line.split(b" ", 3)
                    rank, number = int(r[1:]), int(number_text[1:])
                    in_order = in_order and number == seen.get(rank, 0)
                    seen[rank] = number + 1
            if rate > 0 and (lag := got / rate - (time.monotonic() - start)) > 0:
                time.sleep(lag)
        proc.wait()
    finally:
        killer.cancel()
        proc.kill()
        proc.wait()
    reader.join(30)
    text = b"".join(err).decode(errors="replace")
    if proc.returncode != 0 or "STATS" not in text:
        raise SystemExit(f"the controller ({launcher}, {tree}) failed (exit {proc.returncode}):\n{text[-3000:]}")
    stats = json.loads(text.split("STATS", 1)[1].splitlines()[0])
    stats["held_MiB"] = (stats["rss_peak"] - stats["rss_base"]) / 2**20
    stats["complete"] = in_order and all(seen.get(r) == lines for r in range(n))
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4, help="ranks")
    ap.add_argument("--mb", type=float, default=25.0, help="megabytes each rank prints")
    ap.add_argument("--rate", type=float, default=5.0, help="MB/s at which the controller's stdout is read (0: fast)")
    ap.add_argument("--launchers", default="local,agent", help="comma-separated: local, agent")
    ap.add_argument("--reference", default=None, help="a checkout (folder) of monarch_jupyter: the 'before'")
    add_json_option(ap)
    args = ap.parse_args()
    lines = max(1, int(args.mb * 1e6 / (LINE + 8)))
    total_mb = args.n * lines * (LINE + 8) / 1e6
    trees = {"after": ROOT, **({"before": os.path.abspath(args.reference)} if args.reference else {})}
    pace = f"at {args.rate:g} MB/s" if args.rate > 0 else "as fast as it can"
    print(f"back-pressure: {args.n} ranks print {total_mb:.0f} MB in all; the controller's stdout is read {pace}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    figures: dict[str, Any] = {}
    goals: dict[str, Any] = {}
    for launcher in args.launchers.split(","):
        for name, tree in trees.items():
            s = run_one(tree, launcher, args.n, lines, args.rate * 1e6)
            figures[f"{launcher}_{name}"] = s
            print(f"  {launcher:<6} {name:<7} flood {s['flood_s']:7.3f} s   controller held {s['held_MiB']:6.0f} MiB "
                  f"({s['held_MiB'] * 2**20 / (total_mb * 1e6):.2f}x of the flood)   "
                  f"lines {'all, in order' if s['complete'] else 'MISSING OR OUT OF ORDER'}")
        for name in trees:
            held = figures[f"{launcher}_{name}"]["held_MiB"]
            g = goal(held, "<=", HELD_GOAL, "MiB")
            if name == "after":
                goals[f"{launcher}_held_MiB"] = g
            print(f"  goal: {launcher}, {name}: controller memory held by the flood <= {HELD_GOAL:.0f} MiB whatever "
                  f"its size: {held:.0f} MiB: {'met' if g['met'] else 'NOT met'}")
    write_json(args.json, "bench_backpressure", figures, goals, n=args.n, mb=args.mb, rate=args.rate)


if __name__ == "__main__":
    main()
