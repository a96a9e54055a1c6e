"""The bodies of bench/gpu_check.py's checks; each runs alone in a fresh interpreter (``--run-check NAME``).

A body raises (AssertionError with what it saw) to fail, returns to pass, and calls ``skip(why)`` to be skipped. It
prints ``DETAIL`` lines for the summary: sizes in MiB, times in seconds, ratios. Every mesh is stopped before the
body returns (``with Mesh(...)``); the driver ends the process group of a body that runs past its timeout.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable

SKIP_CODE = 77
MiB = 2**20


class Skipped(Exception):
    pass


def skip(why: str) -> None:
    raise Skipped(why)


def detail(text: str) -> None:
    print(f"DETAIL {text}", flush=True)


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _mesh(n: int, **kw):
    from monarch_jupyter import Mesh

    if _gpus() < n:
        skip(f"needs {n} GPUs")
    return Mesh(n, backend="nccl", start_timeout=120, **kw)


# ---------------------------------------------------------------------------------------------- the checks


def cuda_then_start() -> None:
    """The kernel touches CUDA first, then ``%mesh start``: ranks come from the fork server, not from this process."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "monarch")
    touched = shell.run_cell("import torch; a = torch.ones(4, device='cuda'); s = float(a.sum())")
    assert touched.success and shell.user_ns["s"] == 4.0, touched
    t = time.perf_counter()
    shell.run_line_magic("mesh", "start -n 1 --backend nccl")
    detail(f"%mesh start -n 1 --backend nccl after CUDA in the kernel: {time.perf_counter() - t:.2f} s")
    from monarch_jupyter import current_mesh

    mesh = current_mesh()
    try:
        got = mesh.run("str(device), float((torch.ones(4, device=device) * 2).sum()), __import__('os').getpid()")
        dev, total, pid = got[0]
        assert dev == "cuda:0" and total == 8.0, got
        assert pid != os.getpid()
        cell = shell.run_cell("%%mesh\ny = torch.full((2,), 3.0, device=device)\nfloat(y.sum())")
        assert cell.success, cell.error_in_exec
    finally:
        shell.run_line_magic("mesh", "stop")


