"""A sweep of a small Lightning model three ways (issue 29): trials on sub-meshes, one trial after another on the
whole mesh, and torchrun relaunched for each trial.

    python bench/bench_sweep.py [--nproc 4] [--trials 8] [--steps 60] [--json PATH]

In one run, on --nproc CPU ranks:

- sub-meshes: ``monarch_jupyter.sweep(mesh, objective, study, n_trials, ranks_per_trial=nproc // 2)``: two trials at
  once, each a Lightning fit on its sub-mesh's ranks;
- one at a time: the same sweep with ``ranks_per_trial=nproc`` (each trial on the whole mesh);
- torchrun: one ``python -m torch.distributed.run --standalone --nproc-per-node nproc`` per trial, one after another
  (what a script-based sweep does today).

Each trial is ``lightning.Trainer(accelerator="cpu", devices=<its ranks>, strategy="ddp", max_steps=--steps)`` on an
MLP, run as code in a cell on the trial's ranks: their process group and torchrun variables are the sub-mesh's, as
under torchrun. The mesh is started once and the ranks import Lightning once, before the timed sweeps (reported
apart: what a notebook pays once). Reported per way: the total wall time, and the per-trial overhead: the trial's
wall time as the sweep (or the launcher) saw it minus the fit itself as rank 0 timed it (``trainer.fit``).
Goals: sub-meshes >= 1.6x faster than one at a time, >= 5x faster than torchrun relaunches (total wall time).
The machine may be shared: the figures of one run are indicative.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODEL = '''
import time
import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Net(L.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def fit_once(lr, steps, devices):
    """Fit for ``steps`` steps; returns (final loss, seconds in trainer.fit) on every rank."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    data = DataLoader(TensorDataset(x, x[:, :1] * 2.0), batch_size=32, shuffle=False)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    t = time.perf_counter()
    trainer.fit(Net(lr), data)
    return float(trainer.callback_metrics["loss"]), time.perf_counter() - t
'''

SCRIPT = MODEL + '''
if __name__ == "__main__":
    import json, os, sys
    torch.set_num_threads(1)
    loss, seconds = fit_once(float(sys.argv[1]), int(sys.argv[2]), int(os.environ["WORLD_SIZE"]))
    if int(os.environ["RANK"]) == 0:
        print("RESULT " + json.dumps({"loss": loss, "fit": seconds}), flush=True)
'''

LRS = [0.001 * 2 ** i for i in range(16)]


def on_mesh(args: argparse.Namespace) -> dict:
    import optuna

    from monarch_jupyter import Mesh, sweep

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out: dict = {}
    t = time.perf_counter()
    mesh = Mesh(args.nproc, start_timeout=300)
    out["mesh_start"] = time.perf_counter() - t
    try:
        t = time.perf_counter()
        mesh.run("torch.set_num_threads(1)\n" + MODEL)  # the notebook's cell that defines the model
        out["import_lightning"] = time.perf_counter() - t
        for name, per_trial in (("sub-meshes", args.nproc // 2), ("one at a time", args.nproc)):
            fits: list[float] = []
            walls: list[float] = []

            def objective(trial: object, sub: object, fits: list = fits, walls: list = walls) -> float:
                lr = trial.suggest_categorical("lr", LRS[:args.trials])  # type: ignore[attr-defined]
                t0 = time.perf_counter()
                loss, fit = sub.run(f"fit_once({lr}, {args.steps}, world_size)")[0]  # type: ignore[attr-defined]
                walls.append(time.perf_counter() - t0)
                fits.append(fit)
                return loss

            study = optuna.create_study(sampler=optuna.samplers.BruteForceSampler(seed=0))
            t = time.perf_counter()
            sweep(mesh, objective, study, n_trials=args.trials, ranks_per_trial=per_trial)
            total = time.perf_counter() - t
            states = {str(s) for s in (tr.state for tr in study.trials)}
            out[name] = {"total": total, "overhead": statistics.mean(w - f for w, f in zip(walls, fits, strict=True)),
                         "fit": statistics.mean(fits), "ranks_per_trial": per_trial, "states": sorted(states)}
    finally:
        mesh.stop()
    return out


def with_torchrun(args: argparse.Namespace, tmp: str) -> dict:
    script = os.path.join(tmp, "trial.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    fits, walls = [], []
    t = time.perf_counter()
    for lr in LRS[:args.trials]:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(args.nproc), script, str(lr), str(args.steps)], env=env, cwd=tmp,
                              capture_output=True, text=True, timeout=900)
        walls.append(time.perf_counter() - t0)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"torchrun trial failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        fits.append(json.loads(lines[-1][7:])["fit"])
    total = time.perf_counter() - t
    return {"total": total, "overhead": statistics.mean(w - f for w, f in zip(walls, fits, strict=True)),
            "fit": statistics.mean(fits), "ranks_per_trial": args.nproc}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="CPU ranks (even)")
    parser.add_argument("--trials", type=int, default=8, help="trials per way (at most 16)")
    parser.add_argument("--steps", type=int, default=60, help="training steps per trial")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    results = on_mesh(args)
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        results["torchrun"] = with_torchrun(args, tmp)
    report(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def report(results: dict, args: argparse.Namespace) -> None:
    print(f"{args.trials} trials of a Lightning MLP ({args.steps} steps each, strategy='ddp') on {args.nproc} CPU "
          f"ranks; os.cpu_count() = {os.cpu_count()}")
    print(f"mesh start (once per notebook): {results['mesh_start']:.2f} s; ranks import Lightning and define the "
          f"model (once): {results['import_lightning']:.2f} s")
    print(f"{'':15}{'ranks/trial':>12}{'total':>10}{'per-trial overhead':>20}{'fit (rank 0)':>14}")
    for name in ("sub-meshes", "one at a time", "torchrun"):
        r = results[name]
        print(f"{name:15}{r['ranks_per_trial']:>12}{r['total']:>9.2f}s{r['overhead']:>19.2f}s{r['fit']:>13.2f}s")
    sub = results["sub-meshes"]["total"]
    one, tr = results["one at a time"]["total"] / sub, results["torchrun"]["total"] / sub
    print(f"sub-meshes vs one at a time: {one:.2f}x faster (goal >= 1.6x: {'met' if one >= 1.6 else 'NOT met'})")
    print(f"sub-meshes vs torchrun relaunches: {tr:.2f}x faster (goal >= 5x: {'met' if tr >= 5 else 'NOT met'})")


if __name__ == "__main__":
    main()
