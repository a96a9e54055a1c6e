"""Lightning in a notebook three ways: strategy="mesh", strategy="ddp_notebook", and the same script relaunched
under torchrun with strategy="ddp".

    python bench/bench_lightning.py [--nproc 2] [--steps 20] [--refits 3] [--long-steps 400] [--rounds 3] [--json PATH]
    python bench/bench_lightning.py --first-only [--repeat 3] [--reference DIR]    the first fit only (issue 30)

Prints, in one run, for each way: the first fit, a second fit, an edit-and-refit loop (edit the LightningModule,
new Trainer, fit; mean of --refits rounds), and the steady-state seconds per training step (median over a long
fit after a warm-up, best of --rounds fits). Each way runs in a fresh interpreter, as a new notebook kernel would:

- mesh: `Mesh(N)` once (reported apart), then fits from the "notebook" process; classes are sent by value,
  as for classes defined in notebook cells.
- ddp_notebook: Lightning's fork launcher; a second fit on the same Trainer raises NotImplementedError
  (Lightning #18775), so the second fit and refits use new Trainers, as users do.
- torchrun: every fit is `python -m torch.distributed.run --standalone --nproc-per-node N workload.py`.

Goals (issue 12): per-step time within 5% of torchrun's; refit at least 10x faster than a torchrun relaunch.
With --first-only (issue 30): the first fit, counted from the `import lightning` cell to the end of the fit, within
2x of ddp_notebook's, in the order %mesh start then import lightning; and the first fit (from the Trainer) in the other
order, where the ranks started after Lightning was imported. --reference DIR measures another checkout (before a
change) in the same run, the ways alternating.
The machine is shared: numbers of one run are indicative; the per-step ratio is the median of many steps.
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

WORKLOAD = '''
import json, os, sys, time
import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

HIDDEN = 512
LR = 0.05


class StepTimer(L.Callback):
    """Rank 0 writes the wall time of each training step to STEP_TIMES (a JSON list of seconds)."""

    def __init__(self, path):
        self.path, self.times, self.t = path, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self.t)

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero and self.path:
            with open(self.path, "w") as f:
                json.dump(self.times, f)


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                                 nn.Linear(HIDDEN, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class Data(L.LightningDataModule):
    def setup(self, stage):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64 * 1000, 256, generator=g)
        self.train = TensorDataset(x, x[:, :10].argmax(1))

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=64, shuffle=True)


def trainer(strategy, nproc, steps, timer_path=""):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=nproc, max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_model_summary=False,
                     callbacks=[StepTimer(timer_path)])


if __name__ == "__main__":
    nproc, steps, timer_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else ""
    L.seed_everything(0, verbose=False)
    trainer("ddp", nproc, steps, timer_path).fit(Net(), datamodule=Data())
'''

NOTEBOOK = '''
import json, os, statistics, sys, time, types, warnings
warnings.filterwarnings("ignore")
mode, nproc, steps, long_steps, refits, src_path, times_path = sys.argv[1:8]
nproc, steps, long_steps, refits = int(nproc), int(steps), int(long_steps), int(refits)
out = {}
# A notebook: %load_ext monarch (registers strategy="mesh" for when Lightning is imported), then either %mesh start
# and the `import lightning` cell (BENCH_ORDER=mesh_first), or the other way round (import_first). A Jupyter kernel
# warms the ranks up when they start after Lightning was imported; MONARCH_LIGHTNING_WARM_ON_START=1 does it here.
mesh_first = os.environ.get("BENCH_ORDER", "import_first") == "mesh_first"

def start_mesh():
    global mesh
    from monarch_jupyter import Mesh
    t = time.perf_counter()
    mesh = Mesh(nproc)
    out["mesh_start"] = time.perf_counter() - t

if mode == "mesh":
    import monarch_jupyter.lightning  # noqa: F401
    if mesh_first:
        start_mesh()
t0 = time.perf_counter()  # the `import lightning` cell
import lightning as L
import logging
for name in ("lightning.pytorch", "lightning.fabric"):
    logging.getLogger(name).setLevel(logging.ERROR)
out["import_lightning"] = time.perf_counter() - t0
if mode == "mesh" and not mesh_first:
    start_mesh()
source = open(src_path).read()

def cell(src):
    """Run the workload's source as a notebook cell would: a fresh module whose classes travel by value."""
    mod = types.ModuleType("__main__")
    sys.modules["__bench_cell__"] = mod
    exec(compile(src.split("if __name__")[0], "<cell>", "exec"), mod.__dict__)
    return mod

if mode == "mesh":
    from monarch_jupyter.lightning import MeshStrategy
    strategy = lambda: MeshStrategy(live_view="off")
else:
    strategy = lambda: "ddp_notebook"

