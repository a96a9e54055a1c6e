"""Tiny torchrun / srun payload: gloo all_reduce on CPU, prints rank info.

Reads the usual torchrun env (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT); when started by plain `srun` (no torchrun) it falls back to
SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and needs MASTER_ADDR/MASTER_PORT
exported by the caller.
"""

import os
import socket
import time

import torch
import torch.distributed as dist


def _env(name, fallback):
    v = os.environ.get(name)
    if v is None:
        v = os.environ.get(fallback)
    if v is None:
        raise SystemExit(f"neither {name} nor {fallback} set")
    return v


def main():
    t0 = time.time()
    os.environ["RANK"] = rank = _env("RANK", "SLURM_PROCID")
    os.environ["WORLD_SIZE"] = world = _env("WORLD_SIZE", "SLURM_NTASKS")
    local = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "?"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    ok = t.item() == expected
    print(
        f"rank={rank} world={world} local_rank={local} host={socket.gethostname()} "
        f"master={os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
        f"allreduce={t.item():g} expected={expected:g} {'OK' if ok else 'MISMATCH'} "
        f"init+allreduce={time.time() - t0:.2f}s",
        flush=True,
    )
    dist.barrier()
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
