"""Start-up and cell latency of a local mesh, against `import torch` and the peers, measured in one run.

    python bench/bench_core.py [--n 4] [--cells 300] [--no-peers] [--json PATH]

Prints seconds and the ratios the foundation issue sets targets for:
- cold start of N ranks (a fresh process: no fork server yet) to ready (torch imported and the process group up
  in every rank) / one `python -c "import torch"`   target <= 1.5x
- restart (fresh processes and process group) / the same import                                   "well under" 1x
- median latency of a trivial cell (`x = 1`) on N ranks, through Mesh.run and through the %%mesh magic (in
  IPython's InteractiveShell: bench_widget.py measures it through a real Jupyter kernel), target < 1 ms; the CPU
  time it costs the kernel and each rank; peers: ipyparallel `%px a=1` (view.execute) and torchmonarch's endpoint
  call.
Wall-clock numbers on a shared 2-core machine are noisy; each figure is a median of several runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
# ipyparallel engines unpickle functions of bench/peers.py by reference: they must import it too.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (BENCH_DIR, os.environ.get("PYTHONPATH")) if p)

import peers  # noqa: E402  (bench/peers.py)
from figures import add_json_option, goal, write_json  # noqa: E402  (bench/figures.py)

COLD_START = r"""
import json, time
t0 = time.perf_counter()
from monarch_jupyter import Mesh
m = Mesh(__N__, start_timeout=120)
ready = time.perf_counter() - t0
t1 = time.perf_counter()
m.restart()
restart = time.perf_counter() - t1
m.stop()
print("RESULT" + json.dumps({"cold_start_s": ready, "restart_s": restart}))
"""


def cold_start(n: int, repeat: int) -> dict[str, float]:
    """Median cold start and restart of ``n`` ranks in fresh processes (seconds)."""
    runs = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", COLD_START.replace("__N__", str(n))], capture_output=True,
                             text=True, timeout=300, check=True).stdout
        runs.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[6:]))
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def cell_latency(n: int, cells: int) -> dict[str, float]:
    """Median seconds of a trivial cell on ``n`` ranks via Mesh.run and via the %%mesh magic."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "monarch_jupyter")
    mesh = shell.run_line_magic("mesh", f"start -n {n}")
    try:
        for _ in range(30):
            mesh.run("x = 1")
        api = []
        for _ in range(cells):
            t0 = time.perf_counter()
            mesh.run("x = 1")
            api.append(time.perf_counter() - t0)
        magic = []
        for _ in range(cells):
            t0 = time.perf_counter()
            shell.run_cell_magic("mesh", "", "x = 1")
            magic.append(time.perf_counter() - t0)
        pids = {"kernel": [os.getpid()], "ranks": [st["pid"] for st in mesh.status().values()]}
        before = {k: [_cpu_seconds(p) for p in v] for k, v in pids.items()}
        for _ in range(cells):
            mesh.run("x = 1")
        cpu = {k: statistics.mean(_cpu_seconds(p) - b for p, b in zip(v, before[k], strict=False)) / cells
               for k, v in pids.items()}
    finally:
        shell.run_line_magic("unload_ext", "monarch_jupyter")
    return {"api_s": statistics.median(api), "magic_s": statistics.median(magic),
            "api_p90_s": sorted(api)[int(0.9 * len(api))], "cpu_kernel_s": cpu["kernel"],
            "cpu_rank_s": cpu["ranks"]}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4, help="ranks")
    ap.add_argument("--cells", type=int, default=300, help="trivial cells timed")
    ap.add_argument("--repeat", type=int, default=3, help="cold starts timed")
    ap.add_argument("--no-peers", action="store_true", help="skip ipyparallel and torchmonarch")
    add_json_option(ap)
    args = ap.parse_args()
    n = args.n

    imp = peers.torch_import_seconds(repeat=3)
    start = cold_start(n, args.repeat)
    lat = cell_latency(n, args.cells)
    print(f"monarch_jupyter core benchmark: {n} ranks, {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    print(f"  python -c 'import torch'                 {imp:8.3f} s")
    print(f"  cold start to ready ({n} ranks)            {start['cold_start_s']:8.3f} s   "
          f"{start['cold_start_s'] / imp:5.2f}x import torch  (target <= 1.5x)")
    print(f"  restart to ready                         {start['restart_s']:8.3f} s   "
          f"{start['restart_s'] / imp:5.2f}x import torch")
    print(f"  trivial cell, Mesh.run (median)          {lat['api_s'] * 1e3:8.3f} ms  "
          f"(p90 {lat['api_p90_s'] * 1e3:.3f} ms)")
    print(f"  trivial cell, %%mesh magic (median)      {lat['magic_s'] * 1e3:8.3f} ms  (target < 1 ms)")
    print(f"  CPU per trivial cell (Mesh.run)          kernel {lat['cpu_kernel_s'] * 1e3:.3f} ms, "
          f"each rank {lat['cpu_rank_s'] * 1e3:.3f} ms")
    figures: dict[str, object] = {"import_torch_s": imp, **start, **lat}
    goals = {"cold_start_x_import_torch": goal(start["cold_start_s"] / imp, "<=", 1.5, "x import torch"),
             "magic_cell_s": goal(lat["magic_s"], "<", 1e-3, "s")}
    try:
        if not args.no_peers:
            _peers(n, start, lat, figures)
    finally:
        write_json(args.json, "bench_core", figures, goals, n=n, cells=args.cells, repeat=args.repeat,
                   peers=not args.no_peers)


def _peers(n: int, start: dict[str, float], lat: dict[str, float], figures: dict[str, object]) -> None:
    """Print the peers' figures against ours, and add them to ``figures``."""
    try:
        t = peers.ipyparallel_start(n)
        print(f"  ipyparallel: start {n} engines + torch     {t:8.3f} s   "
              f"ours is {t / start['cold_start_s']:5.1f}x faster")
        ops = peers.ipyparallel_ops(n)
        figures["ipyparallel"] = {"start_s": t, "execute_s": ops["execute_s"]}
        print(f"  ipyparallel: %px a=1 (view.execute)      {ops['execute_s'] * 1e3:8.3f} ms  "
              f"ours is {ops['execute_s'] / lat['magic_s']:5.1f}x faster")
    except peers.PeerUnavailable as e:
        print(f"  ipyparallel: skipped ({e})")
    res, reason = peers.torchmonarch_ops(n)
    if res is None:
        print(f"  torchmonarch: skipped ({reason})")
    else:
        figures["torchmonarch"] = res
        print(f"  torchmonarch: spawn to first result      {res['spawn_to_first_result_s']:8.3f} s   "
              f"ours is {res['spawn_to_first_result_s'] / start['cold_start_s']:5.1f}x faster")
        print(f"  torchmonarch: endpoint call to {n} actors   {res['call_s'] * 1e3:8.3f} ms  "
              f"ours is {res['call_s'] / lat['magic_s']:5.1f}x faster")
    res, reason = peers.accelerate_notebook_launcher_start(n)
    if res is None:
        print(f"  accelerate: skipped ({reason})")
    else:
        figures["accelerate"] = res
        print(f"  accelerate notebook_launcher: launch to result (no persistent ranks) "
              f"{res['launch_to_result_s']:8.3f} s")


if __name__ == "__main__":
    main()