w = cell(source)
L.seed_everything(0, verbose=False)
model, data = w.Net(), w.Data()
t = time.perf_counter()
tr = w.trainer(strategy(), nproc, steps)
tr.fit(model, datamodule=data)
out["first_fit"] = time.perf_counter() - t
out["import_to_first_fit"] = time.perf_counter() - t0
if os.environ.get("BENCH_FIRST_ONLY") == "1":
    if mode == "mesh":
        mesh.stop()
    print("RESULT " + json.dumps(out))
    sys.exit(0)
t = time.perf_counter()
try:
    tr.fit_loop.epoch_loop.max_steps = 2 * steps
    tr.fit(model, datamodule=data)
    out["second_fit_same_trainer"] = "ok"
except NotImplementedError as e:
    out["second_fit_same_trainer"] = "NotImplementedError (Lightning #18775)"
    t = time.perf_counter()
    w.trainer(strategy(), nproc, steps).fit(model, datamodule=data)
out["second_fit"] = time.perf_counter() - t
rounds = []
for i in range(refits):
    t = time.perf_counter()
    w = cell(source.replace("HIDDEN = 512", f"HIDDEN = {512 + 16 * (i + 1)}"))  # the edit
    w.trainer(strategy(), nproc, steps).fit(w.Net(), datamodule=w.Data())
    rounds.append(time.perf_counter() - t)
out["refit"] = statistics.mean(rounds)
for r in range(int(os.environ.get("BENCH_ROUNDS", "1"))):
    w = cell(source)
    w.trainer(strategy(), nproc, long_steps, f"{times_path}.{r}").fit(w.Net(), datamodule=w.Data())
if mode == "mesh":
    mesh.stop()
