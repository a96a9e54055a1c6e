"""A torchrun worker that reports what it sees (tests/integration/test_torchrun_env.py runs it under torchrun and
on the mesh and compares): its environment, torch's threads, torchelastic, and what Lightning makes of it.

    torchrun --nproc-per-node 2 env_report.py OUT [--lightning]     writes OUT.<RANK> (JSON)
"""

import argparse
import json
import os

import torch
import torch.distributed as dist


def lightning_report() -> dict:
    """The cluster environment Lightning picks, and what fit() with Trainer(devices=4) on this world says."""
    from lightning.pytorch import LightningModule, Trainer

    class Tiny(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.layer(batch).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(torch.randn(8, 2), batch_size=4)

    quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
             "enable_model_summary": False, "max_steps": 1}
    out = {}
    trainer = Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="ddp", **quiet)
    out["environment"] = type(trainer.strategy.cluster_environment).__name__
    try:
        Trainer(accelerator="cpu", devices=4, strategy="ddp", **quiet).fit(Tiny())
        out["devices_4"] = "no error: it trained"
    except ValueError as e:
        out["devices_4"] = str(e)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--lightning", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    report = {
        "env": dict(os.environ),
        "threads": [torch.get_num_threads(), torch.get_num_interop_threads()],
        "torchelastic": dist.is_torchelastic_launched(),
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
    }
    if args.lightning:
        report["lightning"] = lightning_report()
    with open(f"{args.out}.{dist.get_rank()}", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
