"""The fork server imports what the notebook asks it to (``launch.local.preload``; Lightning when the notebook imports
it), so that local ranks forked afterwards start with those modules instead of importing them each (issue 30)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from monarch_jupyter import Mesh
from monarch_jupyter.kernel.launch.local import ForkServer, preload

pytestmark = pytest.mark.timeout(300)

PROBE = "import sys; ('tabnanny' in sys.modules, 'wave' in sys.modules)"


def test_ranks_forked_after_a_preload_start_with_the_module():
    # tabnanny and wave: small stdlib modules that nothing in a rank's start-up imports (torch._dynamo, which the
    # fork server preloads, imports colorsys).
    with Mesh(1, start_timeout=120) as mesh:
        assert mesh.run(PROBE) == {0: (False, False)}
        preload(["tabnanny", "no_such_module_here"])  # one that fails is left out; the rest still comes
        mesh.restart()
        assert mesh.run(PROBE) == {0: (True, False)}
        assert "tabnanny" in ForkServer.preloaded


SCENARIO = """
import os, signal, sys, time
from monarch_jupyter import Mesh, MeshError

probe = "import sys; 'torch._dynamo' in sys.modules"
seen = []
with Mesh(1, start_timeout=120) as mesh:
    seen.append(mesh.run(probe)[0])
    mesh.restart()
    seen.append(mesh.run(probe)[0])  # a plain mesh never asks
with Mesh(1, start_timeout=120, on_rank_death="restart") as mesh:
    seen.append(mesh.run(probe)[0])  # its first ranks have it too
    old = mesh.run("import os; os.getpid()")[0]
    mesh.run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", block=False)
    deadline = time.monotonic() + 120
    while True:  # until the replacement runs cells
        try:
            if mesh.run("import os; os.getpid()", timeout=60)[0] != old:
                break
        except MeshError:
            pass  # a cell sent to the rank that died
        if time.monotonic() > deadline:
            sys.exit("no replacement within 120 s")
        time.sleep(0.2)
    seen.append(mesh.run(probe)[0])  # and its replacements
print("SEEN", seen)
"""


def test_a_self_healing_meshs_replacements_start_with_what_a_first_optimizer_step_imports():
    """torch._dynamo (1.2-1.7 s to import; a rank's first optimizer step does) is imported by the fork server for a
    self-healing mesh, whose replacements then start with it, and never for a plain mesh (every ``%mesh start`` would
    pay it). In a fresh interpreter: its own fork server, which no earlier test asked to import anything (this
    session's is shared)."""
    done = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SEEN [False, False, True, True]" in done.stdout, (done.stdout[-2000:], done.stderr[-2000:])