print("RESULT " + json.dumps(out))
'''


def run_notebook(mode: str, args: argparse.Namespace, tmp: str, package: str | None = None,
                 order: str = "import_first") -> dict:
    """One way in a fresh interpreter; ``package``: import monarch_jupyter from that checkout (the reference);
    ``order``: "import_first" (import lightning, then %mesh start) or "mesh_first"."""
    nb = os.path.join(tmp, "notebook.py")
    times = os.path.join(tmp, f"times-{mode}.json")
    with open(nb, "w") as f:
        f.write(NOTEBOOK)
    root = package or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [root, os.path.join(root, ".typecheck"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, BENCH_ROUNDS=str(args.rounds), BENCH_FIRST_ONLY="1" if args.first_only else "0",
               MONARCH_LIGHTNING_WARM_ON_START="1", BENCH_ORDER=order, PYTHONPATH=os.pathsep.join(p for p in path if p))
    proc = subprocess.run([sys.executable, nb, mode, str(args.nproc), str(args.steps), str(args.long_steps),
                           str(args.refits), os.path.join(tmp, "workload.py"), times],
                          capture_output=True, text=True, timeout=1800, cwd=tmp, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    out = json.loads(lines[-1][7:])
    if not args.first_only:
        out["step"] = _steady(times, args)
    return out


def _steady(path: str, args: argparse.Namespace) -> float:
    """The smallest, over the rounds, of the median step time after the warm-up (load spikes on a shared machine
    only ever add time)."""
    medians = []
    for r in range(args.rounds):
        with open(f"{path}.{r}") as f:
            medians.append(statistics.median(json.load(f)[args.warmup:]))
    return min(medians)


def run_torchrun(args: argparse.Namespace, tmp: str) -> dict:
    script = os.path.join(tmp, "workload.py")
    env = dict(os.environ, PYTHONWARNINGS="ignore")

    def launch(steps: int, timer: str = "", src: str = script) -> float:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                        str(args.nproc), src, str(args.nproc), str(steps), timer], env=env, cwd=tmp, check=True,
                       capture_output=True, timeout=1800)
        return time.perf_counter() - t

    out = {"first_fit": launch(args.steps), "second_fit": launch(args.steps),
           "second_fit_same_trainer": "a new process (the script runs again)"}
    rounds = []
    source = open(script).read()
    for i in range(args.refits):
        edited = os.path.join(tmp, "workload_edited.py")
        t = time.perf_counter()
        with open(edited, "w") as f:
            f.write(source.replace("HIDDEN = 512", f"HIDDEN = {512 + 16 * (i + 1)}"))
        launch(args.steps, src=edited)
        rounds.append(time.perf_counter() - t)
    out["refit"] = statistics.mean(rounds)
    times = os.path.join(tmp, "times-torchrun.json")
    for r in range(args.rounds):
        launch(args.long_steps, f"{times}.{r}")
    out["step"] = _steady(times, args)
    return out


def first_fits(args: argparse.Namespace, tmp: str) -> dict:
    """--first-only: the first fit in each order, for this checkout, the reference (if any) and ddp_notebook, the ways
    alternating over --repeat rounds; medians."""
    ways = {"mesh": (None, "mesh"), "ddp_notebook": (None, "ddp_notebook")}
    if args.reference:
        ways["mesh (reference)"] = (args.reference, "mesh")
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeat):
        for order in ("import_first", "mesh_first"):
            for name, (package, mode) in ways.items():
                if mode == "ddp_notebook" and order == "mesh_first":
                    continue  # no mesh: one order
                runs.setdefault(f"{name}|{order}", []).append(run_notebook(mode, args, tmp, package, order))
    return {key: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for key, rs in runs.items()}


def report_first(results: dict, args: argparse.Namespace) -> None:
    nb = results["ddp_notebook|import_first"]
    print(f"first Lightning fit of {args.steps} steps on {args.nproc} CPU ranks, medians of {args.repeat} runs "
          f"(each a fresh interpreter, as a new kernel)")
    print(f"  ddp_notebook: import lightning {nb['import_lightning']:.2f} s, first fit {nb['first_fit']:.2f} s; "
          f"from the import cell to the end of the fit {nb['import_to_first_fit']:.2f} s")
    for name in ("mesh", "mesh (reference)"):
        if f"{name}|mesh_first" not in results:
            continue
        a, b = results[f"{name}|mesh_first"], results[f"{name}|import_first"]
        print(f"  {name}:")
        print(f"    %mesh start, then `import lightning`: from the import cell to the end of the first fit "
              f"{a['import_to_first_fit']:.2f} s = {a['import_to_first_fit'] / nb['import_to_first_fit']:.2f}x "
              f"ddp_notebook (goal <= 2x); the fit itself {a['first_fit']:.2f} s")
        print(f"    `import lightning`, then %mesh start ({b['mesh_start']:.2f} s): first fit {b['first_fit']:.2f} s "
              f"= {b['first_fit'] / nb['first_fit']:.2f}x ddp_notebook's; from the import cell to the end of the "
              f"fit, the start included, {b['import_to_first_fit']:.2f} s = "
              f"{b['import_to_first_fit'] / nb['import_to_first_fit']:.2f}x ddp_notebook")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="steps per fit in first/second/refit")
    parser.add_argument("--long-steps", type=int, default=400, help="steps of the steady-state fit")
    parser.add_argument("--warmup", type=int, default=50, help="steps left out of the steady-state median")
    parser.add_argument("--refits", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="steady-state fits per way (the best median counts)")
    parser.add_argument("--first-only", action="store_true",
                        help="only the first fit, in both orders (import lightning / %%mesh start), against "
                             "ddp_notebook")
    parser.add_argument("--repeat", type=int, default=3, help="--first-only: runs of each way (medians)")
    parser.add_argument("--reference", default=None,
                        help="--first-only: a checkout (folder) of monarch_jupyter to measure too, in the same run")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-lightning-") as tmp:
        with open(os.path.join(tmp, "workload.py"), "w") as f:
            f.write(textwrap.dedent(WORKLOAD))
        if args.first_only:
            results = first_fits(args, tmp)
            report_first(results, args)
        else:
            results = {"mesh": run_notebook("mesh", args, tmp),
                       "ddp_notebook": run_notebook("ddp_notebook", args, tmp), "torchrun": run_torchrun(args, tmp)}
            report(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def report(results: dict, args: argparse.Namespace) -> None:
    print(f"{args.nproc} ranks on CPU; fits of {args.steps} steps; steady state: median step of {args.long_steps} "
          f"steps after {args.warmup}, best of {args.rounds} fits (MLP 256-512-512-10, batch 64)")
    if "mesh_start" in results["mesh"]:
        print(f"mesh start (once per notebook): {results['mesh']['mesh_start']:.2f} s; import lightning in the "
              f"notebook: {results['mesh']['import_lightning']:.2f} s")
    print(f"{'':14}{'first fit':>11}{'second fit':>12}{'edit+refit':>12}{'s/step':>11}   "
          "second fit on the same Trainer")
    for name, r in results.items():
        print(f"{name:14}{r['first_fit']:>10.2f}s{r['second_fit']:>11.2f}s{r['refit']:>11.2f}s"
              f"{r['step'] * 1000:>9.2f}ms   {r['second_fit_same_trainer']}")
    mesh, tr = results["mesh"], results["torchrun"]
    print(f"mesh vs torchrun: per-step {mesh['step'] / tr['step'] - 1:+.1%} (goal within 5%); refit "
          f"{tr['refit'] / mesh['refit']:.1f}x faster than a torchrun relaunch (goal at least 10x)")
    mesh, nb = results["mesh"], results["ddp_notebook"]
    print(f"mesh vs ddp_notebook: refit {nb['refit'] / mesh['refit']:.1f}x faster; per-step "
          f"{mesh['step'] / nb['step'] - 1:+.1%}")


if __name__ == "__main__":
    main()
