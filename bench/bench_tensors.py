"""Tensors between the notebook and the ranks, against memcpy and ipyparallel, measured in one run.

    python bench/bench_tensors.py [--n 4] [--reps 8] [--no-peers] [--json PATH]

Prints seconds (median of ``--reps`` after one warm-up, and the first, cold call) and the ratios the tensors issue
sets targets for:
- push of 256 MiB (a float32 tensor) to n local ranks, returned when every rank acknowledged, / one memcpy of
  256 MiB into pre-touched memory                                                          target <= 4x
- ipyparallel's push of 256 MiB to n engines / ours                                        target >= 10x
and, for the same operations at 64 MiB (push, scatter, gather, pull from one rank), ours against ipyparallel's.
It also times the three routes of a push (shared memory, socket, process-group broadcast) and a bare gloo
broadcast among the ranks: the numbers behind the "auto" route choice (kernel/transfer.py); the socket push of 64
MiB to one rank (MB/s, and against ipyparallel's push); and the routes to ranks held by a host agent (over TCP: once
per host, then shared memory) against a broadcast.

Every figure is wall-clock on this machine, in the same run; on a shared machine they are noisy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
# ipyparallel pickles peers' engine functions by reference: its engines must be able to import peers too.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (BENCH_DIR, os.environ.get("PYTHONPATH")) if p)

import peers  # noqa: E402  (bench/peers.py)
from figures import add_json_option, goal, write_json  # noqa: E402  (bench/figures.py)

MiB = 1 << 20


def timed(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(first call seconds, median seconds of ``reps`` further calls)."""
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[1:])


