"""Peer-side benchmarks for monarch_jupyter: physical references and peer systems.

Every number is wall-clock **seconds** (float); sizes are **bytes**.  Peer functions
clean up every process they start: children run in their own session and anything
left in that session is killed by pid; ipyparallel engines/controller are tracked
by pid and killed if they survive ``stop_cluster``.

Peers on this box (Python 3.11.7, 2 cores, CPU-only torch 2.13.0+cpu):
  * ipyparallel 9.2.0 -- already installed.
  * torchmonarch -- ``pip install torchmonarch`` installs 0.7.0 and runs CPU-only
    (``this_host().spawn_procs(per_host={"procs": n})``). It installs a top-level ``monarch``
    package (docs/installation.md, "The `monarch` name"), so install it in its own virtual
    environment and point MJ_TORCHMONARCH_PYTHON at that interpreter:
      python -m venv --system-site-packages /tmp/venv-tm && /tmp/venv-tm/bin/pip install torchmonarch
      MJ_TORCHMONARCH_PYTHON=/tmp/venv-tm/bin/python python bench/peers.py
    Not a project dependency; torchmonarch_ops() skips with a reason when it is absent.
  * accelerate -- ``pip install accelerate`` installs 1.15.0 (keeps torch 2.13.0+cpu).
    Not a project dependency either; skipped with a reason when absent.
NOTE: peer children run with a temporary directory as cwd, so that nothing in the checkout
shadows torchmonarch's ``monarch`` package.

Run all: ``python -m bench.peers`` (or ``python bench/peers.py``) from the repo root.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

MiB = 1 << 20
_MARK = "PEERS_JSON "
PeerResult = tuple[dict[str, float] | None, str]  # (seconds by metric, "") or (None, reason)


class PeerUnavailable(RuntimeError):
    """A peer package is missing; ``str(exc)`` is a one-line reason."""


# ----------------------------------------------------------------------------- helpers
def _bench(fn: Callable[[], object], reps: int, warmup: int = 1) -> tuple[float, float]:
    """Run ``fn`` warmup+reps times; return (first call seconds, median seconds of the reps)."""
    times = []
    for _ in range(warmup + reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[warmup:])


def _missing(dist: str) -> str | None:
    """One-line reason if distribution ``dist`` is not installed, else None."""
    try:
        importlib.metadata.version(dist)
        return None
    except importlib.metadata.PackageNotFoundError:
        return f"{dist} not installed (pip install {dist})"


def _kill_pids(pids: set[int], grace: float = 5.0) -> list[int]:
    """Wait up to ``grace`` s for ``pids`` to exit, then SIGKILL survivors; return those killed."""
    deadline = time.monotonic() + grace
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if _alive(p)}
        if alive:
            time.sleep(0.1)
    for p in alive:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return sorted(alive)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _session_pids(sid: int) -> set[int]:
    """Pids (other than ours) whose session id is ``sid``."""
    out = set()
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                if os.getsid(int(name)) == sid:
                    out.add(int(name))
            except OSError:
                pass
    return out


def _run_child(code: str, timeout: float, python: str | None = None) -> dict[str, float]:
    """Run ``python -c code`` in a new session and temp cwd; return the JSON it prints after _MARK.

    ``python`` is the interpreter (default: this one).

    Whatever is left in the child's session afterwards (e.g. peer workers) is killed by pid.
    """
    with tempfile.TemporaryDirectory(prefix="peers_") as cwd:
        proc = subprocess.Popen([python or sys.executable, "-c", code], cwd=cwd, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_pids(_session_pids(proc.pid) | {proc.pid}, grace=0)
            out, err = proc.communicate()
            raise RuntimeError(f"peer child timed out after {timeout}s: {err[-500:]}") from None
        finally:
            _kill_pids(_session_pids(proc.pid), grace=5.0)
    for line in reversed(out.splitlines()):
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    raise RuntimeError(f"peer child failed (rc={proc.returncode}): {(err or out)[-800:]}")


# ------------------------------------------------------------------- physical references
def torch_import_seconds(repeat: int = 3) -> float:
    """Median wall seconds of a fresh ``python -c "import torch"`` subprocess (interpreter start included)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True, cwd=tempfile.gettempdir())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memcpy_seconds(nbytes: int, repeat: int = 10) -> float:
    """Median seconds of one ``numpy.copyto`` of ``nbytes`` bytes into a preallocated, pre-touched array."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    return _bench(lambda: np.copyto(dst, src), repeat)[1]


# ------------------------------------------------------------------------- ipyparallel
def _engine_import_torch() -> str:
    import torch

    return torch.__version__


def _ipp_pids(cluster, rc) -> set[int]:
    """Pids of the controller, every engine, and all their descendants."""
    import psutil

    pids = {int(p) for p in rc[:].apply_sync(os.getpid)}
    if cluster.controller is not None and cluster.controller.pid:
        pids.add(int(cluster.controller.pid))
    for engine_set in cluster.engines.values():
        pids |= {int(ln.pid) for ln in getattr(engine_set, "launchers", {}).values() if ln.pid}
    for p in list(pids):
        try:
            pids |= {c.pid for c in psutil.Process(p).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    return pids


def _ipp_start(n: int):
    """Start an ipyparallel local cluster of n engines; return (cluster, client, seconds to torch-ready)."""
    try:
        import ipyparallel as ipp
    except ImportError as e:
        raise PeerUnavailable(f"ipyparallel not importable: {e}") from e
    t0 = time.perf_counter()
    cluster = ipp.Cluster(n=n, log_level=40)
    try:
        rc = cluster.start_and_connect_sync()
        versions = rc[:].apply_sync(_engine_import_torch)
        elapsed = time.perf_counter() - t0
        assert len(versions) == n, versions
    except BaseException:
        cluster.stop_cluster_sync()
        raise
    return cluster, rc, elapsed


def _ipp_stop(cluster, rc) -> None:
    pids = _ipp_pids(cluster, rc)
    try:
        rc.close()
    finally:
        cluster.stop_cluster_sync()
        killed = _kill_pids(pids)
        if killed:
            print(f"[peers] killed leftover ipyparallel pids {killed}", file=sys.stderr)


def ipyparallel_start(n: int = 4) -> float:
    """Seconds from ``ipp.Cluster(n=n).start_and_connect_sync()`` to all n engines returning ``import torch``.

    The cluster is stopped afterwards.  Raises PeerUnavailable if ipyparallel is missing.
    """
    cluster, rc, elapsed = _ipp_start(n)
    _ipp_stop(cluster, rc)
    return elapsed


def ipyparallel_ops(n: int = 4) -> dict[str, float]:
    """Median seconds of common ipyparallel operations on one cluster of n engines.

    Keys: ``execute_s`` (``view.execute("a=1")`` on all engines, i.e. ``%px a=1``, 50 runs);
    ``push_{64,256}MiB_s`` (float32 numpy array to all n engines); ``push_64MiB_first_s``
    (first push, not in the median); ``push_torch_64MiB_s`` (torch tensor to all n);
    ``scatter_64MiB_s`` / ``gather_64MiB_s`` (array split over the n engines, total 64 MiB);
    ``pull_64MiB_s`` (64 MiB from one engine).  Raises PeerUnavailable if ipyparallel is missing.
    """
    import numpy as np
    import torch

    cluster, rc, _ = _ipp_start(n)
    try:
        view = rc[:]
        view.block = True
        res: dict[str, float] = {}
        res["execute_s"] = _bench(lambda: view.execute("a=1", block=True), 50, warmup=3)[1]
        a64 = np.ones(64 * MiB // 4, dtype=np.float32)
        a256 = np.ones(256 * MiB // 4, dtype=np.float32)
        res["push_64MiB_first_s"], res["push_64MiB_s"] = _bench(
            lambda: view.push({"x": a64}, block=True), 5)
        res["push_256MiB_s"] = _bench(lambda a=a256: view.push({"x": a}, block=True), 3)[1]
        view.execute("del x", block=True)
        del a256
        t64 = torch.ones(64 * MiB // 4, dtype=torch.float32)
        res["push_torch_64MiB_s"] = _bench(lambda: view.push({"t": t64}, block=True), 3)[1]
        view.execute("del t", block=True)
        res["scatter_64MiB_s"] = _bench(lambda: view.scatter("s", a64, block=True), 5)[1]
        gathered = view.gather("s", block=True)
        assert gathered.nbytes == a64.nbytes
        res["gather_64MiB_s"] = _bench(lambda: view.gather("s", block=True), 5)[1]
        one = rc[0]
        one.push({"y": a64}, block=True)
        res["pull_64MiB_s"] = _bench(lambda: one.pull("y", block=True), 5)[1]
        return res
    finally:
        _ipp_stop(cluster, rc)


# ------------------------------------------------------------------------ torchmonarch
_MONARCH_CHILD = r"""
import json, statistics, time
t0 = time.perf_counter()
from monarch.actor import Actor, endpoint, this_host
t_import = time.perf_counter() - t0
import torch
N = __N__

