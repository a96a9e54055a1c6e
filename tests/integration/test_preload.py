"""The fork server imports what the notebook asks it to (``launch.local.preload``; Lightning when the notebook imports
it), so that local ranks forked afterwards start with those modules instead of importing them each (issue 30)."""

from __future__ import annotations

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
