"""Training that survives: goodput under failures on a self-healing mesh with torchft, against torchrun's restart
from a checkpoint and against a run with no failure, measured in one run.

    python bench/bench_elastic.py [--n 4] [--steps 1500] [--every 4 10] [--checkpoint-every 20] [--scale-only]
                                  [--no-scale] [--json PATH]

A small DDP model (an MLP, the same data at each step on every run: batches seeded by the step) trains for a fixed
number of steps, while a "punisher" (torchft's pattern) SIGKILLs one random rank every ``--every`` seconds (each
interval given is one run of each; the goal is a goodput of at least ``GOAL`` of the failure-free run's):

- **mesh + torchft**: ``Mesh(n, on_rank_death="restart", torchft=True)``; the loop is torchft's (Manager, its DDP
  and Optimizer wrappers) in a ``--rejoin`` cell; a killed rank is restarted by the fork server, rejoins the cell and
  heals from a live peer (no checkpoint);
- **torchrun --max-restarts**: the same loop with torch's DDP under ``torchrun --nproc-per-node n --max-restarts
  100``; rank 0 writes a checkpoint (model, optimizer, step) every ``--checkpoint-every`` steps, and every
  restart of the workers (torchrun restarts them all) loads it. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torch's
  own opt-out): by default torchrun's workers share the rendezvous' TCPStore across restarts, and the restarted
  workers read the gloo addresses the killed attempt left there ("Gloo connectFullMesh failed ... Connection
  refused" to the dead workers' ports), fail, and after a few restarts hang; measured here with 4 CPU workers and a
  kill every 4 s: no recovery within 60 s of the first kill with the shared store, 600 steps through 20 kills
  without it;
- **no failure**: the mesh + torchft run with no punisher.

Printed: steps per second of each (from its first training step: neither the mesh's start nor torchrun's first start
is counted; torchrun's restarts are) and the fraction of the failure-free run's; for the mesh, the time from each
death to the first committed step with the replacement in the quorum; the final loss of each run on a fixed batch;
whether the mesh's replicas end with bitwise-equal weights. GPUs: with one CUDA device per rank the model runs on
cuda:LOCAL_RANK and torchft's ProcessGroupNCCL carries the gradients (``--cpu`` keeps the CPU).

Also (first, and alone with ``--scale-only``): ``mesh.scale`` 4 -> 6 -> 3 on a live mesh (CPU ranks), of local ranks
and of ranks behind a host agent (``--launcher torchrun``: the agent forks the new ranks): the seconds of each step
against a fresh mesh of that size, whether the ranks that stayed kept their namespaces, the new ranks got the
replayed model, and every rank is in a process group of the new size.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

MODEL = """
import os, time, torch
torch.manual_seed(0)
DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if CUDA else torch.device("cpu")
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 16)).to(DEVICE)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(128, 256, generator=g)
    return x.to(DEVICE), (x[:, :16] * 0.5).to(DEVICE)

def final_loss(m):
    x, y = batch(10 ** 6)
    with torch.no_grad():
        return float(((m(x) - y) ** 2).mean())
"""

# The mesh's loop: torchft's, in a --rejoin cell. Each commit is logged (time, step, participants) to a file per rank,
# appended across restarts (metrics only: the state itself travels from peer to peer).
FT_LOOP = """
from monarch_worker import ft
from torchft import Optimizer, ProcessGroupNCCL
manager = ft.manager(ProcessGroupNCCL() if CUDA else None, timeout=FT_TIMEOUT,
                     state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
                     load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["opt"])))
ddp, optim = ft.DistributedDataParallel(manager, model), Optimizer(manager, opt)
log = open(f"{LOG}.{rank}", "a")
while manager.current_step() < STEPS:
    step = manager.current_step()
    x, y = batch(step)
    optim.zero_grad()
    ((ddp(x) - y) ** 2).mean().backward()
    optim.step()
    if manager.current_step() > step:
        log.write(f"{time.time()} {manager.current_step() - 1} {manager.num_participants()} {os.getpid()}\\n")
        log.flush()
manager.shutdown()
final_loss(model)
"""

TORCHRUN_SCRIPT = """
import os, sys, time, torch, torch.distributed as dist
CUDA = {cuda}
STEPS, EVERY, CKPT, LOG = {steps}, {every}, {ckpt!r}, {log!r}
""" + MODEL + """
dist.init_process_group("nccl" if CUDA else "gloo")
rank = dist.get_rank()
ddp = torch.nn.parallel.DistributedDataParallel(model)
start = 0
if os.path.exists(CKPT):
    state = torch.load(CKPT, weights_only=False)
    model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); start = state["step"]
