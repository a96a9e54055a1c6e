"""Faults: how fast a failure reaches the notebook, how fast the mesh is back, and what is left behind; against
peers measured in the same run.

    python bench/bench_faults.py [--n 4] [--repeat 3] [--no-peers] [--no-kernel] [--ddp-only] [--json PATH]

Figures (seconds; medians of --repeat runs; wall clock on a shared machine, so noisy):
- death detection: a rank prints time.time() and dies (os._exit, SIGKILL of itself, a segfault) while the other
  ranks sleep; from that time to the cell raising MeshError in the caller;
- lost-rank detection: SIGSTOP of a rank during a cell, to the cell raising, with heartbeat_timeout = 2 s;
- interrupt to prompt: SIGINT to the controller while every rank sleeps in a cell, to KeyboardInterrupt in the
  caller (Python API); and through a real kernel, km.interrupt_kernel() to the execute_reply of a %%mesh cell,
  next to the same for a plain `time.sleep` cell (ipykernel's own share);
- interrupt during start: SIGINT 0.3 s into Mesh(n), to the exception, and rank processes left;
- restart: mesh.restart() (every rank fresh) and mesh.restart(ranks=1) after rank 1 died (a fresh process for
  rank 1, the others keep their state and regroup);
- orphans: rank and fork-server processes alive 5 s after SIGKILL of a kernel that runs a mesh;
- rank raises inside DDP: a torchrun script (DDP forward and backward) in which rank 1 raises at step 1 while the
  others go on into DDP's next collective; from the raise (the rank prints time.time()) to the cell's MeshError
  (`%mesh run` on a running mesh), against the same script under `torchrun --nproc-per-node N` (to torchrun's
  exit with status 1), measured in the same run; and each one's whole run (torchrun's includes its start-up).
Peers, live: ipyparallel (engine death detection: SIGKILL of an engine running a task, to the task failing;
whether the engine comes back; a blocking call interrupted by SIGINT; processes left 5 s after SIGKILL of the
process that started the cluster); torchmonarch when MJ_TORCHMONARCH_PYTHON names an interpreter that has it
(SIGKILL of a proc running an endpoint, to the call failing; see bench/peers.py). accelerate's
notebook_launcher interrupted during rendezvous takes ~30 s to return (earlier measurement, quoted, not rerun:
it costs 30 s).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import peers  # noqa: E402  (bench/peers.py)
from figures import add_json_option, write_json  # noqa: E402  (bench/figures.py)

ACCELERATE_INTERRUPT_S = 30.0  # earlier measurement: notebook_launcher interrupted during rendezvous

DEATHS = {
    "os._exit": "os._exit(3)",
    "SIGKILL": "os.kill(os.getpid(), signal.SIGKILL)",
    "segfault": "ctypes.string_at(0)",
}


def _alive(pid: int) -> bool:
    return peers._alive(pid)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _sigint_after(delay: float, stamp: list[float]) -> threading.Timer:
    def fire() -> None:
        stamp.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGINT)

    t = threading.Timer(delay, fire)
    t.start()
    return t


# --------------------------------------------------------------------------------------------- ours (API)


def ours_api(n: int, repeat: int) -> dict[str, Any]:
    from monarch_jupyter import Mesh, MeshError

    res: dict[str, Any] = {}
    mesh = Mesh(n, start_timeout=120)
    try:
        mesh.run("import ctypes, os, signal, time")
        for how, die in DEATHS.items():
            detect, restart = [], []
            for _ in range(repeat):
                code = f"import ctypes, os, signal, time\nif rank == 1:\n    time.sleep(0.2)\n" \
                       f"    print('T', repr(time.time()), flush=True)\n    {die}\ntime.sleep(600)\n"
                try:
                    mesh.run(code)
                    raise AssertionError("the cell did not fail")
                except MeshError as e:
                    now = time.time()
                    stamp = next(line for line in e.errors[1].last_output.splitlines() if line.startswith("T "))
                    detect.append(now - float(stamp.split()[1]))
                t0 = time.perf_counter()
                mesh.restart(ranks=1)
                restart.append(time.perf_counter() - t0)
            res[f"death_{how}_s"] = _median(detect)
            res.setdefault("restart_rank_s", []).extend(restart)
        res["restart_rank_s"] = _median(res["restart_rank_s"])

        lost = []
        for _ in range(repeat):
            pid = mesh.status()[1]["pid"]
            stopped: list[float] = []
            threading.Timer(0.5, lambda stopped=stopped, pid=pid: (stopped.append(time.perf_counter()),
                                                             os.kill(pid, signal.SIGSTOP))).start()
            mesh.heartbeat_timeout = 2.0  # the controller's window, for this cell only
            try:
                mesh.run("import time\ntime.sleep(600)")
            except MeshError:
                lost.append(time.perf_counter() - stopped[0])
            finally:
                mesh.heartbeat_timeout = 30.0
            mesh.restart(ranks=1)
        res["lost_sigstop_2s_window_s"] = _median(lost)

        intr = []
        for _ in range(repeat):
            stamp: list[float] = []
            _sigint_after(0.5, stamp)
            try:
                mesh.run("import time\ntime.sleep(600)")
            except KeyboardInterrupt:
                intr.append(time.perf_counter() - stamp[0])
        res["interrupt_api_s"] = _median(intr)
        assert mesh.run("1") == dict.fromkeys(range(n), 1)

        full = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            mesh.restart()
            full.append(time.perf_counter() - t0)
        res["restart_full_s"] = _median(full)
    finally:
        mesh.stop()

    # Interrupt while the mesh starts (the rendezvous): how long until the caller has its prompt back.
    from monarch_jupyter.kernel.launch import local as launcher

    zygote = launcher.ForkServer.get(60).proc.pid
    during = []
    for _ in range(repeat):
        stamp: list[float] = []
        m = Mesh(n, start_timeout=120, start=False)

        def first_ready(kind: str, data: dict, stamp: list[float] = stamp) -> None:
            # The first rank joined: the others are still in the rendezvous.
            if kind == "rank_state" and data.get("state") == "idle" and not stamp:
                stamp.append(time.perf_counter())
                os.kill(os.getpid(), signal.SIGINT)

        m.add_listener(first_ready)
        try:
            m.start()
            time.sleep(1.0)  # the signal lands here when the start won the race: not counted
            m.stop()
        except KeyboardInterrupt:
            if not m.running:
                during.append(time.perf_counter() - stamp[0])
            else:
                m.stop()
    res["interrupt_during_start_s"] = _median(during)
    time.sleep(0.5)
    res["ranks_left_after_interrupted_start"] = len(_children(zygote))
    return res


DDP_SCRIPT = """
import argparse, sys, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=-1)
args = parser.parse_args()
dist.init_process_group("gloo")
torch.manual_seed(0)
ddp = DDP(torch.nn.Linear(64, 1))
for step in range(20):
    if dist.get_rank() == args.fail_rank and step == 1:
        print("T", repr(time.time()), flush=True)
        raise RuntimeError(f"rank {args.fail_rank} fails at step {step}")
    ddp(torch.ones(8, 64)).sum().backward()
