"""JupyterLab's visual debugger on ranks, through a real kernel spoken to as JupyterLab does (DAP on the control
channel): how soon a gutter breakpoint hit on N ranks reaches the sidebar, and what a trivial cell costs.

    python bench/bench_dap.py [--n 4] [--hits 5] [--cells 40] [--json PATH]

- breakpoint hit: from the execute request of a `%%mesh` cell to the N-th `stopped` event, and to the sidebar's
  content for every rank (threads, stackTrace, scopes and variables answered), median of ``--hits`` (ranks
  attached already: the first cell with the debugger on attaches them, timed apart). Target (issue 28): < 1 s.
- trivial cell (`x = 1`) round trip, debugger off vs on with no breakpoint (ranks attached: their code runs under
  debugpy's tracer), interleaved in the same run. The cost with no debugger at all against main is measured by
  ``bench/bench_widget.py --trivial-only --reference DIR``.
Wall-clock numbers on a shared 2-core machine are noisy; compare figures of the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from figures import add_json_option, goal, write_json  # noqa: E402  (bench/figures.py)

from tests.integration.dapclient import DapKernel  # noqa: E402  (the test suite's DAP client)


def stopped(k: DapKernel, n: int) -> list[dict]:
    return [k.wait_event(lambda e: e.get("event") == "stopped", what="stopped") for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4, help="ranks")
    ap.add_argument("--hits", type=int, default=5, help="breakpoint hits timed")
    ap.add_argument("--cells", type=int, default=40, help="trivial cells timed per setting")
    add_json_option(ap)
    args = ap.parse_args()
    k = DapKernel(ROOT)
    try:
        run = k.execute(f"%load_ext monarch\n%config MeshMagics.live_view = 'off'\nm = %mesh start -n {args.n}")
        assert run.reply["status"] == "ok", run.errors
        trivial = "%%mesh\nx = 1\n"
        off: list[float] = []
        for _ in range(args.cells // 2):
            t0 = time.perf_counter()
            k.execute(trivial)
            off.append(time.perf_counter() - t0)
        k.debugger_on()
        code = "%%mesh\na = rank\nb = a + 1\nb\n"
        path = k.dap("dumpCell", code=code)["body"]["sourcePath"]
        k.dap("setBreakpoints", source={"path": path}, breakpoints=[{"line": 3}])
        hits, sidebar = [], []
        first = None
        for i in range(args.hits + 1):
            t0 = time.perf_counter()
            run = k.submit(code)
            stops = stopped(k, args.n)
            t_stop = time.perf_counter() - t0
            names = {t["id"] for t in k.dap("threads")["body"]["threads"]}
            for ev in stops:
                tid = ev["body"]["threadId"]
                assert tid in names
                frame = k.dap("stackTrace", threadId=tid)["body"]["stackFrames"][0]
                scope = k.dap("scopes", frameId=frame["id"])["body"]["scopes"][0]
                k.dap("variables", variablesReference=scope["variablesReference"])
            t_side = time.perf_counter() - t0
            k.dap("continue", threadId=stops[0]["body"]["threadId"])
            k.wait(run)
            if i == 0:
                first = (t_stop, t_side)
            else:
                hits.append(t_stop)
                sidebar.append(t_side)
        k.dap("setBreakpoints", source={"path": path}, breakpoints=[])
        on: list[float] = []
        for _ in range(args.cells // 2):
            t0 = time.perf_counter()
            k.execute(trivial)
            on.append(time.perf_counter() - t0)
    finally:
        k.close()
    assert first is not None
    print(f"visual debugger on {args.n} ranks, python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print(f"  first cell with the debugger on (attaches the ranks): stopped on all {first[0]:.3f} s, "
          f"sidebar {first[1]:.3f} s")
    print(f"  breakpoint hit, request -> {args.n} stopped events (median)  {statistics.median(hits):.3f} s  "
          "(target < 1 s)")
    print(f"  ... and every rank's stack and variables answered (median)   {statistics.median(sidebar):.3f} s")
    print(f"  trivial cell, debugger off (median)                  {statistics.median(off) * 1e3:8.2f} ms")
    print(f"  trivial cell, debugger on, no breakpoint (median)    {statistics.median(on) * 1e3:8.2f} ms  "
          f"on/off = {statistics.median(on) / statistics.median(off):.2f}x")
    med = statistics.median
    figures = {"first_stopped_s": first[0], "first_sidebar_s": first[1], "stopped_s": med(hits),
               "sidebar_s": med(sidebar), "trivial_debugger_off_s": med(off), "trivial_debugger_on_s": med(on),
               "on_off": med(on) / med(off)}
    write_json(args.json, "bench_dap", figures, {"stopped_s": goal(med(hits), "<", 1.0, "s")}, n=args.n,
               hits=args.hits, cells=args.cells)


if __name__ == "__main__":
    main()
