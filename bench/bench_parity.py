"""torchrun parity: the same DDP script under torchrun and on the mesh, in one run; ratios against torchrun.

    python bench/bench_parity.py [--nproc 2] [--steps 60] [--repeat 3] [--json PATH]

Figures (wall clock; medians of --repeat runs each way; a shared machine makes them noisy):
- steady-state step: the median time of one DDP training step (forward, backward, all-reduce, optimizer) of a
  small MLP over the second half of the steps, under ``torchrun --nproc-per-node N`` and through
  ``mesh.run_script`` (what ``%mesh run`` calls) on an N-rank mesh; the ratio mesh / torchrun (goal: <= 1.05,
  i.e. at least 0.95 of torchrun's speed);
- the iteration loop, "code edited" to "first step done": torchrun relaunches (a fresh interpreter per rank, import
  torch, rendezvous, DDP, step 1); the mesh, already up, runs the edited file again (``%mesh run``), or a cell
  that does the same again (``%%mesh``); the ratio torchrun / mesh (goal: >= 10x faster).
The same script file serves all three, so the work per step is the same code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from figures import add_json_option, goal, write_json  # noqa: E402  (bench/figures.py)

SCRIPT = textwrap.dedent('''
    """A small DDP training loop that reports its step times (bench/bench_parity.py)."""
    import json
    import sys
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel


    def main(out: str, steps: int) -> None:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
            torch.nn.Linear(512, 10)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = torch.Generator().manual_seed(rank)
        times, first_done = [], 0.0
        for i in range(steps):
            t0 = time.perf_counter()
            x, y = torch.randn(64, 256, generator=data), torch.randint(0, 10, (64,), generator=data)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            if i == 0:
                first_done = time.time()
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"first_done": first_done, "steps": times}, f)
        dist.destroy_process_group()


    if __name__ == "__main__":
        main(sys.argv[1], int(sys.argv[2]))
''')


def steady(report: dict) -> float:
    """Median step time (s) over the second half of the steps."""
    times = report["steps"]
    return statistics.median(times[len(times) // 2:])


def torchrun_once(script: Path, out: Path, nproc: int, steps: int) -> tuple[float, float]:
    """(edit-to-first-step s, steady step s) of one torchrun launch."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           str(script), str(out), str(steps)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed:\n{proc.stderr[-2000:]}")
    report = json.loads(out.read_text())
    return report["first_done"] - t0, steady(report)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=3)
    add_json_option(ap)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from monarch_jupyter import Mesh

    work = Path(tempfile.mkdtemp(prefix="bench-parity-"))
    script, out = work / "train.py", work / "report.json"
    script.write_text(SCRIPT)
    # The same code as a notebook cell: the script's definitions, then the call its __main__ guard makes.
    cell = SCRIPT.split("\nif __name__")[0] + f"\nmain({str(out)!r}, {args.steps})\n"
    tr_first, tr_step, run_first, run_step, cell_first = [], [], [], [], []
    for _ in range(args.repeat):
        first, step = torchrun_once(script, out, args.nproc, args.steps)
        tr_first.append(first)
        tr_step.append(step)
    with Mesh(args.nproc, start_timeout=300) as mesh:
        mesh.run_script(script, out, args.steps)  # warm: the first run imports what the script imports
        for _ in range(args.repeat):
            script.write_text(SCRIPT + f"\n# edit {time.time()}\n")  # "code edited"
            t0 = time.time()
            mesh.run_script(script, out, args.steps)
            report = json.loads(out.read_text())
            run_first.append(report["first_done"] - t0)
            run_step.append(steady(report))
            t0 = time.time()
            mesh.run(cell)
            cell_first.append(json.loads(out.read_text())["first_done"] - t0)
    med = statistics.median
    print(f"torchrun parity benchmark: {args.nproc} ranks, {args.steps} steps, {args.repeat} runs each, "
          f"{os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    print(f"  steady step, torchrun            {med(tr_step) * 1e3:8.2f} ms")
    print(f"  steady step, mesh (%mesh run)    {med(run_step) * 1e3:8.2f} ms")
    ratio = med(run_step) / med(tr_step)
    print(f"  ratio mesh / torchrun            {ratio:8.3f}   (goal <= 1.05: {'met' if ratio <= 1.05 else 'NOT met'})")
    print(f"  edit -> first step, torchrun     {med(tr_first):8.3f} s  (relaunch)")
    print(f"  edit -> first step, %mesh run    {med(run_first):8.3f} s")
    print(f"  edit -> first step, %%mesh cell  {med(cell_first):8.3f} s")
    goals = {"step_mesh_over_torchrun": goal(ratio, "<=", 1.05, "x torchrun")}
    for name, key, value in (("%mesh run", "run", med(run_first)), ("%%mesh cell", "cell", med(cell_first))):
        speedup = med(tr_first) / value
        goals[f"loop_speedup_{key}"] = goal(speedup, ">=", 10, "x faster than torchrun")
        print(f"  loop speed-up vs torchrun, {name:<12}{speedup:7.1f}x   (goal >= 10x: "
              f"{'met' if speedup >= 10 else 'NOT met'})")
    figures = {"step_torchrun_s": med(tr_step), "step_mesh_run_s": med(run_step), "step_ratio": ratio,
               "edit_to_first_step_torchrun_s": med(tr_first), "edit_to_first_step_run_s": med(run_first),
               "edit_to_first_step_cell_s": med(cell_first)}
    write_json(args.json, "bench_parity", figures, goals, nproc=args.nproc, steps=args.steps, repeat=args.repeat)


if __name__ == "__main__":
    main()
