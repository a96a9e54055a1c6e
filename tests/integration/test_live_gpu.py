"""CUDA memory in the live view: ranks on GPUs report torch's allocated/reserved bytes in their heartbeats."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_heartbeat_reports_cuda_memory_of_the_rank_device():
    from monarch_jupyter import Mesh
    from monarch_jupyter.widgets import monitor_for

    with Mesh(1, backend="nccl", heartbeat_interval=0.2) as mesh:
        monitor = monitor_for(mesh)
        mesh.run("x = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)")  # 256 MiB on the rank's GPU
        deadline = time.monotonic() + 10
        row = None
        while time.monotonic() < deadline:
            row = monitor.snapshot()[0][0]
            if row.cuda_allocated >= 256 * 2**20:
                break
            time.sleep(0.1)
        assert row is not None and row.cuda_allocated >= 256 * 2**20, row
        assert row.cuda_reserved >= row.cuda_allocated
        assert mesh.status()[0]["cuda_allocated"] >= 256 * 2**20
        mesh.run("del x; torch.cuda.empty_cache()")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and monitor.snapshot()[0][0].cuda_allocated >= 256 * 2**20:
            time.sleep(0.1)
        assert monitor.snapshot()[0][0].cuda_allocated < 256 * 2**20
