"""A small DDP training run whose final weights must be bitwise the same under torchrun and on the mesh
(tests/integration/test_torchrun_parity.py).

    torchrun --nproc-per-node 2 ddp_weights.py OUT [STEPS]     rank 0 saves the final state_dict to OUT
"""

import gc
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    out = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(1234 + rank)  # each rank its own shard
    for _ in range(steps):
        x, y = torch.randn(4096, 32, generator=data), torch.randn(4096, 16, generator=data)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank == 0:
        torch.save(model.state_dict(), out)
    # DDP's reducer holds the process group, so destroy_process_group alone leaves the group's gloo threads running
    # until the interpreter exits. One of them may then be dropping the last gradient all_reduce, whose destructor
    # takes the GIL: a thread that takes the GIL while Python finalizes exits, and that thread's unwinding calls
    # std::terminate ("terminate called without an active exception", SIGABRT after the run finished; 7 of 186
    # torchrun runs here). Freeing the model first lets the group's destruction join those threads.
    del ddp
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