class Peer(Actor):
    @endpoint
    def ready(self) -> str:
        import torch
        return torch.__version__
    @endpoint
    def ping(self) -> int:
        return 1
    @endpoint
    def take(self, x) -> int:
        return int(x.numel() * x.element_size())

def timed(f, reps):
    ts = []
    for _ in range(reps):
        s = time.perf_counter(); f(); ts.append(time.perf_counter() - s)
    return ts

t1 = time.perf_counter()
procs = this_host().spawn_procs(per_host={"procs": N})
peers = procs.spawn("peers", Peer)
assert len(list(peers.ready.call().get())) == N
spawn = time.perf_counter() - t1
ping = timed(lambda: peers.ping.call().get(), 53)[3:]
x = torch.ones(64 * 2**20 // 4, dtype=torch.float32)
def send():
    sizes = [v for _, v in peers.take.call(x).get()]
    assert sizes == [x.nbytes] * N, sizes

send = timed(send, 4)
t2 = time.perf_counter()
procs.stop().get()
stop = time.perf_counter() - t2
print("__MARK__" + json.dumps(dict(import_monarch_s=t_import, spawn_to_first_result_s=spawn,
      call_s=statistics.median(ping), send_64MiB_first_s=send[0],
      send_64MiB_s=statistics.median(send[1:]), stop_s=stop)), flush=True)
"""


def torchmonarch_ops(n: int = 4, timeout: float = 150.0) -> PeerResult:
    """torchmonarch proc mesh of n procs (in a child process); returns (seconds by metric, "") or (None, reason).

    Keys: ``import_monarch_s``; ``spawn_to_first_result_s`` (spawn_procs + spawn actors +
    an endpoint that imports torch returned on all n); ``call_s`` (median trivial endpoint
    call to all n actors, 50 runs); ``send_64MiB_first_s`` / ``send_64MiB_s`` (a 64 MiB
    torch tensor as an endpoint argument to all n actors, first and median of 3); ``stop_s``.
    """
    python = os.environ.get("MJ_TORCHMONARCH_PYTHON")
    reason = None if python else _missing("torchmonarch")
    if reason:
        return None, reason + " (or set MJ_TORCHMONARCH_PYTHON to an interpreter that has it)"
    code = _MONARCH_CHILD.replace("__N__", str(int(n))).replace("__MARK__", _MARK)
    try:
        return _run_child(code, timeout, python), ""
    except RuntimeError as e:
        if "ModuleNotFoundError" in str(e) or "ImportError" in str(e):
            return None, "torchmonarch not importable: " + str(e).strip().splitlines()[-1]
        raise


# -------------------------------------------------------------------------- accelerate
_ACCELERATE_CHILD = r"""
import json, socket, time
t0 = time.perf_counter()
import torch
import torch.distributed as dist
from accelerate import notebook_launcher
t_import = time.perf_counter() - t0
N = __N__

def fn():
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert int(t.item()) == N, t
    dist.destroy_process_group()

with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
t1 = time.perf_counter()
notebook_launcher(fn, num_processes=N, use_port=str(port))
t2 = time.perf_counter()
print("__MARK__" + json.dumps(dict(import_s=t_import, launch_to_result_s=t2 - t1,
      process_total_s=t2 - t0)), flush=True)
"""


def accelerate_notebook_launcher_start(n: int = 4, timeout: float = 150.0) -> PeerResult:
    """``accelerate.notebook_launcher(fn, num_processes=n)`` in a child process; returns (seconds, "") or
    (None, reason).

    ``fn`` = gloo ``init_process_group`` + ``all_reduce`` of one CPU float + destroy.
    Keys: ``launch_to_result_s`` (the notebook_launcher call: fork n workers, rendezvous,
    run, join; workers are not kept), ``import_s`` (torch + accelerate in the child),
    ``process_total_s`` (child start of imports to result).
    """
    reason = _missing("accelerate")
    if reason:
        return None, reason
    code = _ACCELERATE_CHILD.replace("__N__", str(int(n))).replace("__MARK__", _MARK)
    try:
        return _run_child(code, timeout), ""
    except RuntimeError as e:
        if "ModuleNotFoundError" in str(e) or "ImportError" in str(e):
            return None, "accelerate not importable: " + str(e).strip().splitlines()[-1]
        raise


# -------------------------------------------------------------------------------- main
def main(n: int = 4) -> None:
    """Run every benchmark and print a table of seconds (plus GB/s for transfers)."""
    def add(name: str, secs: float, nbytes: int = 0) -> None:
        bw = f"   {nbytes / secs / 1e9:6.2f} GB/s" if secs and nbytes else ""
        print(f"  {name:<40}{secs:9.4f} s{bw}", flush=True)

    t_all = time.perf_counter()
    print(f"peers benchmark, n={n}, {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    add("reference: python -c 'import torch'", torch_import_seconds())
    for mb in (64, 256):
        add(f"reference: memcpy {mb} MiB", memcpy_seconds(mb * MiB), mb * MiB)
    try:
        add(f"ipyparallel: start {n} engines + torch", ipyparallel_start(n))
        for k, v in ipyparallel_ops(n).items():
            size = next((int(s) * MiB for s in ("64", "256") if f"_{s}MiB" in k), 0)
            size *= n if k.startswith("push") else 1
            add(f"ipyparallel: {k}", v, size)
    except PeerUnavailable as e:
        print(f"  ipyparallel: skipped: {e}")
    for peer, fn in (("torchmonarch", torchmonarch_ops), ("accelerate", accelerate_notebook_launcher_start)):
        res, reason = fn(n)
        if res is None:
            print(f"  {peer}: skipped: {reason}")
            continue
        for k, v in res.items():
            size = 64 * MiB * (n if k.startswith("send") else 0)
            add(f"{peer}: {k}", v, size)
    print(f"total benchmark wall time: {time.perf_counter() - t_all:.1f} s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
