"""A torchrun script for the bad-input tests of %mesh run: it checks what Python would give it, then exits.

    exits.py [--rank-exits R] [--status N] [--message TEXT] [--no-init] [--backend B]
"""

import argparse
import os
import sys

import exits_helper  # a module beside the script: importable because the script's folder is sys.path[0]
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--rank-exits", type=int, default=-1, help="only this rank exits with --status")
parser.add_argument("--status", type=int, default=0)
parser.add_argument("--message", default="")
parser.add_argument("--no-init", action="store_true")
parser.add_argument("--backend", default="gloo")
args = parser.parse_args()

if __name__ == "__main__":
    if not args.no_init:
        dist.init_process_group(args.backend)
    t = torch.ones(1)
    dist.all_reduce(t)
    rank = int(os.environ["RANK"])
    print(f"argv={sys.argv!r} path0={sys.path[0]} helper={exits_helper.VERSION} sum={t.item():g}")
    if args.message and rank == args.rank_exits:
        sys.exit(args.message)
    if rank == args.rank_exits or args.rank_exits == -2:
        sys.exit(args.status)
    dist.destroy_process_group()