def clone_seconds(nbytes: int, reps: int) -> float:
    """Median seconds to copy ``nbytes`` into freshly allocated memory (torch.Tensor.clone): what any copy that
    needs new pages pays on this machine."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    return timed(lambda: src.clone(), reps)[1]


def monarch_ops(n: int, reps: int) -> dict[str, float]:
    import torch

    from monarch_jupyter import Mesh

    res: dict[str, float] = {}
    with Mesh(n, start_timeout=120) as m:
        for mb in (64, 256):
            x = torch.ones(mb * MiB // 4, dtype=torch.float32)
            res[f"push_{mb}MiB_first_s"], res[f"push_{mb}MiB_s"] = timed(lambda x=x: m.push(x=x), reps)
            m.run("del x")
            del x
        x = torch.ones(64 * MiB // 4, dtype=torch.float32)
        # The routes, for the "auto" choice: one copy to every rank over the socket, one copy to one rank and a
        # broadcast over the process group, and the bare collective among the ranks.
        res["push_64MiB_socket_s"] = timed(lambda: m.push(x=x, via="socket"), 3)[1]
        res["push_64MiB_socket_1rank_s"] = timed(lambda: m.push(x=x, via="socket", ranks=0), 3)[1]
        res["push_64MiB_broadcast_s"] = timed(lambda: m.push(x=x, via="broadcast"), 3)[1]
        m.run("import time; b = torch.ones(16 << 20); dist.broadcast(b, 0)")
        per_rank = [m.run("t0 = time.perf_counter(); dist.broadcast(b, 0); time.perf_counter() - t0")
                    for _ in range(3)]
        res["gloo_broadcast_64MiB_s"] = statistics.median(max(r.values()) for r in per_rank)
        m.run("del x, b")
        res["scatter_64MiB_first_s"], res["scatter_64MiB_s"] = timed(lambda: m.scatter("s", x), reps)
        res["gather_64MiB_first_s"], res["gather_64MiB_s"] = timed(lambda: m.gather("s"), reps)
        assert torch.equal(m.gather("s"), x)
        m.push(y=x, ranks=0)
        res["pull_64MiB_first_s"], res["pull_64MiB_s"] = timed(lambda: m.pull("y", ranks=0), reps)
        stats = m.transfers.segments.pool.stats()
        res["segments_allocated"] = float(stats.get("allocated", 0))
        res["segments_reused"] = float(stats.get("reused", 0))
    return res


def agent_ops(n: int, reps: int) -> dict[str, float]:
    """The routes to ranks a host agent holds (``Mesh(n, launcher="torchrun")``: one agent on this host, reached
    over TCP on loopback like an agent on another host): the socket route crosses the connection once for all the
    agent's ranks and the agent puts large values in shared memory; the broadcast route sends one copy and the
    ranks fan it out over gloo."""
    import torch

    from monarch_jupyter import Mesh

    res: dict[str, float] = {}
    with Mesh(n, launcher="torchrun", start_timeout=300) as m:
        x = torch.ones(64 * MiB // 4, dtype=torch.float32)
        res["agent_push_64MiB_socket_1rank_s"] = timed(lambda: m.push(x=x, via="socket", ranks=0), reps)[1]
        res["agent_push_64MiB_socket_s"] = timed(lambda: m.push(x=x, via="socket"), reps)[1]
        res["agent_push_64MiB_broadcast_s"] = timed(lambda: m.push(x=x, via="broadcast"), reps)[1]
        assert m.run("x.sum().item()") == dict.fromkeys(range(n), float(x.numel()))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4, help="ranks / engines")
    ap.add_argument("--reps", type=int, default=8, help="timed repetitions after the first call")
    ap.add_argument("--no-peers", action="store_true", help="skip ipyparallel")
    add_json_option(ap)
    args = ap.parse_args()
    n = args.n

    def line(name: str, secs: float, nbytes: int = 0) -> None:
        rate = f"   {nbytes / secs / 1e9:6.2f} GB/s" if secs and nbytes else ""
        print(f"  {name:<46}{secs:9.4f} s{rate}", flush=True)

    print(f"tensors benchmark: {n} ranks, {os.cpu_count()} CPUs, python {sys.version.split()[0]}; "
          f"load average {os.getloadavg()[0]:.1f}")
    ref = {mb: peers.memcpy_seconds(mb * MiB) for mb in (64, 256)}
    for mb, s in ref.items():
        line(f"reference: memcpy {mb} MiB", s, mb * MiB)
    clone256 = clone_seconds(256 * MiB, 5)
    line("reference: copy 256 MiB into new memory", clone256, 256 * MiB)

    ours = monarch_ops(n, args.reps)
    for k, v in ours.items():
        if k.startswith("segments"):
            continue
        mb = 256 if "256MiB" in k else 64
        line(f"monarch_jupyter: {k}", v, mb * MiB)
    print(f"  (shared memory segments: {ours['segments_allocated']:.0f} allocated, "
          f"{ours['segments_reused']:.0f} reuses)")

    agent = agent_ops(n, 3)
    for k, v in agent.items():
        line(f"monarch_jupyter: {k}", v, 64 * MiB)

    ipp: dict[str, float] = {}
    if not args.no_peers:
        try:
            ipp = peers.ipyparallel_ops(n)
        except peers.PeerUnavailable as e:
            print(f"  ipyparallel: skipped: {e}")
        for k, v in ipp.items():
            if k != "execute_s":
                line(f"ipyparallel: {k}", v, (256 if "256MiB" in k else 64) * MiB)

    print("ratios (same run):")
    push256 = ours["push_256MiB_s"]
    print(f"  push 256 MiB to {n} ranks / memcpy 256 MiB: {push256 / ref[256]:5.2f}x   (target <= 4x; "
          f"first, cold push: {ours['push_256MiB_first_s'] / ref[256]:.2f}x; "
          f"copy into new memory alone: {clone256 / ref[256]:.2f}x)")
    if ipp:
        print(f"  ipyparallel push 256 MiB / ours: {ipp['push_256MiB_s'] / push256:6.1f}x   (target >= 10x; "
              f"against our first, cold push: {ipp['push_256MiB_s'] / ours['push_256MiB_first_s']:.1f}x)")
        for op in ("push_64MiB", "scatter_64MiB", "gather_64MiB", "pull_64MiB"):
            print(f"  ipyparallel {op} / ours: {ipp[op + '_s'] / ours[op + '_s']:6.1f}x")
    sock1 = ours["push_64MiB_socket_1rank_s"]
    print(f"  socket push of 64 MiB to one rank: {64 * MiB / sock1 / 1e6:.0f} MB/s ({sock1:.3f} s; goal <= 0.1 s)"
          + (f"; ipyparallel's push of 64 MiB to {n} engines / ours: {ipp['push_64MiB_s'] / sock1:.1f}x" if ipp
             else ""))
    a1, an = agent["agent_push_64MiB_socket_1rank_s"], agent["agent_push_64MiB_socket_s"]
    print(f"  the same to a rank held by a host agent (TCP on loopback, then the agent's shared memory): "
          f"{64 * MiB / a1 / 1e6:.0f} MB/s ({a1:.3f} s); to its {n} ranks: "
          f"{an / a1:.2f}x the one-rank push (one copy per host, not per rank); "
          f"broadcast to its {n} ranks: {agent['agent_push_64MiB_broadcast_s'] / an:.2f}x the socket route")
    print(f"  routes for 64 MiB to {n} ranks: socket {ours['push_64MiB_socket_s'] / ours['push_64MiB_s']:.1f}x, "
          f"broadcast {ours['push_64MiB_broadcast_s'] / ours['push_64MiB_s']:.1f}x the shared-memory push; "
          f"socket to {n} ranks / to 1 rank: "
          f"{ours['push_64MiB_socket_s'] / ours['push_64MiB_socket_1rank_s']:.1f}x; "
          f"bare gloo broadcast / socket to 1 rank: "
          f"{ours['gloo_broadcast_64MiB_s'] / ours['push_64MiB_socket_1rank_s']:.1f}x")
    goals = {"push_256MiB_over_memcpy": goal(push256 / ref[256], "<=", 4, "x memcpy"),
             "push_64MiB_socket_1rank_s": goal(sock1, "<=", 0.1, "s")}
    if ipp:
        goals["ipyparallel_push_256MiB_over_ours"] = goal(ipp["push_256MiB_s"] / push256, ">=", 10, "x")
    figures = {"memcpy_64MiB_s": ref[64], "memcpy_256MiB_s": ref[256], "clone_256MiB_s": clone256, **ours, **agent,
               "ipyparallel": ipp}
    write_json(args.json, "bench_tensors", figures, goals, n=n, reps=args.reps, peers=not args.no_peers)


if __name__ == "__main__":
    main()
