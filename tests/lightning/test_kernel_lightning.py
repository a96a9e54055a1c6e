"""Trainer(strategy="mesh") and Fabric(strategy="mesh") in plain cells of a real Jupyter kernel (jupyter_client).

One kernel and one 2-rank mesh serve the whole module (importing Lightning costs seconds in the kernel and in each
rank); tests run in file order and leave the mesh usable. About a minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")
from jupyter_client.manager import start_new_kernel  # noqa: E402

pytestmark = [pytest.mark.kernel, pytest.mark.slow]

TIMEOUT = 180
HERE = Path(__file__).parent

DEFINITIONS = '''
import os, time
import torch, torch.nn as nn
import lightning as L
from torch.utils.data import DataLoader, TensorDataset

class Net(L.LightningModule):
    def __init__(self, lr=0.1, fail_on_rank=None, die_on_rank=None, sleep=0.0, stop_on_rank=None):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_rank == self.hparams.fail_on_rank and batch_idx == 1:
            raise ValueError("bad batch on purpose")
        if self.global_rank == self.hparams.die_on_rank and batch_idx == 1:
            os._exit(7)
        if self.global_rank == self.hparams.stop_on_rank and batch_idx == 0:
            breakpoint()
        time.sleep(self.hparams.sleep)
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self.net(x).argmax(1) == y).float().mean(), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

class Data(L.LightningDataModule):
    def __init__(self, x, y, batch_size=16):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size
    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size, shuffle=True)
    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=64)
    test_dataloader = val_dataloader

g = torch.Generator().manual_seed(0)
X = torch.randn(4096, 8, generator=g)   # 128 KiB: shipped once, then kept on the ranks by identity
Y = (X[:, 0] > 0).long()
dm = Data(X, Y)

def new_trainer(**kw):
    args = dict(strategy="mesh", accelerator="cpu", devices=2, max_epochs=1, limit_train_batches=8,
                limit_val_batches=2, enable_model_summary=False, logger=False, default_root_dir=ROOT)
    args.update(kw)
    return L.Trainer(**args)
'''


@dataclass
class Outcome:
    reply: dict
    stdout: str = ""
    stderr: str = ""
    results: list[str] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    displays: list[dict] = field(default_factory=list)
    comms: str = ""
    prompts: list[str] = field(default_factory=list)
    views: dict[str, str] = field(default_factory=dict)  # the cell's views (display id -> their last text/plain)

    @property
    def view(self) -> str:
        """The ranks' lines, as the cell's views hold them in their final text/plain (widgets.celldash)."""
        return "\n".join(self.views.values())

    @property
    def ok(self) -> bool:
        return self.reply.get("status") == "ok"

    @property
    def traceback(self) -> str:
        return "\n".join("\n".join(e["traceback"]) for e in self.errors)


class Kernel:
    def __init__(self, km: Any, kc: Any) -> None:
        self.km, self.kc = km, kc

    def run(self, code: str, *, answers: list[str] | None = None, interrupt_when: str | None = None,
            interrupt_on_output: tuple[str, ...] = ()) -> Outcome:
        """Run ``code`` as a person's frontend does (stdin allowed: the cell's view is live); answer pdb prompts from
        ``answers`` (else "c"); interrupt the kernel once ``interrupt_when`` shows up in the cell's comm
        (dashboard) messages, or once every string of ``interrupt_on_output`` is in its
        output."""
        kc, answers = self.kc, list(answers or [])
        # stop_on_error=False: a cell of its own, not aborted after an earlier error (test_kernel.execute)
        msg_id = kc.execute(code, allow_stdin=True, stop_on_error=False)
        out = Outcome(reply={})
        idle, interrupted = False, False
        deadline = time.monotonic() + TIMEOUT
        while not (idle and out.reply):
            assert time.monotonic() < deadline, f"no end of {code[:80]!r}; stdout so far:\n{out.stdout}{out.stderr}"
            busy = False
            if kc.stdin_channel.msg_ready():
                busy = True
                msg = kc.get_stdin_msg(timeout=1)
                if msg["msg_type"] == "input_request":
                    out.prompts.append(msg["content"]["prompt"])
                    kc.input(answers.pop(0) if answers else "c")
            while kc.iopub_channel.msg_ready():
                busy = True
                msg = kc.get_iopub_msg(timeout=1)
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream":
                    setattr(out, content["name"], getattr(out, content["name"]) + content["text"])
                elif kind == "execute_result":
                    out.results.append(content["data"]["text/plain"])
                elif kind in ("display_data", "update_display_data"):
                    if kind == "display_data":
                        out.displays.append(content["data"])
                    display_id = content.get("transient", {}).get("display_id", "")
                    if display_id.startswith("mj-dash-"):
                        out.views[display_id] = content["data"].get("text/plain", "")
                elif kind in ("comm_msg", "comm_open"):
                    out.comms += json.dumps(content.get("data", {}))
                elif kind == "error":
                    out.errors.append(content)
                elif kind == "status" and content["execution_state"] == "idle":
                    idle = True
            shown = out.stdout + out.stderr + out.comms  # the ranks' lines show in the live view's comm messages
            printed = interrupt_on_output and all(t in shown for t in interrupt_on_output)
            if not interrupted and ((interrupt_when and interrupt_when in out.comms) or printed):
                self.km.interrupt_kernel()
                interrupted = True
            if kc.shell_channel.msg_ready():
                busy = True
                msg = kc.get_shell_msg(timeout=1)
                if msg["parent_header"].get("msg_id") == msg_id:
                    out.reply = msg["content"]
            if not busy:
                time.sleep(0.01)
        return out

    def ok(self, code: str, **kw: Any) -> Outcome:
        out = self.run(code, **kw)
        assert out.ok, out.traceback + out.stderr[-3000:]
        return out

    def value(self, expr: str) -> Any:
        out = self.ok(f"import json as _json; print(_json.dumps({expr}))")
        return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    root = tmp_path_factory.mktemp("lightning")
    km, kc = start_new_kernel(kernel_name="python3", env=dict(os.environ), cwd=str(root))
    k = Kernel(km, kc)
    try:
        k.ok("%load_ext monarch\nm = %mesh start -n 2")
        k.ok(f"ROOT = {str(root)!r}\n" + DEFINITIONS)
        yield k
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_fit_in_a_plain_cell_updates_the_notebooks_objects(kernel: Kernel) -> None:
    kernel.ok("L.seed_everything(0); model = Net(); w0 = {k: v.clone() for k, v in model.state_dict().items()}\n"
              "trainer = new_trainer(max_epochs=2, enable_checkpointing=True)")
    out = kernel.ok("trainer.fit(model, datamodule=dm)")
    # The dashboard, with Lightning's progress as progress rows and logged metrics as values; no cursor codes.
    assert any("mesh cell on ranks 0,1" in d.get("text/plain", "") for d in out.displays)
    assert "Epoch 1" in out.comms and "train_loss=" in out.comms
    assert "\r" not in out.stdout + out.stderr and "\x1b[" not in out.stdout + out.stderr
    assert "[rank0]: `Trainer.fit` stopped: `max_epochs=2` reached." in out.view  # in the cell's view, once
    state = kernel.value("dict(epoch=trainer.current_epoch, step=trainer.global_step, status=trainer.state.status,"
                         " changed=not all(torch.equal(w0[k], v) for k, v in model.state_dict().items()),"
                         " metrics=sorted(trainer.callback_metrics), logged=sorted(trainer.logged_metrics),"
                         " best=trainer.checkpoint_callback.best_model_path,"
                         " best_exists=os.path.exists(trainer.checkpoint_callback.best_model_path))")
    assert state["epoch"] == 2 and state["step"] == 16 and state["status"] == "finished" and state["changed"]
    assert state["metrics"] == ["train_loss", "val_loss"] and state["logged"] == ["train_loss", "val_loss"]
    assert state["best"].endswith("epoch=1-step=16.ckpt") and state["best_exists"]
    # The notebook's weights are rank 0's: the ranks' DDP replicas agree, so a validate on them reproduces
    # the loss the notebook computes with its own copy.
    out = kernel.ok("v = new_trainer(limit_val_batches=None).validate(model, datamodule=dm, verbose=False)[0]"
                    "['val_loss']\n"
                    "with torch.no_grad(): local = nn.functional.cross_entropy(model.net(X), Y).item()\n"
                    "print(abs(v - local) < 1e-5)")
    assert out.stdout.strip().endswith("True")


def test_second_fit_edited_module_and_resume(kernel: Kernel) -> None:
    # The same Trainer again: it goes on from where it stopped, like a local Trainer (max_epochs raised).
    kernel.ok("trainer.fit_loop.max_epochs = 3\ntrainer.fit(model, datamodule=dm)")
    assert kernel.value("[trainer.current_epoch, trainer.global_step]") == [3, 24]
    # A module edited in the notebook (a new class object under the same name) is what the ranks run.
    kernel.ok(textwrap.dedent('''
        class Net2(Net):
            def training_step(self, batch, batch_idx):
                print(f"edited step on rank {self.global_rank}")
                return super().training_step(batch, batch_idx)
        model2 = Net2()
        t2 = new_trainer(limit_train_batches=1, limit_val_batches=0)
        t2.fit(model2, datamodule=dm)
    '''))
    out = kernel.ok("t3 = new_trainer(limit_train_batches=1, limit_val_batches=0)\nt3.fit(model2, datamodule=dm)")
    assert "[rank0]: edited step on rank 0" in out.view and "[rank1]: edited step on rank 1" in out.view
    # Resume from the best checkpoint of the first fit with a fresh Trainer.
    kernel.ok("t4 = new_trainer(max_epochs=3)\nt4.fit(Net(), datamodule=dm, ckpt_path=trainer.checkpoint_callback"
              ".best_model_path)")
    assert kernel.value("[t4.current_epoch, t4.global_step]") == [3, 24]


def test_validate_test_and_predict_in_dataloader_order(kernel: Kernel) -> None:
    out = kernel.ok("res = trainer.test(model, datamodule=dm, verbose=False)\nprint(sorted(res[0]))")
    assert "['test_acc']" in out.stdout
    out = kernel.ok(textwrap.dedent('''
        loader = DataLoader(TensorDataset(X[:50], Y[:50]), batch_size=8)
        preds = trainer.predict(model, loader)
        with torch.no_grad():
            local = [model.net(xb) for xb, _ in loader]
        print(len(preds), [tuple(p.shape) for p in preds][-1], all(torch.allclose(a, b, atol=1e-6)
              for a, b in zip(preds, local)))
    '''))
    assert out.stdout.strip().endswith("7 (2, 2) True")


def test_large_data_is_kept_on_the_ranks_by_identity(kernel: Kernel) -> None:
    kernel.ok("big = torch.randn(300_000, 8); bigy = (big[:, 0] > 0).long(); bdm = Data(big, bigy, 256)")
    sizes = []
    for _ in range(2):
        kernel.ok("from monarch_jupyter.lightning import shipping, launch, target\n"
                  "t = new_trainer(limit_train_batches=2, limit_val_batches=0)\nt.fit(model, datamodule=bdm)")
        sizes.append(kernel.value("sum(len(s.data) + sum(x.numel() * x.element_size() for x in s.slots) "
                                  "for s in [shipping.pickle_job(bdm, launch._kept_for(target.Target(m)))]) >> 20"))
    assert sizes[-1] == 0  # the 9 MiB data set is not in the job any more: a token stands for it
    # Changed in place in the notebook: shipped again (torch's version counter).
    kernel.ok("big.mul_(1.0)\nt = new_trainer(limit_train_batches=2, limit_val_batches=0)\n"
              "t.fit(model, datamodule=bdm)")


def test_error_in_training_step_shows_the_ranks_frames_and_the_mesh_survives(kernel: Kernel) -> None:
    out = kernel.run("bad = new_trainer()\nbad.fit(Net(fail_on_rank=1), datamodule=dm)")
    assert not out.ok
    tb = out.traceback
    assert "MeshError" in tb and "trainer.fit failed" in tb and "[rank1]" in tb
    assert "ValueError: bad batch on purpose" in tb and 'raise ValueError("bad batch on purpose")' in tb
    assert "in training_step" in tb
    # Short, and the user's frame first: the package's runner and Lightning's and torch's ~36 frames are one line,
    # the cell is named as the notebook names it (not ipykernel's temporary file).
    assert len(tb.splitlines()) < 40, tb
    root = tb.split("--- root cause", 1)[1]
    frames = [line for line in root.splitlines() if '  File "' in line]
    assert frames[0].startswith('[rank1]   File "<cell In[') and "in training_step" in frames[0], tb
    assert "frames in monarch_jupyter, lightning, torch: %mesh debug --rank 1 shows them]" in tb
    assert "lightning/rank.py" not in tb and "ipykernel_" not in tb
    # Counters as a local Trainer holds them after the exception: rank 0 finished step 0, then was released from
    # step 1's gradient all_reduce (rank 1 raised in its forward).
    assert kernel.value("[bad.interrupted, bad.global_step, bad.current_epoch]") == [True, 1, 0]
    kernel.ok("ok = new_trainer(limit_train_batches=2, limit_val_batches=0)\nok.fit(Net(), datamodule=dm)")


def test_interrupt_stops_every_rank_and_the_next_fit_works(kernel: Kernel) -> None:
    out = kernel.run("slow = new_trainer(max_epochs=1000, limit_train_batches=None)\n"
                     "slow.fit(Net(sleep=0.01), datamodule=dm)", interrupt_when="train_loss=")
    assert not out.ok and "TrainingInterrupted" in out.traceback
    assert kernel.value("[slow.interrupted, slow.current_epoch < 999]") == [True, True]
    kernel.ok("ok = new_trainer(limit_train_batches=2, limit_val_batches=0)\nok.fit(Net(), datamodule=dm)")
    assert kernel.value("ok.global_step") == 2


def test_interrupt_names_the_cell_and_brings_the_counters_back(kernel: Kernel) -> None:
    # Both ranks wait in the cell's training_step at batch 3 (after 3 steps) when the interrupt comes.
    kernel.ok(textwrap.dedent('''
        class Hang(Net):
            def training_step(self, batch, batch_idx):
                if batch_idx == 3:
                    print(f"hanging on rank {self.global_rank}", flush=True)
                    time.sleep(600)
                return super().training_step(batch, batch_idx)
        hang = Hang(); h0 = {k: v.clone() for k, v in hang.state_dict().items()}
        hung = new_trainer(max_epochs=5, limit_train_batches=None, limit_val_batches=0)
    '''))
    out = kernel.run("hung.fit(hang, datamodule=dm)",
                     interrupt_on_output=("hanging on rank 0", "hanging on rank 1"))
    assert not out.ok and "TrainingInterrupted" in out.traceback
    assert "time.sleep at <cell In[" in out.traceback and "in training_step" in out.traceback, out.traceback
    assert "ipykernel_" not in out.traceback
    # Rank 0's counters, metrics and weights so far, as Lightning's launcher recovers them.
    state = kernel.value("dict(i=hung.interrupted, step=hung.global_step, epoch=hung.current_epoch, "
                         "batches=hung.fit_loop.epoch_loop.batch_progress.current.completed, "
                         "metrics=sorted(hung.callback_metrics), "
                         "changed=not all(torch.equal(h0[k], v) for k, v in hang.state_dict().items()))")
    assert state == {"i": True, "step": 3, "epoch": 0, "batches": 3, "metrics": ["train_loss"], "changed": True}
    kernel.ok("ok = new_trainer(limit_train_batches=2, limit_val_batches=0)\nok.fit(Net(), datamodule=dm)")
    assert kernel.value("ok.global_step") == 2


def test_a_rank_that_dies_is_reported_and_restart_rank_brings_it_back(kernel: Kernel) -> None:
    out = kernel.run("dying = new_trainer()\ndying.fit(Net(die_on_rank=1), datamodule=dm)")
    assert not out.ok and "[rank1] died (exit code 7)" in out.traceback
    kernel.ok("%mesh restart --rank 1")
    # Rank 1 is a fresh process: it lacks the data set kept by identity, says so, and gets it again.
    kernel.ok("ok = new_trainer(limit_train_batches=2, limit_val_batches=0)\nok.fit(Net(), datamodule=bdm)")
    assert kernel.value("ok.global_step") == 2


def test_breakpoint_in_training_step_opens_the_mesh_pdb_prompt(kernel: Kernel) -> None:
    out = kernel.run("dbg = new_trainer(limit_train_batches=1, limit_val_batches=0)\n"
                     "dbg.fit(Net(stop_on_rank=0), datamodule=dm)", answers=["p batch_idx", "c"])
    assert out.ok, out.traceback
    assert out.prompts and "rank 0" in out.prompts[0]
    assert "training_step" in out.stdout or "batch_idx" in out.stdout


def test_fabric_launch_returns_rank_zero_or_every_rank(kernel: Kernel) -> None:
    out = kernel.ok(textwrap.dedent('''
        def work(fabric, k):
            t = torch.tensor([float(fabric.global_rank + k)])
            return fabric.all_reduce(t, reduce_op="sum").item(), fabric.global_rank
        fabric = L.Fabric(strategy="mesh", accelerator="cpu", devices=2)
        print(fabric.launch(work, 10), dict(fabric.strategy.rank_results))
    '''))
    assert out.stdout.strip().endswith("(21.0, 0) {0: (21.0, 0), 1: (21.0, 1)}")


def test_fabric_launch_without_a_function_raises_what_lightning_raises_for_spawn(kernel: Kernel) -> None:
    out = kernel.run("fab0 = L.Fabric(strategy='mesh', accelerator='cpu', devices=2)\nfab0.launch()")
    assert not out.ok and out.errors[0]["ename"] == "TypeError"
    assert out.errors[0]["evalue"] == ("To spawn processes with the `MeshFabricStrategy` strategy, `.launch()` needs "
                                       "to be called with a function that contains the code to launch in processes.")
    # As after Lightning's own TypeError: setup asks for launch() (not a missing process group)...
    out = kernel.run("fab0.setup(Net())")
    assert out.errors[0]["ename"] == "RuntimeError" and "you must call `.launch()`" in out.errors[0]["evalue"]
    # ...and launch with a function works.
    assert kernel.value("fab0.launch(lambda f: f.world_size)") == 2


def test_ddp_in_a_notebook_with_a_mesh_points_to_strategy_mesh(kernel: Kernel) -> None:
    out = kernel.run("L.Trainer(strategy='ddp', accelerator='cpu', devices=2)")
    assert not out.ok and out.errors[0]["ename"] == "MisconfigurationException"
    assert "ddp_notebook" in out.errors[0]["evalue"]
    hints = [line for line in out.stderr.splitlines() if 'strategy="mesh"' in line]
    assert hints == ['monarch: a mesh of 2 ranks runs in this notebook: Trainer(strategy="mesh", devices=2) runs '
                     'DDP on its ranks from this cell, without forking the kernel (docs/lightning.md)'], out.stderr
    out = kernel.run("L.Fabric(strategy='ddp', accelerator='cpu', devices=2)")
    assert not out.ok and 'Fabric(strategy="mesh", devices=2)' in out.stderr


def test_bad_input_names_the_fix_and_changes_nothing(kernel: Kernel) -> None:
    out = kernel.run("new_trainer(devices=3)")
    assert "MeshLightningError" in out.traceback and "devices=2" in out.traceback
    out = kernel.run(textwrap.dedent('''
        import threading
        class Locked(Net):
            def __init__(self):
                super().__init__()
                self.lock = threading.Lock()
        locked = Locked()
        w = {k: v.clone() for k, v in locked.state_dict().items()}
        new_trainer().fit(locked, datamodule=dm)
    '''))
    assert "UnpicklableJobError" in out.traceback and "model.lock" in out.traceback
    assert kernel.value("all(torch.equal(w[k], v) for k, v in locked.state_dict().items()) and m.running")


def test_weights_equal_torchrun_ddp_bitwise(kernel: Kernel, tmp_path: Path) -> None:
    script = HERE / "parity_script.py"
    ref = tmp_path / "torchrun.pt"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("PARITY_STRATEGY", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(ref)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mine = tmp_path / "mesh.pt"
    kernel.ok(f"src = open({str(script)!r}).read().split('if __name__')[0]\nexec(src)\n"
              f"os.environ['PARITY_STRATEGY'] = 'mesh'\ntrain({str(mine)!r})\ndel os.environ['PARITY_STRATEGY']")
    import torch

    a, b = torch.load(ref), torch.load(mine)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), {k: (a[k] - b[k]).abs().max().item() for k in a}


def test_two_notebook_threads_fit_on_two_sub_meshes_at_once(kernel: Kernel) -> None:
    """Issue 29, item 2, in a real kernel with its live views: two threads, each building its Trainer inside its
    own ``with sub:`` block, fit on the two halves of the split mesh; each fit waits at its first step until the
    other's has begun, so fits that did not overlap fail. Then the mesh merges and fits on both ranks again."""
    kernel.ok("%mesh split 2")  # binds sub0 (rank 0) and sub1 (rank 1) in the notebook
    try:
        out = kernel.ok(textwrap.dedent('''
            import tempfile, threading
            gate = tempfile.mkdtemp()

            class Gated(Net):
                def __init__(self, me, other):
                    super().__init__()
                    self.me, self.other = me, other

                def training_step(self, batch, batch_idx):
                    if batch_idx == 0:
                        open(os.path.join(gate, self.me), "w").close()
                        deadline = time.monotonic() + 120
                        while not os.path.exists(os.path.join(gate, self.other)):
                            assert time.monotonic() < deadline, f"{self.other} did not fit while {self.me} did"
                            time.sleep(0.05)
                    return super().training_step(batch, batch_idx)

            fitted, failed = {}, {}

            def fit_on(sub, other):
                try:
                    with sub:
                        t = new_trainer(devices=1)
                    t.fit(Gated(sub.name, other), datamodule=dm)
                    fitted[sub.name] = (t.global_step, t.strategy.mesh.name)
                except BaseException as e:
                    failed[sub.name] = repr(e)

            threads = [threading.Thread(target=fit_on, args=(sub0, "sub1")),
                       threading.Thread(target=fit_on, args=(sub1, "sub0"))]
            for th in threads:
                th.start()
            for th in threads:
                th.join(300)
            print(sorted(fitted.items()), failed)
        '''))
        assert out.stdout.strip().splitlines()[-1] == "[('sub0', (8, 'sub0')), ('sub1', (8, 'sub1'))] {}", out.stdout
    finally:
        kernel.ok("%mesh merge")
    assert kernel.value("new_trainer().fit(Net(), datamodule=dm) or m.run('world_size')") == {"0": 2, "1": 2}


def test_ranks_started_after_import_lightning_import_it_at_once(kernel: Kernel) -> None:
    """The notebook imported Lightning before these ranks started (a full restart): they import it in the background
    as soon as they are up (issue 30, item 3), so the first fit does not wait for it. The %%mesh cell runs after that
    background import, in order, so it sees Lightning already imported although no Trainer was made since."""
    kernel.ok("%mesh restart")
    out = kernel.ok("%%mesh\nimport sys\n"
                    "print('warm', 'lightning.pytorch' in sys.modules, 'lightning.fabric' in sys.modules)")
    assert out.view.count("warm True True") == 2, out.view


def test_mesh_stopped_gives_a_clear_error(kernel: Kernel) -> None:
    kernel.ok("%mesh stop")
    out = kernel.run("new_trainer()")
    assert "MeshNotRunningError" in out.traceback and "%mesh" in out.traceback
    out = kernel.run("L.Trainer(strategy='ddp', accelerator='cpu', devices=2)")  # no mesh: Lightning's advice only
    assert "ddp_notebook" in out.errors[0]["evalue"] and 'strategy="mesh"' not in out.stderr