def _transfer_figures(mesh, n: int) -> None:
    import torch

    mesh.run(textwrap.dedent("""
        def _copy_times(nbytes):
            cpu = torch.empty(nbytes, dtype=torch.uint8)
            gpu = cpu.to(device); torch.cuda.synchronize()
            h2d, d2h = [], []
            for _ in range(3):
                t = time.perf_counter(); gpu = cpu.to(device); torch.cuda.synchronize()
                h2d.append(time.perf_counter() - t)
                t = time.perf_counter(); back = gpu.cpu(); torch.cuda.synchronize()
                d2h.append(time.perf_counter() - t)
            return min(h2d), min(d2h)
        """))
    mesh.run("import time")
    for size in (1 * MiB, 64 * MiB, 256 * MiB):
        x = torch.arange(size // 4, dtype=torch.float32)
        mesh.push(x=x, device="rank")  # warm-up of the route
        t = time.perf_counter()
        mesh.push(x=x, device="rank")
        push = time.perf_counter() - t
        where = mesh.run("str(x.device), float(x[-1])")
        assert all(w == (f"cuda:{r}", float(size // 4 - 1)) for r, w in where.items()), where
        t = time.perf_counter()
        back = mesh.pull("x")
        pull = time.perf_counter() - t
        assert all(v.device.type == "cpu" and torch.equal(v, x) for v in back.values())
        h2d, d2h = max(mesh.run(f"_copy_times({size})").values())
        detail(f"{size // MiB} MiB to {n} rank(s): push {push * 1e3:.1f} ms ({push / h2d:.1f}x the rank's "
               f"host-to-device copy {h2d * 1e3:.2f} ms), pull {pull * 1e3:.1f} ms ({pull / d2h:.1f}x its "
               f"device-to-host copy {d2h * 1e3:.2f} ms)")
        del back


def _nccl_group(n: int) -> None:
    with _mesh(n) as mesh:
        got = mesh.run("dist.get_backend(), str(device)")
        assert got == {r: ("nccl", f"cuda:{r}") for r in range(n)}, got
        total = mesh.run("t = torch.full((1024,), float(rank + 1), device=device); dist.all_reduce(t); "
                         "float(t[0])")
        assert total == dict.fromkeys(range(n), float(n * (n + 1) // 2)), total
        detail(f"all_reduce on {n} rank(s): {total[0]:g} on every rank")
        _transfer_figures(mesh, n)


def nccl_one_rank() -> None:
    _nccl_group(1)


def nccl_two_ranks() -> None:
    _nccl_group(2)


def dashboard_cuda() -> None:
    from monarch_jupyter.widgets import monitor_for
    from monarch_jupyter.widgets.dashboard import render_table

    with _mesh(1, heartbeat_interval=0.2) as mesh:
        monitor = monitor_for(mesh)
        mesh.run("x = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)")
        row = _wait_row(monitor, lambda r: r.cuda_allocated >= 256 * MiB)
        assert row.cuda_reserved >= row.cuda_allocated, row
        assert mesh.status()[0]["cuda_allocated"] >= 256 * MiB, mesh.status()
        html = render_table([row])
        shown = re.search(r"cuda (\d+) MiB/(\d+(?:\.\d)? [MG]iB)", html)  # the memory column: allocated/reserved
        assert shown is not None and int(shown.group(1)) >= 256, html
        detail(f"after 256 MiB: allocated {row.cuda_allocated / MiB:.0f} MiB, reserved "
               f"{row.cuda_reserved / MiB:.0f} MiB; the table shows '{shown.group(0)}'")
        mesh.run("del x; torch.cuda.empty_cache()")
        row = _wait_row(monitor, lambda r: r.cuda_allocated < 256 * MiB)
        detail(f"after del + empty_cache: allocated {row.cuda_allocated / MiB:.0f} MiB")


def _wait_row(monitor, ok: Callable, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while True:
        row = monitor.snapshot()[0][0]
        if ok(row) or time.monotonic() > deadline:
            assert ok(row), f"the dashboard's row did not follow within {timeout:g} s: {row}"
            return row
        time.sleep(0.1)


def lightning_gpu() -> None:
    t0 = time.perf_counter()
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import monarch_jupyter.lightning  # noqa: F401  (registers strategy="mesh")

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2))

        def training_step(self, batch, batch_idx):
            x, y = batch
            assert x.device.type == "cuda", x.device
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=g)
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=64)
    with _mesh(1):
        t = time.perf_counter()
        trainer = L.Trainer(accelerator="gpu", devices=1, strategy="mesh", max_steps=30, logger=False,
                            enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
        trainer.fit(Net(), data)
        assert trainer.global_step == 30, trainer.global_step
        detail(f"fit of 30 steps on cuda: {time.perf_counter() - t:.2f} s ({time.perf_counter() - t0:.2f} s "
               "from import lightning)")


DDP_SCRIPT = '''
import json, os, statistics, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("nccl")
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda(),
            device_ids=[local])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(256, 1024, device="cuda")
times = []
for step in range(80):
    torch.cuda.synchronize(); t = time.perf_counter()
    loss = model(x).square().mean(); loss.backward(); opt.step(); opt.zero_grad()
    torch.cuda.synchronize(); times.append(time.perf_counter() - t)
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"step": statistics.median(times[20:]), "loss": float(loss)}, f)
dist.destroy_process_group()
'''

BUSBW_SCRIPT = '''
import json, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
n = dist.get_world_size()
t = torch.ones(64 * 2**20, device="cuda")  # 256 MiB of float32
for _ in range(5):
    dist.all_reduce(t)
torch.cuda.synchronize(); t0 = time.perf_counter()
for _ in range(20):
    dist.all_reduce(t)
torch.cuda.synchronize(); took = (time.perf_counter() - t0) / 20
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"step": took, "busbw": t.numel() * 4 * 2 * (n - 1) / n / took / 1e9}, f)
dist.destroy_process_group()
'''


def _mesh_vs_torchrun(n: int, script: str) -> tuple[dict, dict]:
    """Run ``script`` with %mesh run on an n-rank NCCL mesh, then under torchrun; each writes rank 0's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "script.py")
        with open(path, "w") as f:
            f.write(script)
        with _mesh(n) as mesh:
            mesh.run_script(path, os.path.join(tmp, "mesh.json"), timeout=60)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                        path, os.path.join(tmp, "torchrun.json")], check=True, timeout=60, capture_output=True)
        return tuple(json.load(open(os.path.join(tmp, f"{w}.json"))) for w in ("mesh", "torchrun"))


def ddp_vs_torchrun() -> None:
    n = min(_gpus(), 2)
    mesh, tr = _mesh_vs_torchrun(n, DDP_SCRIPT)
    ratio = mesh["step"] / tr["step"]
    detail(f"DDP step on {n} GPU(s): mesh {mesh['step'] * 1e3:.2f} ms, torchrun {tr['step'] * 1e3:.2f} ms "
           f"({ratio:.2f}x); loss {mesh['loss']:.4f} / {tr['loss']:.4f}")
    assert abs(mesh["loss"] - tr["loss"]) < 1e-3 * max(1.0, abs(tr["loss"])), (mesh, tr)
    assert ratio < 1.5, f"a DDP step on the mesh takes {ratio:.2f}x torchrun's"


def busbw_vs_torchrun() -> None:
    mesh, tr = _mesh_vs_torchrun(2, BUSBW_SCRIPT)
    detail(f"all_reduce of 256 MiB on 2 ranks: busbw mesh {mesh['busbw']:.1f} GB/s, torchrun {tr['busbw']:.1f} "
           f"GB/s ({mesh['busbw'] / tr['busbw']:.2f}x)")
    assert mesh["busbw"] > 0.7 * tr["busbw"], (mesh, tr)


def _release_by_force(n: int, code: str) -> None:
    """Run ``code`` (a collective that never completes), ``%mesh interrupt --force``, then the mesh works again."""
    from monarch_jupyter import MeshError

    with _mesh(n, interrupt_grace=5.0) as mesh:
        mesh.run("t = torch.ones(1, device=device); dist.all_reduce(t); float(t[0])")  # the communicator exists
        handle = mesh.run(code, block=False)
        time.sleep(3.0)
        assert not handle.done(), "the collective completed: nothing to release"
        t = time.perf_counter()
        report = mesh.interrupt(force=True)
        released = handle.wait(60)
        took = time.perf_counter() - t
        assert released, f"the cell still runs 60 s after interrupt --force: {report.text}"
        detail(f"interrupt --force released the cell in {took:.2f} s: interrupted {report.interrupted}, killed "
               f"{report.killed}, regrouped {report.regrouped}")
        try:
            handle.result()
        except (MeshError, KeyboardInterrupt) as e:
            detail(f"the cell raised {type(e).__name__}")
        dead = [r for r, s in mesh.status().items() if s["state"] == "dead"]
        if len(dead) == n:
            mesh.restart()  # every rank: a fresh mesh
        elif dead:
            mesh.restart(ranks=dead)
        total = mesh.run("t = torch.ones(1, device=device); dist.all_reduce(t); float(t[0])")
        assert total == dict.fromkeys(range(n), float(n)), total
        again = f"ranks {dead} restarted" if dead else "no restart"
        detail(f"afterwards an all_reduce works on {n} rank(s) ({again})")


def hang_force() -> None:
    # One GPU cannot hold two NCCL ranks, so the all_reduce waits behind a kernel that spins for minutes.
    _release_by_force(1, "torch.cuda._sleep(2**40); t = torch.ones(1, device=device); dist.all_reduce(t); t.item()")


def hang_force_two() -> None:
    _release_by_force(2, "t = torch.ones(1, device=device)\nif rank == 0:\n    dist.all_reduce(t); t.item()\n"
                         "else:\n    __import__('time').sleep(600)")


def raise_release_nccl() -> None:
    from monarch_jupyter import MeshError, MeshTimeoutError
    from monarch_jupyter.errors import RankAbortedError

    with _mesh(2, interrupt_grace=5.0) as mesh:
        mesh.run("marker = rank * 10; t = torch.ones(1, device=device); dist.all_reduce(t)")
        t = time.perf_counter()
        try:
            mesh.run(textwrap.dedent("""
                from torch.nn.parallel import DistributedDataParallel as DDP
                torch.manual_seed(0)
                ddp = DDP(torch.nn.Linear(64, 1).to(device), device_ids=[device])
                for step in range(5):
                    if rank == 1 and step == 1:
                        raise RuntimeError("raised before forward at step 1")
                    ddp(torch.ones(8, 64, device=device)).sum().backward()
                torch.cuda.synchronize()
                """), timeout=90)
        except MeshError as e:
            err = e
        else:
            raise AssertionError("rank 1 raised but the cell did not fail")
        took = time.perf_counter() - t
        assert not isinstance(err, MeshTimeoutError), "rank 0 was never released"
        assert list(err.errors)[0] == 1, f"root cause is not the raising rank: {list(err.errors)}"
        released = err.errors.get(0)
        assert isinstance(released, RankAbortedError), repr(released)
        detail(f"rank 1 raised; rank 0 released from {released.collective} in {took:.2f} s (cell start to error)")
        total = mesh.run("t = torch.ones(1, device=device); dist.all_reduce(t); float(t[0]), marker")
        assert total == {0: (2.0, 0), 1: (2.0, 10)}, total


BODIES: dict[str, Callable[[], None]] = {f.__name__: f for f in (
    cuda_then_start, nccl_one_rank, dashboard_cuda, lightning_gpu, ddp_vs_torchrun, hang_force, nccl_two_ranks,
    hang_force_two, raise_release_nccl, busbw_vs_torchrun)}


def run(name: str) -> int:
    """Run the check ``name`` here: 0 passed, SKIP_CODE skipped (a ``SKIP why`` line), 1 failed (traceback)."""
    body = BODIES.get(name)
    if body is None:
        print(f"no check named {name!r}; known: {', '.join(BODIES)}")
        return 2
    try:
        if _gpus() == 0:
            skip("no CUDA device")
        body()
    except Skipped as e:
        print(f"SKIP {e}", flush=True)
        return SKIP_CODE
    except BaseException:  # noqa: BLE001 (a check reports every failure, KeyboardInterrupt included)
        traceback.print_exc(file=sys.stdout)
        return 1
    return 0


__all__ = ["BODIES", "run"]
