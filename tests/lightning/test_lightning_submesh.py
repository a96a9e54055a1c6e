"""strategy="mesh" on sub-meshes (issue 29, items 2 and 4): two fits on two sub-meshes at once from two threads
(and, the torchrun way, from two async cells with Lightning's strategy="ddp" on the ranks), Lightning's own loggers
(CSV, TensorBoard, MLflow to a ``file:`` store) and ModelCheckpoint, whose files the notebook (here: this process,
the mesh's controller) reads back, and bad input that leaves every sub-mesh usable.

One 4-rank mesh split into two sub-meshes of 2 serves the module; tests run in file order.
"""

from __future__ import annotations

import csv
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning")
import cloudpickle  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from monarch_jupyter import Mesh, MonarchError  # noqa: E402
from monarch_jupyter.kernel.submesh import SubMesh, selected  # noqa: E402
from monarch_jupyter.lightning import MeshStrategy  # noqa: E402
from monarch_jupyter.lightning.errors import MeshLightningError  # noqa: E402

pytestmark = pytest.mark.slow

WAIT = 120.0
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # as a notebook's classes: sent by value to the ranks


class Net(L.LightningModule):
    """Waits at its first step on rank 0 until the fit named ``other`` has started too (``gate`` folder): two fits
    that did not run at the same time fail here, after ``WAIT`` seconds."""

    def __init__(self, lr: float = 0.1, gate: str = "", me: str = "", other: str = "") -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        import time
        from pathlib import Path

        gate = self.hparams.gate
        if gate and batch_idx == 0 and self.global_rank == 0:
            (Path(gate) / self.hparams.me).touch()
            deadline = time.monotonic() + WAIT
            while not (Path(gate) / self.hparams.other).exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fit {self.hparams.other!r} did not run while {self.hparams.me!r} ran")
                time.sleep(0.05)
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class SaveEveryRank(L.Callback):
    """Each rank saves its weights and what torch.distributed says of its world, at the end of training."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        import os

        import torch.distributed as dist

        torch.save({"weights": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                    "world": (trainer.world_size, trainer.global_rank, dist.get_world_size(), dist.get_rank()),
                    "pid": os.getpid()},
                   f"{self.out}/rank{trainer.global_rank}.pt")


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 4, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)


def trainer(root: Path, **kw: Any) -> Any:
    args: dict[str, Any] = {"accelerator": "cpu", "devices": 2, "max_epochs": 1, "limit_train_batches": 6,
                            "enable_model_summary": False, "enable_progress_bar": False, "logger": False,
                            "default_root_dir": str(root)}
    args.update(kw)
    return L.Trainer(**args)


@pytest.fixture(scope="module")
def halves() -> Iterator[tuple[Mesh, SubMesh, SubMesh]]:
    with Mesh(4, start_timeout=WAIT) as m:
        a, b = m.split(2)
        yield m, a, b


def test_two_fits_on_two_sub_meshes_run_at_once_each_on_its_own_ranks(
        halves: tuple[Mesh, SubMesh, SubMesh], tmp_path: Path) -> None:
    m, a, b = halves
    gate = tmp_path / "gate"
    gate.mkdir()
    models = {"a": Net(lr=0.05, gate=str(gate), me="a", other="b"), "b": Net(lr=0.5, gate=str(gate), me="b", other="a")}
    initial = {k: v.clone() for k, v in models["a"].state_dict().items()}
    trainers: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}

    def fit(name: str) -> None:
        out = tmp_path / name
        out.mkdir()
        try:
            if name == "a":  # built inside `with a:` in this thread: strategy="mesh" runs on sub-mesh a
                with a:
                    trainers[name] = t = trainer(out, strategy="mesh", callbacks=[SaveEveryRank(str(out))],
                                                 logger=L.pytorch.loggers.CSVLogger(str(out)), log_every_n_steps=2)
            else:  # the sub-mesh given to the strategy
                trainers[name] = t = trainer(out, strategy=MeshStrategy(mesh=b), callbacks=[SaveEveryRank(str(out))],
                                             logger=L.pytorch.loggers.CSVLogger(str(out)), log_every_n_steps=2)
            t.fit(models[name], data())
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            errors[name] = e

    threads = [threading.Thread(target=fit, args=(name,)) for name in ("a", "b")]
    for th in threads:
        th.start()
    for th in threads:
        th.join(2 * WAIT)
    assert not any(th.is_alive() for th in threads), "a fit did not end"
    assert not errors, errors

    weights = {}
    for name in ("a", "b"):
        per_rank = [torch.load(tmp_path / name / f"rank{r}.pt") for r in (0, 1)]
        assert [p["world"] for p in per_rank] == [(2, 0, 2, 0), (2, 1, 2, 1)]  # each fit: a world of 2, its own
        sub = a if name == "a" else b
        assert {r: p["pid"] for r, p in enumerate(per_rank)} == sub.run("__import__('os').getpid()")
        for key, value in per_rank[0]["weights"].items():
            assert torch.equal(value, per_rank[1]["weights"][key]), f"{name}: ranks disagree on {key}"
            assert torch.equal(models[name].state_dict()[key], value), f"{name}: the notebook's model is not rank 0's"
        weights[name] = per_rank[0]["weights"]
        assert trainers[name].global_step == 6 and trainers[name].strategy.mesh is (a if name == "a" else b)
        log_dir = Path(trainers[name].logger.log_dir)  # each fit's CSV logger wrote under its own root
        assert log_dir.parent.parent == tmp_path / name
        assert [int(r["step"]) for r in csv.DictReader(open(log_dir / "metrics.csv"))] == [1, 3, 5]
    for key in initial:  # same start, same data, different learning rates: different weights
        assert not torch.equal(weights["a"][key], initial[key])
        assert not torch.equal(weights["a"][key], weights["b"][key])
    assert a.run("world_size") == {0: 2, 1: 2} and b.run("world_size") == {0: 2, 1: 2}


def test_lightnings_loggers_and_checkpoints_are_read_back_from_the_notebook(
        halves: tuple[Mesh, SubMesh, SubMesh], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger

    _, _, b = halves
    # MLflow 3 refuses a file: store unless this is set; set in the notebook only: the ranks get it with the job.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    loggers = [CSVLogger(str(tmp_path / "csv")), TensorBoardLogger(str(tmp_path / "tb")),
               MLFlowLogger(experiment_name="sub", tracking_uri=f"file:{tmp_path / 'mlruns'}")]
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    model = Net(lr=0.1)
    t = trainer(tmp_path, strategy=MeshStrategy(mesh=b), logger=loggers, callbacks=[checkpoints],
                log_every_n_steps=1, max_epochs=2)
    t.fit(model, data())
    steps = list(range(12))

    csv_logger, tb_logger, mlflow_logger = loggers
    rows = [r for r in csv.DictReader(open(Path(csv_logger.log_dir) / "metrics.csv")) if r["train_loss"]]
    assert [int(r["step"]) for r in rows] == steps, rows
    assert (Path(csv_logger.log_dir) / "hparams.yaml").is_file()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb_logger.log_dir)
    events.Reload()
    assert [e.step for e in events.Scalars("train_loss")] == steps
    assert [e.value for e in events.Scalars("train_loss")] == pytest.approx([float(r["train_loss"]) for r in rows])

    from mlflow.tracking import MlflowClient

    assert mlflow_logger.run_id is not None  # rank 0's run, not a new one made in the notebook
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    assert len(client.search_runs([mlflow_logger.experiment_id])) == 1
    history = client.get_metric_history(mlflow_logger.run_id, "train_loss")
    assert sorted(h.step for h in history) == steps
    assert client.get_run(mlflow_logger.run_id).data.params["lr"] == "0.1"

    assert Path(checkpoints.best_model_path).is_file() and checkpoints.best_model_path.startswith(str(tmp_path))
    last = torch.load(checkpoints.last_model_path, weights_only=False)
    assert last["global_step"] == 12
    for key, value in model.state_dict().items():
        assert torch.equal(last["state_dict"][key], value)
    restored = Net.load_from_checkpoint(checkpoints.last_model_path)
    assert restored.hparams.lr == 0.1

    # The fit is a row of the notebook's experiment table (issue 29): its settings, sub-mesh ranks, final loss and
    # checkpoint, as the Trainer has them.
    from monarch_jupyter import experiments

    row = experiments.table().rows()[-1]
    assert row["kind"] == "fit" and row["state"] == "complete", row
    assert row["params_lr"] == 0.1 and row["ranks"] == [2, 3], row
    assert row["final_train_loss"] == pytest.approx(float(t.callback_metrics["train_loss"]))
    assert row["checkpoint"] == checkpoints.best_model_path and row["wall_time_s"] > 0


ON_THE_RANKS = """
import os, time
import lightning as L
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

