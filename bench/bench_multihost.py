"""Meshes past one host against the local mesh, measured in one run: host agents on simulated hosts, torchrun here,
the controller's cost per cell, and simulated trees of 256 and 1,024 ranks.

    sudo python bench/bench_multihost.py [--hosts 2] [--per-host 4] [--cells 200] [--starts 3] [--no-old] [--no-sim]
        [--json PATH]

Every figure is printed with its reference, measured in the same run:

- launch to ready: a joined mesh of HOSTS x PER_HOST ranks (``Mesh.listen``, the printed torchrun command run on each
  simulated host: one host agent per host) against a local mesh of the same size started cold in a fresh process
  (goal <= 2x); its floor, the launcher's own start (``torchrun --no-python ... true``) plus one ``import torch``,
  is printed beside it (goal <= 1.2x the floor); each of the three is the median of ``--starts`` tries, taken in
  turn so that load hits them alike; and the one-process-per-rank form of the same command (what joined meshes did
  before agents) as the "before" row;
- a torchrun-launched mesh on this host (``Mesh(N, launcher="torchrun")``) against the local one (goal <= 2.5x);
- a trivial cell (``x = 1``) on 2 hosts x 16 ranks against a local mesh of 32 (goal <= 1.0x);
- the controller's CPU (this process: every thread) per trivial cell at 2 x 2, 2 x 8 and 2 x 16 ranks (goal: flat
  within 2x from 4 to 32 ranks);
- simulated hosts (bench/simhosts.py: the real controller, agents whose ranks finish at once) at 256, 1,024 and
  4,096 ranks, flat (the controller talks to every agent) and as a tree (one level of relays between): latency and
  controller CPU per cell, against their goal (bench/bench_scale.py's rows; it also measures them before and after
  a change, ``--reference``).

Simulated hosts are network namespaces with their own address and hostname (tests/multihost/netns.sh); they need
root (the rows that need them are skipped otherwise, saying why). On a shared 2-core machine every number is noisy:
the ranks of both "hosts" and the controller share the same 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETNS = os.path.join(ROOT, "tests", "multihost", "netns.sh")
SIM = os.path.join(ROOT, "bench", "simhosts.py")
NS_ENV = {"MJ_NETNS_PREFIX": f"mjb{os.getpid() % 1000}h", "MJ_NETNS_BRIDGE": f"mjb{os.getpid() % 1000}br",
          "MJ_NETNS_SUBNET": f"10.215.{os.getpid() % 200 + 20}"}
# c10d warns, on every connection between the namespaces, that it cannot reverse-resolve the peer (no DNS there):
# harmless (tests/multihost/NOTES.md, failure 2), and kept out of the figures' output.
QUIET = {"TORCH_CPP_LOG_LEVEL": "ERROR"}
TRIVIAL = "x = 1"

LOCAL = r"""
import json, time, statistics
t0 = time.perf_counter()
from monarch_jupyter import Mesh
m = Mesh(__N__, start_timeout=300)
ready = time.perf_counter() - t0
print("RESULT" + json.dumps({"ready_s": ready}))
m.stop()
"""


def timed_cells(mesh: object, cells: int) -> dict[str, float]:
    """Median seconds of a trivial cell, and the controller's CPU seconds per cell (this process, all threads)."""
    for _ in range(20):
        mesh.run(TRIVIAL)  # type: ignore[attr-defined]
    lat = []
    cpu0 = time.process_time()
    for _ in range(cells):
        t = time.perf_counter()
        mesh.run(TRIVIAL)  # type: ignore[attr-defined]
        lat.append(time.perf_counter() - t)
    return {"cell_s": statistics.median(lat), "cpu_s": (time.process_time() - cpu0) / cells}


def seconds(argv: list[str], **kw: object) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)  # type: ignore
    return time.perf_counter() - t0


def local_cold(n: int) -> float:
    """Launch to ready of Mesh(n) in a fresh process: the fork server starts (one import of torch) and forks."""
    code = LOCAL.replace("__N__", str(n))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True).stdout
    return float(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[6:])["ready_s"])


def local_warm(n: int, cells: int) -> dict[str, float]:
    from monarch_jupyter import Mesh

    m = Mesh(n, start_timeout=300)
    try:
        return timed_cells(m, cells)
    finally:
        m.stop()


def torchrun_here(n: int, cells: int) -> dict[str, float]:
    from monarch_jupyter import Mesh

    t0 = time.perf_counter()
    m = Mesh(n, launcher="torchrun", start_timeout=300)
    ready = time.perf_counter() - t0
    try:
        return {"ready_s": ready, **timed_cells(m, cells)}
    finally:
        m.stop()


