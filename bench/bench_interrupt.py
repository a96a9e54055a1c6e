"""An interrupt that stops some ranks while the others wait for them in a collective: how long until the mesh
runs a collective again, for this checkout and a reference checkout (before and after in one run).

    python bench/bench_interrupt.py [--n 3] [--grace 5] [--repeat 3] [--reference DIR] [--json PATH]

In a controller process (the Python API) of each checkout, a mesh of N ranks runs a cell in which the last rank
sleeps and the others wait for it in ``dist.all_reduce``; once ``Mesh.stacks`` shows them there, SIGINT reaches the
controller's waiting thread (the notebook's interrupt), with ``interrupt_grace`` = GRACE seconds. Figures (seconds,
medians of --repeat runs; wall clock on a shared machine, so noisy):

- interrupt: from SIGINT to the KeyboardInterrupt in the caller;
- usable: from SIGINT to the end of the next cell's all_reduce (of every rank, the right sum). Where the next cell
  is refused (RankBusyError: ranks still stuck), the bench does what the message says, ``interrupt(force=True)``,
  and counts that too; ``forced`` says how many runs needed it.

Goal: the waiting ranks are released by the interrupt itself (no forced run), and the mesh is usable within the
grace.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from figures import add_json_option, goal, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONTROLLER = textwrap.dedent("""
    import json, signal, sys, threading, time
    from monarch_jupyter import Mesh
    from monarch_jupyter.errors import RankBusyError

    n, grace, repeat = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    cell = ("import time\\nt = torch.ones(1)\\nif rank == world_size - 1:\\n    time.sleep(600)\\n"
            "else:\\n    dist.all_reduce(t)\\n")
    check = "t = torch.ones(1); dist.all_reduce(t); t.item()"
    runs = []
    with Mesh(n, start_timeout=300, interrupt_grace=grace) as m:
        for _ in range(repeat):
            sent = []

            def poke():
                while "all_reduce" not in m.stacks(list(range(n - 1))).summary():
                    time.sleep(0.05)
                sent.append(time.perf_counter())
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

            threading.Thread(target=poke, daemon=True).start()
            try:
                m.run(cell, timeout=600)
            except KeyboardInterrupt:
                interrupted = time.perf_counter() - sent[0]
            forced = False
            try:
                got = m.run(check, timeout=120)
            except RankBusyError:
                forced = True
                m.interrupt(force=True)
                got = m.run(check, timeout=120)
            assert got == dict.fromkeys(range(n), float(n)), got
            runs.append({"interrupt_s": interrupted, "usable_s": time.perf_counter() - sent[0], "forced": forced})
    sys.stderr.write("RUNS" + json.dumps(runs) + "\\n")
""")


def run_tree(tree: str, n: int, grace: float, repeat: int) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, os.path.join(tree, ".typecheck"), env.get("PYTHONPATH"))
                                        if p)
    proc = subprocess.run([sys.executable, "-c", CONTROLLER, str(n), str(grace), str(repeat)], capture_output=True,
                          text=True, env=env, cwd=tree, timeout=600 + repeat * (grace + 120))
    marker = [line for line in proc.stderr.splitlines() if line.startswith("RUNS")]
    if proc.returncode != 0 or not marker:
        raise SystemExit(f"bench_interrupt: the controller of {tree} failed:\n{proc.stderr[-3000:]}")
    runs = json.loads(marker[-1][4:])
    return {"interrupt_s": statistics.median(r["interrupt_s"] for r in runs),
            "usable_s": statistics.median(r["usable_s"] for r in runs),
            "forced": sum(r["forced"] for r in runs), "runs": len(runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=3, help="ranks (the last one sleeps, the others wait for it)")
    ap.add_argument("--grace", type=float, default=5.0, help="interrupt_grace, seconds")
    ap.add_argument("--repeat", type=int, default=3, help="interrupts per checkout")
    ap.add_argument("--reference", default=None, help="a checkout (folder) of monarch_jupyter: the 'before'")
    add_json_option(ap)
    args = ap.parse_args()
    trees = {"after": ROOT, **({"before": os.path.abspath(args.reference)} if args.reference else {})}
    print(f"interrupt with ranks waiting in a collective: {args.n} ranks, interrupt_grace {args.grace:g} s, "
          f"{args.repeat} runs each; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    figures: dict[str, Any] = {}
    goals: dict[str, Any] = {}
    for name, tree in trees.items():
        s = run_tree(tree, args.n, args.grace, args.repeat)
        figures[name] = s
        print(f"  {name:<7} interrupt {s['interrupt_s']:6.2f} s   usable again {s['usable_s']:6.2f} s   "
              f"needed interrupt --force: {s['forced']} of {s['runs']}")
    after = figures["after"]
    goals["usable_s"] = goal(after["usable_s"], "<=", args.grace, "s")
    goals["forced"] = goal(float(after["forced"]), "<=", 0.0)
    print(f"  goal: usable again within the grace ({args.grace:g} s) without --force: {after['usable_s']:.2f} s, "
          f"forced {after['forced']}: {'met' if goals['usable_s']['met'] and goals['forced']['met'] else 'NOT met'}")
    write_json(args.json, "bench_interrupt", figures, goals, n=args.n, grace=args.grace, repeat=args.repeat)


if __name__ == "__main__":
    main()
