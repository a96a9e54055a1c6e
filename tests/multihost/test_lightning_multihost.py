"""Trainer(strategy="mesh") on ranks on two fake hosts (network namespaces): joined under torchrun, and started by
SLURM's srun. num_nodes comes from the hosts, Lightning sees each rank's node, the weights come back here."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from monarch_jupyter import Mesh
from tests.conftest import reap
from tests.multihost.conftest import FakeHosts, SlurmCluster
from tests.multihost.test_slurm import allocation  # noqa: F401 - the fixture

pytestmark = [pytest.mark.multihost, pytest.mark.slow]


def _fit_on(m: Mesh) -> None:
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


def test_fit_on_two_hosts_joined_by_torchrun(fake_hosts: FakeHosts, tmp_path: object) -> None:
    pytest.importorskip("lightning")
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
        _fit_on(m)
    finally:
        m.stop()
    assert reap(procs) == [0, 0]


def test_fit_on_ranks_started_by_srun(slurm: SlurmCluster, allocation: str) -> None:  # noqa: F811
    pytest.importorskip("lightning")
    from monarch_jupyter.kernel.launch.slurm import SlurmLauncher

    m = Mesh(4, launcher=SlurmLauncher(nodes=2), address=slurm.hosts.bridge, start_timeout=120)
    try:
        assert sorted(map(sorted, m.hosts().values())) == [[0, 1], [2, 3]]
        _fit_on(m)
    finally:
        m.stop()
