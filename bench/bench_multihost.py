"""Joined ranks across simulated hosts against the local mesh, measured in one run.

    sudo python bench/bench_multihost.py [--sizes 4 8] [--hosts 2] [--cells 200]

For each world size N (default 4 and 8: 2 and 4 ranks on each of 2 simulated hosts):
- local mesh: ``Mesh(N)`` in a fresh process, cold (fork server started, torch imported once) to ready;
- torchrun on this host (``Mesh(N, launcher="torchrun")``): launch to ready;
- joined across hosts: ``Mesh.listen(N)``, then the printed torchrun command run on each simulated host (a
  network namespace with its own address and hostname, tests/multihost/netns.sh), from the launch to every
  rank in the process group;
and the median latency of a trivial cell (``x = 1``) on all N ranks for each. Ratios are against the local mesh
of the same N. Reference: torchmonarch's published figure, exec on all of 32 hosts in about 4.3 s (not measured
here). Needs root for the namespaces (the cross-host rows are skipped otherwise, with the reason). Numbers on a
shared 2-core machine are noisy: several engines importing torch at once share 2 cores.
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
NETNS = os.path.join(ROOT, "tests", "multihost", "netns.sh")
NS_ENV = {"MJ_NETNS_PREFIX": f"mjb{os.getpid() % 1000}h", "MJ_NETNS_BRIDGE": f"mjb{os.getpid() % 1000}br",
          "MJ_NETNS_SUBNET": f"10.215.{os.getpid() % 200 + 20}"}

LOCAL = r"""
import json, time, statistics
t0 = time.perf_counter()
from monarch_jupyter import Mesh
m = Mesh(__N__, start_timeout=300)
ready = time.perf_counter() - t0
for _ in range(20):
    m.run("x = 1")
lat = []
for _ in range(__CELLS__):
    t = time.perf_counter(); m.run("x = 1"); lat.append(time.perf_counter() - t)
m.stop()
print("RESULT" + json.dumps({"ready_s": ready, "cell_s": statistics.median(lat)}))
"""


def import_torch() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, torch.distributed"], check=True)
    return time.perf_counter() - t0


def local(n: int, cells: int) -> dict[str, float]:
    code = LOCAL.replace("__N__", str(n)).replace("__CELLS__", str(cells))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[6:])


def latency(mesh: object, cells: int) -> float:
    for _ in range(20):
        mesh.run("x = 1")
    lat = []
    for _ in range(cells):
        t = time.perf_counter()
        mesh.run("x = 1")
        lat.append(time.perf_counter() - t)
    return statistics.median(lat)


def torchrun_here(n: int, cells: int) -> dict[str, float]:
    from monarch_jupyter import Mesh

    t0 = time.perf_counter()
    m = Mesh(n, launcher="torchrun", start_timeout=300)
    ready = time.perf_counter() - t0
    try:
        return {"ready_s": ready, "cell_s": latency(m, cells)}
    finally:
        m.stop()


def netns(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([NETNS, *args], env={**os.environ, **NS_ENV}, capture_output=True, text=True, timeout=120)


def across_hosts(n: int, hosts: int, cells: int) -> dict[str, float]:
    from monarch_jupyter import Mesh

    bridge = NS_ENV["MJ_NETNS_BRIDGE"]
    m = Mesh.listen(n, address=bridge, nproc_per_node=n // hosts, timeout=300, show=False)
    procs = []
    try:
        cmd = m.join_commands().torchrun
        t0 = time.perf_counter()
        for k in range(1, hosts + 1):
            procs.append(subprocess.Popen([NETNS, "exec", str(k), "sh", "-c", cmd], env={**os.environ, **NS_ENV},
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if not m.wait_ready(300):
            raise RuntimeError("ranks did not join")
        ready = time.perf_counter() - t0
        assert len(m.hosts()) == hosts
        return {"ready_s": ready, "cell_s": latency(m, cells)}
    finally:
        m.stop()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 8], help="world sizes")
    ap.add_argument("--hosts", type=int, default=2, help="simulated hosts (network namespaces)")
    ap.add_argument("--cells", type=int, default=200, help="trivial cells per latency median")
    args = ap.parse_args()

    why = ""
    if os.geteuid() != 0:
        why = "not root: no network namespaces"
    else:
        res = netns("up", str(args.hosts))
        if res.returncode != 0:
            why = f"netns.sh up failed: {res.stderr.strip()[-300:]}"
    rows: dict[str, dict] = {}
    try:
        t_import = import_torch()
        print(f"python -c 'import torch, torch.distributed': {t_import:.2f} s")
        for n in args.sizes:
            rows[f"local N={n}"] = local(n, args.cells)
            rows[f"torchrun here N={n}"] = torchrun_here(n, args.cells)
            if not why:
                rows[f"joined {args.hosts} hosts x {n // args.hosts} N={n}"] = across_hosts(n, args.hosts, args.cells)
    finally:
        if not why:
            netns("down")
    print(f"\n{'':34} {'launch->ready s':>16} {'x local':>8} {'cell ms':>8} {'x local':>8}")
    for name, r in rows.items():
        n = name.rsplit("N=", 1)[1]
        base = rows[f"local N={n}"]
        print(f"{name:34} {r['ready_s']:16.2f} {r['ready_s'] / base['ready_s']:8.2f} {r['cell_s'] * 1e3:8.2f} "
              f"{r['cell_s'] / base['cell_s']:8.2f}")
    if why:
        print(f"\n(cross-host rows skipped: {why})")
    print("\nreference: torchmonarch (published) exec on all of 32 hosts in about 4.3 s")


if __name__ == "__main__":
    main()
