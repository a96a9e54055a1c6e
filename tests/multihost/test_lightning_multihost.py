"""Trainer(strategy="mesh") on ranks that joined from two fake hosts (network namespaces) under torchrun:
num_nodes comes from the hosts, Lightning sees each rank's node, and the weights come back to this process."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from monarch_jupyter import Mesh
from tests.multihost.conftest import FakeHosts
from tests.multihost.test_netns import reap

pytestmark = [pytest.mark.multihost, pytest.mark.slow]


def test_fit_on_two_hosts_joined_by_torchrun(fake_hosts: FakeHosts, tmp_path: object) -> None:
    L = pytest.importorskip("lightning")
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    import monarch_jupyter.lightning  # noqa: F401 - registers "mesh"

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            import os
            import socket

            if batch_idx == 0:
                print("node", os.environ.get("GROUP_RANK"), self.trainer.node_rank, socket.gethostname())
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    m = Mesh.listen(4, address=fake_hosts.bridge, nproc_per_node=2, timeout=120, show=False)
    procs: list[subprocess.Popen] = []
    try:
        logs = [open(f"{tmp_path}/h{k}.log", "w") for k in (1, 2)]
        # The same software on every host: the ranks see this interpreter's packages (a virtualenv included).
        path = "PYTHONPATH=" + shlex.quote(os.pathsep.join(p for p in sys.path if p))
        for k in (1, 2):
            procs.append(fake_hosts.popen(k, ["sh", "-c", f"{path} {m.join_commands().torchrun}"],
                                          stdout=logs[k - 1], stderr=subprocess.STDOUT))
        assert m.wait_ready(120)
        x = torch.randn(64, 4)
        model = Tiny()
        before = model.net.weight.detach().clone()
        trainer = L.Trainer(strategy="mesh", accelerator="cpu", devices=2, max_epochs=1, logger=False,
                            enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
        assert trainer.num_nodes == 2 and trainer.world_size == 4
        trainer.fit(model, DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4))
        assert trainer.global_step == 4  # 64 samples / (4 ranks x 4)
        assert not torch.equal(before, model.net.weight)
        assert trainer.strategy.node_ranks == {0: 0, 1: 0, 2: 1, 3: 1}
    finally:
        m.stop()
    assert reap(procs) == [0, 0]