class OnRanks(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        if batch_idx == 0 and rank == 0:  # wait until the other sub-mesh's fit has begun
            open(os.path.join(GATE, ME), "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(GATE, OTHER)):
                assert time.monotonic() < deadline, f"{OTHER} did not fit while {ME} did"
                time.sleep(0.05)
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

g = torch.Generator().manual_seed(1)
x = torch.randn(256, 4, generator=g)
model = OnRanks()
t = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=1, limit_train_batches=4, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
t.fit(model, DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16))
(t.global_step, t.world_size, t.global_rank, [p.detach().clone() for p in model.parameters()])
"""


def test_two_async_cells_fit_with_lightnings_ddp_on_two_sub_meshes_at_once(
        halves: tuple[Mesh, SubMesh, SubMesh], tmp_path: Path) -> None:
    """The torchrun way, in ``%%mesh --mesh NAME --async`` cells: Lightning's own strategy="ddp" on each sub-mesh's
    ranks (its torchrun variables), two fits at once."""
    _, a, b = halves
    handles = {sub.name: sub.run(f"GATE, ME, OTHER, LR = {str(tmp_path)!r}, {sub.name!r}, {other!r}, {lr}\n"
                                 + ON_THE_RANKS, block=False)
               for sub, other, lr in ((a, "sub1", 0.05), (b, "sub0", 0.5))}
    got = {name: h.result(2 * WAIT) for name, h in handles.items()}
    for name, per_rank in got.items():
        assert [v[:3] for v in per_rank.values()] == [(4, 2, 0), (4, 2, 1)], name
        assert all(torch.equal(p, q) for p, q in zip(per_rank[0][3], per_rank[1][3], strict=True)), name
    assert not all(torch.equal(p, q) for p, q in zip(got["sub0"][0][3], got["sub1"][0][3], strict=True))


def where_am_i(fabric: Any) -> tuple:
    import os

    import torch.distributed as dist

    return fabric.world_size, fabric.global_rank, dist.get_world_size(), os.getpid()


def test_fabric_launches_on_the_sub_mesh_of_its_with_block(halves: tuple[Mesh, SubMesh, SubMesh]) -> None:
    from monarch_jupyter.lightning import MeshFabricStrategy

    _, _, b = halves
    with b:
        fabric = L.Fabric(strategy=MeshFabricStrategy(return_all=True), accelerator="cpu", devices=2)
    got = fabric.launch(where_am_i)
    pids = b.run("__import__('os').getpid()")
    assert got == {r: (2, r, 2, pids[r]) for r in (0, 1)}


def test_bad_input_names_the_fix_and_leaves_every_sub_mesh_usable(
        halves: tuple[Mesh, SubMesh, SubMesh], tmp_path: Path) -> None:
    m, a, b = halves
    with pytest.raises(MeshLightningError,
                       match=r"wants 4 ranks, but sub-mesh 'sub0' has 2 \(mesh ranks 0,1\).*or merge the mesh"):
        trainer(tmp_path, strategy=MeshStrategy(mesh=a), devices=4)
    with pytest.raises(MeshLightningError, match=r"the mesh is split into sub-meshes \(sub0, sub1\)"):
        trainer(tmp_path, strategy="mesh")
    with a:
        with a:  # the same sub-mesh again: fine
            assert selected() is a
        with pytest.raises(MonarchError, match=r"already inside  with sub0:  in this thread"), b:
            pass
        assert selected() is a
        seen: list[Any] = []
        th = threading.Thread(target=lambda: seen.append(selected()))  # another thread: outside the block
        th.start()
        th.join(WAIT)
        assert seen == [None]
    assert selected() is None
    assert a.run("world_size") == {0: 2, 1: 2} and b.run("world_size") == {0: 2, 1: 2}

    m.merge()
    with pytest.raises(MonarchError, match="sub-mesh 'sub0' no longer exists"):
        trainer(tmp_path, strategy=MeshStrategy(mesh=a))
    with pytest.raises(MonarchError, match="sub-mesh 'sub1' no longer exists"), b:
        pass
    assert m.run("world_size") == dict.fromkeys(range(4), 4)


def test_an_optuna_sweep_fits_with_lightning_on_each_leased_sub_mesh(
        halves: tuple[Mesh, SubMesh, SubMesh], tmp_path: Path) -> None:
    """monarch_jupyter.sweep runs each trial in an Optuna worker thread on a leased sub-mesh: the objective fits
    with MeshStrategy(mesh=sub) there (the mesh was merged by the test before)."""
    optuna = pytest.importorskip("optuna")
    from monarch_jupyter import sweep

    m, _, _ = halves

    def objective(trial: Any, sub: SubMesh) -> float:
        t = trainer(tmp_path / str(trial.number), strategy=MeshStrategy(mesh=sub), limit_train_batches=4)
        t.fit(Net(lr=trial.suggest_float("lr", 0.01, 1.0, log=True)), data())
        trial.set_user_attr("steps", t.global_step)
        return float(t.callback_metrics["train_loss"])

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = sweep(m, objective, optuna.create_study(), n_trials=2, ranks_per_trial=2, catch=())
    assert [(t.state.name, t.user_attrs["steps"]) for t in study.trials] == [("COMPLETE", 4), ("COMPLETE", 4)]
    assert all(t.user_attrs["ranks"] in ([0, 1], [2, 3]) for t in study.trials)
    assert m.subs == {} and m.run("world_size") == dict.fromkeys(range(4), 4)
