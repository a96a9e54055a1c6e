"""Widget models a kernel holds after N ``%%mesh`` cells that each outlive DEFER (so each makes a live widget), with
LIVE_CELL_VIEWS as shipped (20) and unbounded (what every cell kept before), each in a fresh kernel, 2 ranks.

    python bench/widget_models.py [N]      # N cells, default 40

Prints, for each, the models left in the kernel (each is a comm, in the kernel and in the browser), the time per
cell, and the comm messages a cell sends (opens and updates). Shipped, the count stops growing once 20 cells hold a
widget.
"""

import sys
import time

from jupyter_client.manager import start_new_kernel

SENT = {"comm_open": 0, "comm_msg": 0}  # comm messages of the cells' own IOPub traffic


def ex(kc, code):
    mid = kc.execute(code, stop_on_error=False, allow_stdin=True)
    out = ""
    while True:
        m = kc.get_iopub_msg(timeout=120)
        if m["parent_header"].get("msg_id") != mid:
            continue
        if m["msg_type"] in SENT:
            SENT[m["msg_type"]] += 1
        if m["msg_type"] == "stream":
            out += m["content"]["text"]
        if m["msg_type"] == "error":
            raise RuntimeError("\n".join(m["content"]["traceback"]))
        if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
            return out


COUNT = "print(len(comm.get_comm_manager().comms))"  # the kernel's open comms: one per widget model
N = int(sys.argv[1]) if len(sys.argv) > 1 else 40
for label, limit in (("unbounded (before)", "10**9"), ("LIVE_CELL_VIEWS=20 (after)", "20")):
    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=60)
    try:
        ex(kc, f"%load_ext monarch\n%mesh start -n 2\nimport comm, monarch_jupyter.widgets as _w\n"
               f"_w.LIVE_CELL_VIEWS = {limit}")
        base = int(ex(kc, COUNT).split()[0])
        t = time.monotonic()
        SENT.update(comm_open=0, comm_msg=0)
        for i in range(N):
            ex(kc, f"%%mesh\nimport time\nprint('cell {i}', rank)\ntime.sleep(0.4)")
        took = time.monotonic() - t
        n = int(ex(kc, COUNT).split()[0])
        print(f"{label:28s} widget models (open comms) after {N} cells: {n - base} ({(n - base) / N:.1f} per cell); "
              f"{took / N * 1e3:.0f} ms per cell; comm messages per cell: {SENT['comm_open'] / N:.1f} open, "
              f"{SENT['comm_msg'] / N:.1f} updates", flush=True)
        ex(kc, "%mesh stop")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
