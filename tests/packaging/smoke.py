"""Smoke test of an installed monarch-jupyter, as a user has it: run this file from a folder outside the checkout.

    cd /tmp && /path/to/venv/bin/python /path/to/checkout/tests/packaging/smoke.py

It checks that every module comes from the environment's site-packages (not from a checkout), that the
start-up hook is active, and that ``%load_ext monarch`` in IPython starts 2 ranks that run an all_reduce and move a
tensor through shared memory (NumPy) both ways. Only what the package declares needs to be installed. Prints
``smoke: ok`` and exits 0, or raises.
"""

from __future__ import annotations

import os
import sys
import sysconfig


def main() -> None:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(__file__)]
    site = os.path.realpath(sysconfig.get_paths()["purelib"])
    import _monarch_jupyter_hook

    import monarch
    import monarch_jupyter
    import monarch_worker

    for module in (monarch, monarch_jupyter, monarch_worker, _monarch_jupyter_hook):
        where = os.path.realpath(module.__file__ or "")
        assert where.startswith(site + os.sep), f"{module.__name__} comes from {where}, not from {site}"
    assert any(getattr(f, "monarch_jupyter_finder", False) for f in sys.meta_path), \
        "monarch_jupyter.pth did not install the start-up hook"

    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "monarch")
    mesh = ip.run_line_magic("mesh", "start -n 2 --timeout 120")
    try:
        out = ip.run_cell_magic("mesh", "", "t = torch.ones(3) * (rank + 1)\ndist.all_reduce(t)\nt.sum().item()")
        assert dict(out) == {0: 9.0, 1: 9.0}, out
        import torch

        x = torch.arange(100_000, dtype=torch.float64)  # 800 KB: through shared memory, not inside a pickle
        ip.user_ns["x"] = x
        ip.run_line_magic("mesh", "push x")
        got = ip.run_cell_magic("mesh", "", "x = x * (rank + 1)\nx.sum().item()")
        assert dict(got) == {0: float(x.sum()), 1: 2 * float(x.sum())}, got
        ip.run_line_magic("mesh", "pull x --as back")
        back = ip.user_ns["back"]
        assert torch.equal(back[1], x * 2), "pulled tensor differs"
    finally:
        mesh.stop()
    ip.run_line_magic("unload_ext", "monarch")
    print("smoke: ok")


if __name__ == "__main__":
    main()
