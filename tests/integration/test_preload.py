"""The fork server imports what the notebook asks it to (``launch.local.preload``; Lightning when the notebook imports
it), so that local ranks forked afterwards start with those modules instead of importing them each (issue 30)."""

from __future__ import annotations

import time

import pytest

from monarch_jupyter import Mesh, MeshError
from monarch_jupyter.kernel.launch.local import ForkServer, preload, shutdown

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


def test_a_self_healing_meshs_replacements_start_with_what_a_first_optimizer_step_imports():
    """torch._dynamo (1.2-1.7 s to import; a rank's first optimizer step does) is imported by the fork server once a
    self-healing mesh is up, not before the first ranks of any mesh (every ``%mesh start`` would pay it)."""
    probe = "import sys; 'torch._dynamo' in sys.modules"
    shutdown()  # a fresh fork server: one an earlier test asked to import it would have it already
    with Mesh(1, start_timeout=120) as mesh:
        assert mesh.run(probe) == {0: False}
        mesh.restart()
        assert mesh.run(probe) == {0: False}  # a plain mesh never asks
    with Mesh(1, start_timeout=120, on_rank_death="restart") as mesh:
        assert mesh.run(probe) == {0: False}  # forked before the mesh was up
        old = mesh.run("import os; os.getpid()")[0]
        mesh.run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", block=False)
        deadline = time.monotonic() + 120
        while True:  # until the replacement runs cells
            try:
                if mesh.run("import os; os.getpid()", timeout=60)[0] != old:
                    break
            except MeshError:
                pass  # a cell sent to the rank that died
            assert time.monotonic() < deadline, "no replacement within 120 s"
            time.sleep(0.2)
        assert mesh.run(probe) == {0: True}  # forked after the fork server imported it