def netns(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([NETNS, *args], env={**os.environ, **NS_ENV}, capture_output=True, text=True, timeout=120)


def across_hosts(hosts: int, per_host: int, cells: int, form: str = "torchrun") -> dict[str, float]:
    """A mesh of hosts x per_host ranks joined from simulated hosts by a printed command: ``form`` "torchrun"
    (host agents under torchrun), "plain" (host agents, no launcher) or "per_rank" (torchrun, one process per
    rank: what joined meshes did before agents). "agent_s": seconds from the launch to the last agent's hello."""
    from monarch_jupyter import Mesh

    m = Mesh.listen(hosts * per_host, address=NS_ENV["MJ_NETNS_BRIDGE"], nproc_per_node=per_host, timeout=300,
                    show=False)
    procs = []
    try:
        commands = m.join_commands()
        cmd = {"torchrun": commands.torchrun, "plain": commands.generic, "per_rank": commands.torchrun_per_rank}[form]
        joined: list[float] = []
        m.add_listener(lambda kind, data: joined.append(time.perf_counter()) if kind == "rank_joined" else None)
        t0 = time.perf_counter()
        for k in range(1, hosts + 1):
            procs.append(subprocess.Popen([NETNS, "exec", str(k), "sh", "-c", cmd],
                                          env={**os.environ, **NS_ENV, **QUIET},
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if not m.wait_ready(300):
            raise RuntimeError("ranks did not join")
        ready = time.perf_counter() - t0
        assert len(m.hosts()) == hosts
        times = {"ready_s": ready, "agent_s": max(joined, default=t0) - t0}
        return {**times, **timed_cells(m, cells)} if cells else times
    finally:
        m.stop()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def simulated(world: int, relays: int, agents: int, cells: int) -> dict[str, float]:
    """``world`` simulated ranks under ``agents`` simulated agents (flat), or under ``relays`` relays of ``agents``
    agents each (a tree)."""
    from monarch_jupyter import Mesh

    m = Mesh.listen(world, timeout=300, heartbeat_timeout=0, show=False)
    with open(m.join_commands().secret_file) as f:
        secret = f.read().strip()
    if relays:
        argv = [[sys.executable, SIM, "relay", m.address, secret, str(agents), str(world // relays // agents)]
                for _ in range(relays)]
    else:
        argv = [[sys.executable, SIM, "agent", m.address, secret, str(world // agents)] for _ in range(agents)]
    procs = [subprocess.Popen(a) for a in argv]
    try:
        t0 = time.perf_counter()
        if not m.wait_ready(300):
            raise RuntimeError("simulated hosts did not join")
        return {"ready_s": time.perf_counter() - t0, **timed_cells(m, cells)}
    finally:
        m.stop()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2, help="simulated hosts (network namespaces)")
    ap.add_argument("--per-host", type=int, default=4, help="ranks per host for the launch-to-ready rows")
    ap.add_argument("--cells", type=int, default=200, help="trivial cells per latency median")
    ap.add_argument("--starts", type=int, default=3, help="tries of the joined start and of its floor (medians)")
    ap.add_argument("--no-old", action="store_true", help="skip the one-process-per-rank row")
    ap.add_argument("--no-sim", action="store_true", help="skip the simulated 256/1,024/4,096-rank rows")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the figures to PATH as JSON")
    args = ap.parse_args()
    if args.starts < 1:
        ap.error(f"--starts must be 1 or more, got {args.starts}")
    figures: dict[str, object] = {}
    hosts, per = args.hosts, args.per_host
    world = hosts * per
    print(f"multihost benchmark: {os.cpu_count()} CPUs, python {sys.version.split()[0]}; load average "
          f"{os.getloadavg()[0]:.1f} (every figure below shares these CPUs with whatever else runs)", flush=True)

    why = ""
    if os.geteuid() != 0:
        why = "not root: no network namespaces"
    else:
        res = netns("up", str(hosts))
        if res.returncode != 0:
            why = f"netns.sh up failed: {res.stderr.strip()[-300:]}"
    try:
        torchrun = shutil.which("torchrun")
        import_argv = [sys.executable, "-c", "import torch, torch.distributed"]
        torchrun_argv = [torchrun or "torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", "1",
                         "--no-python", "true"]
        seconds(import_argv)  # once untimed: the first import after a while reads torch from disk
        imports: list[float] = []
        starts: list[float] = []
        tries: list[dict[str, float]] = []
        for k in range(args.starts):
            imports.append(seconds(import_argv))
            starts.append(seconds(torchrun_argv) if torchrun else float("nan"))
            if not why:
                tries.append(across_hosts(hosts, per, args.cells if k == 0 else 0))
        t_import, t_torchrun = statistics.median(imports), statistics.median(starts)
        print(f"reference: python -c 'import torch, torch.distributed': {t_import:.2f} s; torchrun's own start "
              f"(torchrun --no-python ... true): {t_torchrun:.2f} s (medians of {len(imports)}: "
              f"{', '.join(f'{t:.2f}' for t in imports)} and {', '.join(f'{t:.2f}' for t in starts)} s)",
              flush=True)

        local8 = local_cold(world)
        figures["local_cold_ready_s"] = local8
        print(f"local N={world}, cold (fresh process, fork server included): launch -> ready {local8:.2f} s",
              flush=True)
        here = figures["torchrun_here"] = torchrun_here(world, args.cells)
        print(f"torchrun on this host N={world}: launch -> ready {here['ready_s']:.2f} s = "
              f"{here['ready_s'] / local8:.2f}x local (goal <= 2.5x)", flush=True)
        if not why:
            joined = figures["joined"] = {**tries[0], "ready_s": statistics.median(t["ready_s"] for t in tries),
                                          "agent_s": statistics.median(t["agent_s"] for t in tries),
                                          "tries_s": [t["ready_s"] for t in tries]}
            floor = figures["joined_floor_s"] = t_torchrun + t_import
            print(f"joined {hosts} hosts x {per} (host agents, printed torchrun): launch -> ready "
                  f"{joined['ready_s']:.2f} s (median of {', '.join(f'{t:.2f}' for t in joined['tries_s'])}) = "
                  f"{joined['ready_s'] / local8:.2f}x local (goal <= 2x); floor (torchrun's start + one import torch "
                  f"per host) {floor:.2f} s = {floor / local8:.2f}x; {joined['ready_s'] / floor:.2f}x the floor "
                  f"(goal <= 1.2x). The agents said hello at {joined['agent_s']:.2f} s (torchrun's part); ours from "
                  f"there: {joined['ready_s'] - joined['agent_s']:.2f} s = "
                  f"{(joined['ready_s'] - joined['agent_s']) / t_import:.2f}x one import of torch", flush=True)
            plain = across_hosts(hosts, per, args.cells, "plain")
            print(f"  the plain agent command (no launcher): {plain['ready_s']:.2f} s = "
                  f"{plain['ready_s'] / local8:.2f}x local", flush=True)
            if not args.no_old:
                old = across_hosts(hosts, per, args.cells, "per_rank")
                print(f"  before agents: the one-process-per-rank torchrun command: {old['ready_s']:.2f} s = "
                      f"{old['ready_s'] / local8:.2f}x local", flush=True)

        local32 = figures["local32"] = local_warm(32, args.cells)
        print(f"local N=32: trivial cell {local32['cell_s'] * 1e3:.2f} ms, controller CPU "
              f"{local32['cpu_s'] * 1e3:.3f} ms per cell", flush=True)
        cpu: dict[int, dict[str, float]] = {}
        if not why:
            for n in (2, 8, 16):
                cpu[n] = figures[f"joined_2x{n}"] = across_hosts(2, n, args.cells)
                print(f"joined 2 x {n}: trivial cell {cpu[n]['cell_s'] * 1e3:.2f} ms, controller CPU "
                      f"{cpu[n]['cpu_s'] * 1e3:.3f} ms per cell", flush=True)
            print(f"trivial cell, 2 hosts x 16 / local N=32: {cpu[16]['cell_s'] / local32['cell_s']:.2f}x "
                  "(goal <= 1.0x)")
            print(f"controller CPU per cell, 2x16 / 2x2: {cpu[16]['cpu_s'] / cpu[2]['cpu_s']:.2f}x (goal: within 2x); "
                  f"local N=32 / joined 2x16: {local32['cpu_s'] / cpu[16]['cpu_s']:.2f}x")
    finally:
        if not why:
            netns("down")
    if why:
        print(f"(rows on simulated hosts skipped: {why})")

    if not args.no_sim:
        import bench_scale  # bench/bench_scale.py (this folder is on sys.path)

        print("simulated hosts (ranks answer at once; the controller is real):", flush=True)
        sim: dict[str, dict[str, float]] = {}
        for world_sim in (256, 1024, 4096):
            tree, _ = bench_scale.layouts(world_sim, bench_scale.RELAYS)
            for relays in (0, *tree):
                name = (f"{world_sim} ranks, flat ({world_sim // 64} agents of 64)" if not relays else
                        f"{world_sim} ranks, tree ({relays} relays x {world_sim // 64 // relays} agents of 64)")
                sim[name] = r = bench_scale.run_row(None, "sim", world_sim, relays, args.cells, 20.0)
                print(f"  {name}: cell {r['cell_s'] * 1e3:.2f} ms, controller CPU {r['cpu_s'] * 1e3:.2f} ms "
                      f"(goal at 1,024 and 4,096: <= {bench_scale.GOAL_MS} ms), ready {r['ready_s']:.1f} s",
                      flush=True)
        best = {w: min(r["cpu_s"] for n, r in sim.items() if n.startswith(f"{w} ")) for w in (256, 4096)}
        print(f"  controller CPU, best layout, 4,096 / 256 ranks: {best[4096] / best[256]:.2f}x "
              f"(goal <= {bench_scale.GOAL_RATIO}x)", flush=True)
        figures["simulated"] = sim
    print("reference: torchmonarch (published) exec on all of 32 hosts in about 4.3 s (not measured here)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
