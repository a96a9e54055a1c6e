"""The folders of the ranks' TORCHELASTIC_ERROR_FILE (torchrun's ``.../attempt_0/LOCAL_RANK/error.json`` layout,
monarch_worker.elastic_env) are removed when the ranks go, also the folder of a rank that was SIGKILLed and the
folders of ranks that were running when the controller died: they live in the fork server's own folder, which it
removes as it exits. (Each rank made one in the temp folder, and only a clean exit removed it: a fresh user found
2,828 of them in /tmp.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

CONTROLLER = textwrap.dedent("""
    import json, os, sys
    from monarch_jupyter import Mesh
    from monarch_jupyter.errors import MonarchError

    mesh = Mesh(2, start_timeout=120)
    files = mesh.run("import os; os.environ['TORCHELASTIC_ERROR_FILE']")
    try:
        mesh.run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", ranks=[1])
    except MonarchError:
        pass
    print(json.dumps(files), flush=True)
    sys.stdin.readline()  # the test looks at the folders, then closes stdin
    os._exit(0)  # as a kernel that is killed: no atexit, no mesh.stop()
""")


def test_error_file_folders_go_with_the_fork_server(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # everything the fork server and the ranks make lands here
    proc = subprocess.Popen([sys.executable, "-c", CONTROLLER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env, cwd=Path(__file__).resolve().parents[2])
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        files = {int(k): Path(v) for k, v in json.loads(line).items()}
        assert set(files) == {0, 1}, line
        folders = {r: f.parents[2] for r, f in files.items()}  # .../torchelastic_XXXX/attempt_0/R/error.json
        for r, folder in folders.items():
            assert folder.name.startswith("torchelastic_") and folder.parent.name.startswith("monarch-ranks-"), files
            assert files[r].parent.is_dir(), files  # made, and rank 1's still there after its SIGKILL
        proc.stdin.close()
        assert proc.wait(60) == 0
        # the fork server notices its parent is gone within a second, then removes its folder: what is inside
        # first, the folder itself last, so the wait is for that one too (it had stopped at the inner ones)
        gone = [*folders.values(), folders[0].parent]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(f.exists() for f in gone):
            time.sleep(0.2)
        assert not any(f.exists() for f in gone), sorted(map(str, tmp_path.rglob("*")))
    finally:
        proc.kill()
        proc.wait(10)