with open(f"{{LOG}}.pids", "a") as f:
    f.write(f"{{os.getpid()}} {{time.time()}}\\n")
for step in range(start, STEPS):
    x, y = batch(step)
    opt.zero_grad()
    ((ddp(x) - y) ** 2).mean().backward()
    opt.step()
    if rank == 0 and (step + 1) % EVERY == 0:
        torch.save({{"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}}, CKPT + ".tmp")
        os.replace(CKPT + ".tmp", CKPT)
if rank == 0:
    with open(f"{{LOG}}.loss", "w") as f:
        f.write(str(final_loss(model)))
dist.destroy_process_group()
"""


#: Seconds torchft's Manager gives a collective (monarch_worker.ft.manager's ``timeout``): the bound on a survivor's
#: wait in an allreduce with a dead peer; with ft.manager aborting a failed rank's group, survivors fail within 0.05 s
#: when traced (docs/fault_tolerance.md).
FT_TIMEOUT = 5.0
#: The goodput goal: steps per second under failures, as a fraction of the failure-free run's.
GOAL = 0.9


class Punisher:
    """Kills one random process of ``pids()`` every ``every`` seconds (SIGKILL) until stopped; records when and
    which."""

    def __init__(self, pids: object, every: float, seed: int = 1) -> None:
        self.pids, self.every = pids, every
        self.kills: list[tuple[float, int, int]] = []  # (time, index, pid)
        self._stop = threading.Event()
        self._random = random.Random(seed)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            pids = self.pids()  # type: ignore[operator]
            if not pids:
                continue
            index = self._random.randrange(len(pids))
            try:
                os.kill(pids[index], signal.SIGKILL)
                self.kills.append((time.time(), index, pids[index]))
            except ProcessLookupError:
                pass


def run_mesh(n: int, steps: int, every: float | None, cuda: bool, folder: str) -> dict:
    """The torchft loop on a self-healing mesh, with a punisher killing ranks every ``every`` seconds (None: none)."""
    from monarch_jupyter import Mesh

    log = os.path.join(folder, f"mesh-{'fail' if every else 'clean'}")
    with Mesh(n, on_rank_death="restart", restart_limit=10 ** 6, torchft=True, oversubscribe=True,
              start_timeout=300) as m:
        m.push(CUDA=cuda, STEPS=steps, LOG=log, FT_TIMEOUT=FT_TIMEOUT)
        m.run(MODEL, replay=True)
        t0 = time.time()
        handle = m.run(FT_LOOP, rejoin=True, block=False)
        punisher = Punisher(lambda: [s["pid"] for s in m.status().values() if s["state"] == "running"], every or 0)
        if every:
            punisher.start()
        while not handle.done():  # the punisher stops before the last steps so that every rank ends in the quorum
            time.sleep(0.2)
            if every and _max_step(log, n) >= steps - 20:
                punisher.stop()
                every = None
        losses = handle.result()
        seconds = time.time() - t0
        if every:
            punisher.stop()
        weights = m.pull("model")
    first = weights[0].state_dict()
    equal = all(all(first[k].cpu().equal(w.state_dict()[k].cpu()) for k in first) for w in weights.values())
    return {"seconds": seconds, "steps_per_s": steps / seconds, "loss": losses[0], "equal": equal,
            "kills": len(punisher.kills), "recovery": _recoveries(log, n, punisher.kills)}


def _commits(log: str, n: int) -> list[list[tuple[float, int, int, int]]]:
    out = []
    for r in range(n):
        try:
            with open(f"{log}.{r}") as f:
                out.append([(float(t), int(s), int(p), int(pid)) for t, s, p, pid in (ln.split() for ln in f)])
        except FileNotFoundError:
            out.append([])
    return out


def _max_step(log: str, n: int) -> int:
    return max((c[-1][1] for c in _commits(log, n) if c), default=0)


def _recoveries(log: str, n: int, kills: list[tuple[float, int, int]]) -> list[float]:
    """Seconds from each death to the first step the victim's replacement committed with every rank in the
    quorum."""
    commits = _commits(log, n)
    out = []
    for when, rank, pid in kills:
        after = [t for t, _, participants, p in commits[rank] if t > when and p != pid and participants == n]
        if after:
            out.append(after[0] - when)
    return out


def run_torchrun(n: int, steps: int, every: float | None, checkpoint_every: int, cuda: bool, folder: str,
                 stall: float = 120.0) -> dict:
    """The same loop with torch's DDP under torchrun --max-restarts, from a checkpoint every ``checkpoint_every``
    steps. A run whose checkpoint step and live workers stay the same for ``stall`` seconds is killed and reported
    as stalled (restarted workers that hang in the re-rendezvous)."""
    log, ckpt = os.path.join(folder, "torchrun"), os.path.join(folder, "ckpt.pt")
    script = os.path.join(folder, "train.py")
    with open(script, "w") as f:
        f.write(TORCHRUN_SCRIPT.format(cuda=cuda, steps=steps, every=checkpoint_every, ckpt=ckpt, log=log))
    # A fresh store per restart (module docstring): the shared one keeps the killed attempt's gloo addresses.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                             "--max-restarts", "100", "--standalone",
                             script], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)

    def workers() -> list[int]:
        try:
            with open(f"{log}.pids") as f:
                pids = [int(line.split()[0]) for line in f]
        except FileNotFoundError:
            return []
        return [p for p in pids[-n:] if _alive(p)] if len(pids) >= n else []

    punisher = Punisher(workers, every or 0)
    if every:
        punisher.start()
    progress, moved = None, time.time()
    while proc.poll() is None:
        time.sleep(0.2)
        step = _ckpt_step(ckpt) if os.path.exists(ckpt) else 0
        if every and step >= steps - 2 * checkpoint_every:
            punisher.stop()
            every = None
        now = (step, len(workers()))
        if now != progress:
            progress, moved = now, time.time()
        elif time.time() - moved > stall:  # restarted workers that never train again (a hung re-rendezvous)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if every:
                punisher.stop()
            return {"seconds": None, "steps_per_s": 0.0, "loss": None, "kills": len(punisher.kills),
                    "returncode": proc.returncode, "stalled": stall, "last_checkpoint_step": step}
    if every:
        punisher.stop()
    with open(f"{log}.pids") as f:  # from its first training step: torchrun's own start-up is not counted
        started = min(float(line.split()[1]) for line in f)
    seconds = time.time() - max(t0, started)
    with open(f"{log}.loss") as f:
        loss = float(f.read())
    return {"seconds": seconds, "steps_per_s": steps / seconds, "loss": loss, "kills": len(punisher.kills),
            "returncode": proc.returncode, "stalled": None}


def _ckpt_step(path: str) -> int:
    import torch

    try:
        return int(torch.load(path, weights_only=False)["step"])
    except Exception:  # noqa: BLE001 - being written
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


SCALE_STEPS = (6, 3)  # %mesh scale from --n (4): 4 -> 6 -> 3


def run_scale(n: int, launcher: str = "local") -> dict:
    """``mesh.scale`` 4 -> 6 -> 3 on a live self-healing mesh: seconds of each step, whether the ranks that stayed kept
    their namespaces (a value only a non-replayed cell made, and the process id) and the new ranks got the model (a
    ``--replay`` cell), and a collective of the new size. Reference in the same run: a full restart at each size
    (fresh processes, namespaces lost). ``launcher``: "local" (the fork server) or "torchrun" (one host agent under
    torchrun forks the ranks, and the new ones: scale through a host agent)."""
    from monarch_jupyter import Mesh

    out: dict = {"launcher": launcher, "steps": [], "restart_s": []}
    with Mesh(n, launcher=launcher, on_rank_death="restart", start_timeout=300) as m:
        m.push(CUDA=False)
        m.run(MODEL, replay=True)
        m.run("import os\nmine = (rank, os.getpid())")
        before = m.run("mine")
        size = n
        for target in SCALE_STEPS:
            t0 = time.perf_counter()
            report = m.scale(target)
            seconds = time.perf_counter() - t0
            check = m.run("import os\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                          "(globals().get('mine'), t.item(), int(os.environ['WORLD_SIZE']), 'model' in globals())")
            kept = all(check[r][0] == before[r] for r in range(min(size, target)))
            new_ok = all(check[r][3] and check[r][0] is None for r in range(size, target))
            group_ok = all(v[1:3] == (float(target), target) for v in check.values())
            out["steps"].append({"from": size, "to": target, "seconds": seconds, "kept": kept,
                                 "new_ranks_got_model": new_ok, "group_of_new_size": group_ok, "text": report.text})
            size = target
        for target in SCALE_STEPS:  # the reference: a fresh mesh of that size (what was possible before)
            m.stop()
            t0 = time.perf_counter()
            with Mesh(target, launcher=launcher, start_timeout=300) as fresh:
                fresh.run("t = torch.ones(1)\ndist.all_reduce(t)")
                out["restart_s"].append(time.perf_counter() - t0)
    return out


def print_scale(scale: dict) -> None:
    where = " (host agent)" if scale.get("launcher") == "torchrun" else ""
    for step, ref in zip(scale["steps"], scale["restart_s"], strict=True):
        print(f"  %mesh scale{where} {step['from']} -> {step['to']}: {step['seconds']:.2f} s (a fresh mesh of "
              f"{step['to']}: {ref:.2f} s, {step['seconds'] / ref:.2f}x)  namespaces kept: {step['kept']}  new ranks "
              f"got the replayed model: {step['new_ranks_got_model']}  process group of {step['to']}: "
              f"{step['group_of_new_size']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4, help="ranks")
    parser.add_argument("--steps", type=int, default=1500, help="training steps of each run")
    parser.add_argument("--every", type=float, nargs="+", default=[4.0, 10.0],
                        help="seconds between two kills (one run of each for each value)")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="torchrun: steps between checkpoints")
    parser.add_argument("--cpu", action="store_true", help="the CPU even where there are GPUs")
    parser.add_argument("--scale-only", action="store_true", help="only the %%mesh scale 4 -> 6 -> 3 steps")
    parser.add_argument("--no-scale", action="store_true", help="leave out the %%mesh scale steps")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    args = parser.parse_args()
    import torch

    scale = run_scale(args.n) if not args.no_scale else {"steps": [], "restart_s": []}
    agents = run_scale(args.n, "torchrun") if not args.no_scale else {"steps": [], "restart_s": []}
    if args.scale_only:
        print(f"%mesh scale on CPU ranks ({os.cpu_count()} cores): local ranks, then ranks behind a host agent")
        print_scale(scale)
        print_scale(agents)
        _write_json(args.json, {"scale": scale, "scale_agents": agents})
        return

    cuda = not args.cpu and torch.cuda.is_available() and torch.cuda.device_count() >= args.n
    folder = tempfile.mkdtemp(prefix="bench-elastic-")
    runs: dict = {}
    try:
        clean = run_mesh(args.n, args.steps, None, cuda, folder)
        for every in args.every:
            healed = run_mesh(args.n, args.steps, every, cuda, folder)
            torchrun = run_torchrun(args.n, args.steps, every, args.checkpoint_every, cuda, folder)
            runs[every] = {"healed": healed, "torchrun": torchrun}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    base = clean["steps_per_s"]
    print(f"{args.n} ranks on {'GPUs' if cuda else 'CPU'} ({os.cpu_count()} cores), {args.steps} steps; goal: goodput "
          f">= {GOAL:g} of failure-free")
    print(f"  no failure (mesh + torchft):     {clean['steps_per_s']:6.2f} steps/s  ({clean['seconds']:.1f} s)  "
          f"final loss {clean['loss']:.6f}")
    for every, run in runs.items():
        print_failures(every, run["healed"], run["torchrun"], base, args.checkpoint_every)
    print_scale(scale)
    print_scale(agents)
    _write_json(args.json, {"clean": clean, "runs": {str(k): v for k, v in runs.items()}, "scale": scale,
                            "scale_agents": agents})


def print_failures(every: float, healed: dict, torchrun: dict, base: float, checkpoint_every: int) -> None:
    """The figures of one kill interval ``every`` (seconds) against the failure-free ``base`` (steps per second)."""
    goal = "meets" if healed["steps_per_s"] / base >= GOAL else "below"
    print(f" a random rank SIGKILLed every {every:g} s:")
    print(f"  mesh + torchft, self-healing:    {healed['steps_per_s']:6.2f} steps/s  ({healed['seconds']:.1f} s, "
          f"{healed['kills']} kills)  {healed['steps_per_s'] / base:.2f} of failure-free ({goal} the goal of "
          f"{GOAL:g})  final loss {healed['loss']:.6f}  replicas bitwise equal: {healed['equal']}")
    if torchrun["stalled"]:
        print(f"  torchrun --max-restarts, ckpt/{checkpoint_every}: did not recover: after {torchrun['kills']} "
              f"kills its restarted workers made no progress for {torchrun['stalled']:g} s (last checkpoint at step "
              f"{torchrun['last_checkpoint_step']}); killed")
    else:
        print(f"  torchrun --max-restarts, ckpt/{checkpoint_every}: {torchrun['steps_per_s']:6.2f} steps/s  "
              f"({torchrun['seconds']:.1f} s, {torchrun['kills']} kills)  {torchrun['steps_per_s'] / base:.2f} of "
              f"failure-free  final loss {torchrun['loss']:.6f}")
    rec = healed["recovery"]
    if rec:
        print(f"  death -> first committed step with the replacement in the quorum: median "
              f"{statistics.median(rec):.2f} s, max {max(rec):.2f} s over {len(rec)} deaths")
    if torchrun["steps_per_s"]:
        print(f"  mesh vs torchrun goodput: {healed['steps_per_s'] / torchrun['steps_per_s']:.2f}x")


def _write_json(path: str | None, figures: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
