"""A real Jupyter kernel driven by jupyter_client: the path a notebook takes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from jupyter_client.manager import KernelManager, start_new_kernel

from tests.conftest import cell_text, wait_gone, worker_pids

pytestmark = pytest.mark.kernel

TIMEOUT = 120


def execute(kc: Any, code: str, timeout: float = TIMEOUT) -> tuple[dict, list[dict]]:
    """Run ``code``; returns (execute_reply content, iopub messages of that request).

    Each request is a cell of its own (``stop_on_error=False``): otherwise ipykernel 6 aborts a request that
    arrives in the instant after an error reply (``Kernel._abort_queues``), as a notebook's "run all" wants."""
    msg_id = kc.execute(code, stop_on_error=False)
    reply = kc.get_shell_msg(timeout=timeout)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=timeout)
    msgs = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
        msgs.append(msg)
    return reply["content"], msgs


def streams(msgs: list[dict], name: str = "stdout") -> str:
    return "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream" and m["content"]["name"] == name)


@pytest.fixture()
def kernel() -> Iterator[tuple[KernelManager, Any]]:
    env = dict(os.environ)
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=os.getcwd())
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_mesh_cell_through_a_real_kernel(kernel: tuple[KernelManager, Any]) -> None:
    km, kc = kernel
    reply, _ = execute(kc, "%load_ext monarch")
    assert reply["status"] == "ok", reply
    reply, msgs = execute(kc, "m = %mesh start -n 2\nm")
    assert reply["status"] == "ok", reply
    result = [m for m in msgs if m["msg_type"] == "execute_result"]
    assert "world_size=2" in result[0]["content"]["data"]["text/plain"]

    code = "%%mesh\nt = torch.ones(3) * rank\ndist.all_reduce(t)\nprint(rank, t)\nt.sum().item()\n"
    reply, msgs = execute(kc, code)
    assert reply["status"] == "ok", reply
    out = cell_text(msgs)  # the ranks' lines are in the cell's dashboard, not beside it (widgets.celldash)
    assert "[rank0]: 0 tensor([1., 1., 1.])" in out and "[rank1]: 1 tensor([1., 1., 1.])" in out
    assert not streams(msgs)
    results = [m["content"]["data"]["text/plain"] for m in msgs if m["msg_type"] == "execute_result"]
    assert results == ["{0: 3.0, 1: 3.0}"]

    # An error on one rank: one error message in the cell, with the rank's traceback; the mesh survives.
    reply, msgs = execute(kc, "%%mesh\nprint('hi')\n1 / (rank - 1)\n")
    assert reply["status"] == "error"
    errors = [m["content"] for m in msgs if m["msg_type"] == "error"]
    assert len(errors) == 1
    tb = "\n".join(errors[0]["traceback"])
    assert "[rank1]" in tb and "ZeroDivisionError" in tb and "1 / (rank - 1)" in tb
    assert "[rank0]: hi" in cell_text(msgs) and "[rank1]: hi" in cell_text(msgs)

    reply, msgs = execute(kc, "import json; print(json.dumps(sorted(s['pid'] for s in m.status().values())))")
    pids = set(__import__("json").loads(streams(msgs).strip().splitlines()[-1]))
    assert len(pids) == 2 and pids <= worker_pids()

    reply, msgs = execute(kc, "%%mesh\nrank * 10\n")
    assert [m["content"]["data"]["text/plain"] for m in msgs if m["msg_type"] == "execute_result"] == [
        "{0: 0, 1: 10}"]

    # Shutting the kernel down takes its ranks and fork server with it.
    kc.stop_channels()
    km.shutdown_kernel(now=False)
    assert not wait_gone(pids, timeout=10)


def test_output_lands_in_the_cell_that_caused_it(kernel: tuple[KernelManager, Any]) -> None:
    km, kc = kernel
    execute(kc, "%load_ext monarch\nm = %mesh start -n 2")
    # A non-blocking cell prints after the submitting cell has finished; its lines carry that cell's parent
    # header, not the header of whatever cell runs later.
    submit_id = kc.execute("h = m.run('import time\\ntime.sleep(1)\\nprint(\"late\", rank)', block=False)")
    other_id = kc.execute("import time; time.sleep(3); 'other cell'")
    msgs = []
    while True:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        msgs.append(msg)
        if (msg["parent_header"].get("msg_id") == other_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"):
            break
    late = [m for m in msgs if m["msg_type"] == "stream"]
    assert "[rank0]: late 0" in streams(late) and "[rank1]: late 1" in streams(late)
    assert {m["parent_header"]["msg_id"] for m in late} == {submit_id}
    reply, msgs = execute(kc, "h.result(timeout=30)")
    assert reply["status"] == "ok"