dist.destroy_process_group()
"""


def _raised_at(text: str) -> float:
    for line in text.splitlines():
        if "T " in line and line.split("T ", 1)[1].strip().replace(".", "", 1).isdigit():
            return float(line.split("T ", 1)[1])
    raise RuntimeError(f"no time stamp in the output: {text[-2000:]}")


def ddp_raise(n: int, repeat: int) -> dict[str, Any]:
    """Rank 1 raises inside a DDP loop: raise -> error, on the mesh (``%mesh run``) and under torchrun."""
    from monarch_jupyter import Mesh, MeshError

    res: dict[str, Any] = {}
    folder = tempfile.mkdtemp(prefix="bench-ddp-")
    script = os.path.join(folder, "myddp.py")
    with open(script, "w") as f:
        f.write(DDP_SCRIPT)
    mesh = Mesh(n, start_timeout=120)
    seen: list[str] = []
    mesh.add_listener(lambda kind, data: seen.append(data["text"]) if kind == "output" else None)
    ours, ours_total = [], []
    try:
        for _ in range(repeat):
            seen.clear()
            t0 = time.time()
            try:
                mesh.run_script(script, "--fail-rank", "1", timeout=300)
            except MeshError:
                end = time.time()
            else:
                raise RuntimeError("the script did not fail")
            mesh.events.flush()
            ours.append(end - _raised_at("\n".join(seen)))
            ours_total.append(end - t0)
    finally:
        mesh.stop()
    theirs, theirs_total, codes = [], [], set()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_"))}
    for _ in range(repeat):
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(n), script, "--fail-rank", "1"], capture_output=True, text=True, env=env,
                              timeout=600)
        end = time.time()
        codes.add(proc.returncode)
        theirs.append(end - _raised_at(proc.stdout + proc.stderr))
        theirs_total.append(end - t0)
    res["ddp_raise_ours_s"] = _median(ours)
    res["ddp_raise_ours_total_s"] = _median(ours_total)
    res["ddp_raise_torchrun_s"] = _median(theirs)
    res["ddp_raise_torchrun_total_s"] = _median(theirs_total)
    res["ddp_raise_torchrun_exit"] = ",".join(str(c) for c in sorted(codes))
    return res


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid and fields[0] != "Z":
                    out.append(int(entry))
            except OSError:
                pass
    return out


# --------------------------------------------------------------------------------------------- ours (kernel)


def _execute(kc: Any, code: str, on_stream: Any = None, timeout: float = 120) -> dict:
    msg_id = kc.execute(code)
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream" and on_stream is not None:
            on_stream(msg["content"]["text"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    while True:
        reply = kc.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]


def ours_kernel(n: int, repeat: int) -> dict[str, Any]:
    from jupyter_client.manager import start_new_kernel

    res: dict[str, Any] = {}
    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=120, env=dict(os.environ))
    try:
        assert _execute(kc, f"%load_ext monarch_jupyter\nm = %mesh start -n {n}")["status"] == "ok"
        for key, code in (("interrupt_kernel_plain_cell_s", "import time\nprint('go', flush=True)\ntime.sleep(600)"),
                          ("interrupt_kernel_mesh_cell_s", "%%mesh\nimport time\nprint('go', flush=True)\n"
                                                           "time.sleep(600)")):
            times = []
            for _ in range(repeat):
                sent: list[float] = []

                def fire(text: str, sent: list[float] = sent) -> None:
                    if "go" in text and not sent:
                        sent.append(time.perf_counter())
                        km.interrupt_kernel()

                reply = _execute(kc, code, on_stream=fire)
                assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
                times.append(time.perf_counter() - sent[0])
            res[key] = _median(times)
        out: list[str] = []
        _execute(kc, "import json\nfrom monarch_jupyter.kernel.launch import local as _l\n"
                     "print(json.dumps([s['pid'] for s in m.status().values()] + [_l.fork_server_pid()]))",
                 on_stream=out.append)
        pids = json.loads("".join(out).strip().splitlines()[-1])
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
        t0 = time.perf_counter()
        while any(_alive(p) for p in pids) and time.perf_counter() - t0 < 5:
            time.sleep(0.01)
        res["orphans_after_kernel_sigkill"] = sum(_alive(p) for p in pids)
        res["kernel_sigkill_to_no_rank_s"] = time.perf_counter() - t0
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)
    return res


# --------------------------------------------------------------------------------------------- peers


def _sleep_then(seconds: float, value: int) -> int:
    import time  # sent by value when this file runs as a script: bring its own import

    time.sleep(seconds)
    return value


def ipyparallel_faults(n: int) -> dict[str, Any]:
    """Engine death detection, restart, interrupt of a blocking call, and orphans (ipyparallel)."""
    res: dict[str, Any] = {}
    # Engines unpickle peers' functions by reference: let them import bench/peers.py.
    here = os.path.dirname(os.path.abspath(__file__))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, saved) if p)
    try:
        cluster, rc, _ = peers._ipp_start(n)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    pids = set()
    try:
        pids = peers._ipp_pids(cluster, rc)
        # A blocking call interrupted by SIGINT: does the caller get its prompt back, do engines stop?
        view = rc[rc.ids[0]]
        stamp: list[float] = []
        _sigint_after(0.5, stamp)
        try:
            got = view.apply_sync(_sleep_then, 3.0, 42)
            res["interrupt_blocking_call"] = ("returned 42: ran to the end" if got == 42 else
                                              f"returned {type(got).__name__} at once (Ctrl-C swallowed); "
                                              "the engine runs on")
        except KeyboardInterrupt:
            res["interrupt_blocking_call"] = "KeyboardInterrupt"
        res["interrupt_blocking_call_s"] = time.perf_counter() - stamp[0]
        rc.wait(timeout=10)

        # An engine dies while it runs a task.
        engine_pids = rc[:].apply_sync(os.getpid)
        ars = [rc[i].apply_async(time.sleep, 30) for i in rc.ids]
        time.sleep(1.0)
        t0 = time.perf_counter()
        os.kill(engine_pids[1], signal.SIGKILL)
        while not ars[1].ready() and time.perf_counter() - t0 < 60:
            time.sleep(0.005)
        res["death_detection_s"] = time.perf_counter() - t0
        try:
            ars[1].get(0)
        except Exception as e:  # noqa: BLE001 - ipyparallel's EngineError
            res["death_error"] = type(e).__name__
        time.sleep(3.0)
        res["engines_after_death"] = f"{len(rc.ids)} of {n} (no restart)" if len(rc.ids) < n else f"{len(rc.ids)}"
    finally:
        try:
            rc.close()
            stopper = threading.Thread(target=cluster.stop_cluster_sync, daemon=True)
            stopper.start()
            stopper.join(20)  # it can wait forever on the engine we killed
        finally:
            peers._kill_pids(pids, grace=3)

    # Kill the process that started the cluster: what is left?
    child = textwrap.dedent(f"""\
        import json, os, sys, time
        sys.path.insert(0, {here!r})
        os.environ["PYTHONPATH"] = {here!r}  # engines unpickle peers' functions by reference
        import peers
        cluster, rc, _ = peers._ipp_start({n})
        print("PIDS", json.dumps(sorted(peers._ipp_pids(cluster, rc))), flush=True)
        time.sleep(600)
        """)
    with tempfile.TemporaryDirectory(prefix="peers_") as cwd:
        proc = subprocess.Popen([sys.executable, "-c", child], cwd=cwd, stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
        left: list[int] = []
        try:
            line = ""
            while not line.startswith("PIDS"):
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError("the ipyparallel child did not start its cluster")
            cpids = [p for p in json.loads(line[5:]) if p != proc.pid]
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            time.sleep(5.0)
            left = [p for p in cpids if _alive(p)]
            res["orphans_after_client_sigkill"] = f"{len(left)} of {len(cpids)}"
        finally:
            peers._kill_pids(set(left) | peers._session_pids(proc.pid), grace=0)
    return res


_MONARCH_DEATH = r"""
import json, os, signal, time
from monarch.actor import Actor, endpoint, this_host
class Sleeper(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()
    @endpoint
    def sleep(self, s: float) -> int:
        time.sleep(s)
        return 0
procs = this_host().spawn_procs(per_host={"procs": __N__})
actors = procs.spawn("sleepers", Sleeper)
pids = sorted(v for _, v in actors.pid.call().get())
fut = actors.sleep.call(30)
time.sleep(1.0)
t0 = time.perf_counter()
os.kill(pids[1], signal.SIGKILL)
err = ""
try:
    fut.get()
except BaseException as e:  # torchmonarch 0.7 raises KeyboardInterrupt here ("unhandled monarch error")
    err = type(e).__name__
print("__MARK__" + json.dumps(dict(death_detection_s=time.perf_counter() - t0, error=err)), flush=True)
os._exit(0)
"""


def torchmonarch_faults(n: int) -> tuple[dict | None, str]:
    python = os.environ.get("MJ_TORCHMONARCH_PYTHON")
    if not python:
        return None, "set MJ_TORCHMONARCH_PYTHON to an interpreter with torchmonarch (see bench/peers.py)"
    code = _MONARCH_DEATH.replace("__N__", str(n)).replace("__MARK__", peers._MARK)
    saved = os.environ.pop("PYTHONPATH", None)  # our `monarch` shim must not shadow torchmonarch's package
    try:
        return peers._run_child(code, 150, python), ""
    except RuntimeError as e:
        return None, str(e).strip().splitlines()[-1][:200]
    finally:
        if saved is not None:
            os.environ["PYTHONPATH"] = saved


# --------------------------------------------------------------------------------------------- main


def _row(name: str, value: Any, note: str = "") -> None:
    v = f"{value:8.3f} s" if isinstance(value, float) else f"{value!s:>10}"
    print(f"  {name:<52}{v}  {note}")


def _ddp_rows(ddp: dict[str, Any]) -> None:
    _row("rank raises inside DDP: raise -> cell's MeshError", ddp["ddp_raise_ours_s"],
         f"torchrun (raise -> exit {ddp['ddp_raise_torchrun_exit']}): {ddp['ddp_raise_torchrun_s']:.3f} s; "
         f"ours is {ddp['ddp_raise_torchrun_s'] / ddp['ddp_raise_ours_s']:.1f}x faster")
    _row("rank raises inside DDP: whole %mesh run", ddp["ddp_raise_ours_total_s"],
         f"whole torchrun run (with its start-up): {ddp['ddp_raise_torchrun_total_s']:.3f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4, help="ranks")
    ap.add_argument("--repeat", type=int, default=3, help="runs per figure (median)")
    ap.add_argument("--no-peers", action="store_true", help="skip ipyparallel and torchmonarch")
    ap.add_argument("--no-kernel", action="store_true", help="skip the real-kernel figures")
    ap.add_argument("--ddp-only", action="store_true", help="only the figures of a rank raising inside DDP")
    add_json_option(ap)
    args = ap.parse_args()
    n = args.n
    params = {"n": n, "repeat": args.repeat, "peers": not args.no_peers, "kernel": not args.no_kernel,
              "ddp_only": args.ddp_only}

    ddp = ddp_raise(n, args.repeat)
    if args.ddp_only:
        _ddp_rows(ddp)
        write_json(args.json, "bench_faults", {"ddp": ddp}, **params)
        return
    api = ours_api(n, args.repeat)
    kern = {} if args.no_kernel else ours_kernel(n, args.repeat)
    ipp: dict[str, Any] = {}
    tm: dict | None = None
    tm_reason = "skipped (--no-peers)"
    if not args.no_peers:
        try:
            ipp = ipyparallel_faults(n)
        except peers.PeerUnavailable as e:
            ipp = {"skipped": str(e)}
        tm, tm_reason = torchmonarch_faults(n)

    row = _row
    print(f"monarch_jupyter fault benchmark: {n} ranks, {os.cpu_count()} CPUs, python {sys.version.split()[0]}, "
          f"median of {args.repeat}")
    best = min(api[f"death_{h}_s"] for h in DEATHS)
    for how in DEATHS:
        row(f"death detection, {how} (exit -> cell raises)", api[f"death_{how}_s"])
    row("lost rank, SIGSTOP -> cell raises (heartbeat 2 s)", api["lost_sigstop_2s_window_s"])
    row("interrupt -> prompt (Python API)", api["interrupt_api_s"])
    if kern:
        row("interrupt -> execute_reply, plain time.sleep cell", kern["interrupt_kernel_plain_cell_s"],
            "(ipykernel's own share)")
        row("interrupt -> execute_reply, %%mesh cell", kern["interrupt_kernel_mesh_cell_s"])
    row("interrupt during start (rendezvous) -> exception", api["interrupt_during_start_s"],
        f"ranks left: {api['ranks_left_after_interrupted_start']};  accelerate ~{ACCELERATE_INTERRUPT_S:g} s "
        f"(earlier): {ACCELERATE_INTERRUPT_S / api['interrupt_during_start_s']:.0f}x")
    row("restart of one dead rank (restart --rank)", api["restart_rank_s"])
    row("restart of the whole mesh", api["restart_full_s"])
    _ddp_rows(ddp)
    if kern:
        row("rank processes left 5 s after kernel SIGKILL", kern["orphans_after_kernel_sigkill"],
            f"(all gone {kern['kernel_sigkill_to_no_rank_s']:.3f} s after the SIGKILL)")
    if ipp and "skipped" not in ipp:
        row("ipyparallel: engine death detection", ipp["death_detection_s"],
            f"{ipp.get('death_error', '')}; ours is {ipp['death_detection_s'] / best:.1f}x faster")
        row("ipyparallel: engines after a death", ipp["engines_after_death"], "(ours: restart --rank)")
        row("ipyparallel: SIGINT during a blocking call", ipp["interrupt_blocking_call_s"],
            f"{ipp['interrupt_blocking_call']}")
        row("ipyparallel: processes left 5 s after client SIGKILL", ipp["orphans_after_client_sigkill"])
    elif ipp:
        print(f"  ipyparallel: {ipp['skipped']}")
    if tm is not None:
        row("torchmonarch: proc SIGKILL -> call fails", tm["death_detection_s"],
            f"{tm.get('error', '')}; ours is {tm['death_detection_s'] / best:.0f}x faster")
    else:
        print(f"  torchmonarch: {tm_reason} (earlier measurement: ~10 s to report a crashed process)")
    write_json(args.json, "bench_faults", {"api": api, "kernel": kern, "ddp": ddp, "ipyparallel": ipp,
                                           "torchmonarch": tm if tm is not None else {"skipped": tm_reason}},
               **params)


if __name__ == "__main__":
    main()
