"""Each ``%mesh run`` starts as a fresh torchrun worker would (issue 24, parts 3, 4 and 6c): frameworks' state
(accelerate's) fresh, the environment and the script's own modules given back afterwards; the note about a missing
``init_process_group`` only for scripts that would fail under torchrun; the note about ``destroy_process_group``
once per cell in which it applies. Real ranks, real gloo, accelerate's and Lightning's own code."""

from __future__ import annotations

import os
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from monarch_jupyter import Mesh, MeshError
from tests.conftest import magic_shell

pytestmark = pytest.mark.slow

accelerate_scripts = pytest.importorskip("accelerate.test_utils.scripts")  # the frameworks extra
ACCELERATE_SCRIPTS = Path(accelerate_scripts.__file__).parent
NO_INIT = "ran collectives without calling torch.distributed.init_process_group"
DESTROY = "destroy_process_group() left the mesh's process group up"

BF16 = """\
from accelerate import Accelerator

acc = Accelerator(cpu=True, mixed_precision="bf16")
print(f"bf16 script: {acc.mixed_precision} {acc.num_processes} {acc.distributed_type.value}")
"""

FABRIC = """\
import torch
from lightning.fabric import Fabric

fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
t = fabric.all_reduce(torch.ones(1), reduce_op="sum")
print(f"fabric rank {fabric.global_rank} of {fabric.world_size}: sum={t.item():g}")
"""

GUARDED = """\
import torch
import torch.distributed as dist

if not dist.is_initialized():
    dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"guarded sum={t.item():g}")
"""

PLAIN = """\
import torch
import torch.distributed as dist

t = torch.ones(1)
dist.all_reduce(t)  # under torchrun: 'Default process group has not been initialized'
print(f"plain sum={t.item():g}")
"""

ENV = """\
import os
import warnings

import helper_mod

print(f"env: {os.environ.get('ACCELERATE_USE_CPU')} {os.environ.get('FROM_CELL')} {os.environ.get('RUN_ONLY')} "
      f"helper={helper_mod.VERSION}")
os.environ["SET_BY_SCRIPT"] = "1"
os.environ["FROM_CELL"] = "changed by the script"
os.environ.pop("RANK_NAME_KEPT", None)
warnings.filterwarnings("ignore")
"""


@pytest.fixture(scope="module")
def m() -> Iterator[Mesh]:
    mesh = Mesh(2, start_timeout=120)
    yield mesh
    mesh.stop()


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    for name, text in (("bf16.py", BF16), ("fabric_run.py", FABRIC), ("guarded.py", GUARDED), ("plain.py", PLAIN),
                       ("env.py", ENV), ("helper_mod.py", "VERSION = 1\n")):
        (tmp_path / name).write_text(text)
    return tmp_path


def usable(mesh: Mesh) -> None:
    assert mesh.run("t = torch.ones(1); dist.all_reduce(t); t.item()") == {0: 2.0, 1: 2.0}
    assert mesh.state.group_status().startswith("up (gloo, 2 of 2 ranks)")


def multi_cpu(out: str, what: str) -> None:
    """accelerate saw torchrun's world: MULTI_CPU with 2 processes (the bug: DistributedType.NO, 1 process)."""
    seen = re.search(r"\[rank0\]: (State: )?Distributed environment: DistributedType.MULTI_CPU", out)
    assert seen, (what, out[-3000:])
    assert "[rank0]: Num processes: 2" in out, (what, out[-3000:])


@pytest.mark.parametrize("first", ["test_ops", "test_script"])
def test_accelerate_test_scripts_run_as_under_torchrun_in_either_order(
        m: Mesh, first: str, capsys: pytest.CaptureFixture[str]) -> None:
    second = "test_script" if first == "test_ops" else "test_ops"
    shell = magic_shell()
    for name in (first, second):
        if name == "test_script":  # as a module, the way accelerate's own tests launch it
            line = "run --env ACCELERATE_USE_CPU=1 -m accelerate.test_utils.scripts.test_script"
        else:  # as the file inside the installed package
            line = f"run -e ACCELERATE_USE_CPU=1 {ACCELERATE_SCRIPTS / 'test_ops.py'}"
        assert shell.run_line_magic("mesh", line) == {0: 0, 1: 0}
        captured = capsys.readouterr()
        multi_cpu(captured.out, name)
        assert NO_INIT not in captured.err  # accelerate asks dist.is_initialized() first: fine under torchrun
        assert "[rank0]: monarch: " + DESTROY in captured.err  # its destroy_process_group(), once per run
    # The variable was for those runs only.
    assert m.run("import os; 'ACCELERATE_USE_CPU' in os.environ") == {0: False, 1: False}
    usable(m)


@pytest.mark.parametrize("sync_first", [True, False])
def test_a_new_accelerator_after_test_sync_gets_its_own_settings(
        m: Mesh, folder: Path, sync_first: bool, capsys: pytest.CaptureFixture[str]) -> None:
    runs = [(ACCELERATE_SCRIPTS / "test_sync.py", {"ACCELERATE_USE_CPU": "1"}), (folder / "bf16.py", {})]
    for script, env in runs if sync_first else runs[::-1]:
        assert m.run_script(script, env=env) == {0: 0, 1: 0}
    out = capsys.readouterr().out
    assert "[rank0]: bf16 script: bf16 2 MULTI_CPU" in out and "[rank1]: bf16 script: bf16 2 MULTI_CPU" in out
    usable(m)


@pytest.mark.parametrize("env_first", [True, False])
def test_the_environment_is_the_runs_own(m: Mesh, folder: Path, env_first: bool,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    # What a cell sets before a run stays the cell's; what the script or --env sets is gone afterwards.
    m.run("import os; os.environ['FROM_CELL'] = 'cell'; os.environ['RANK_NAME_KEPT'] = str(rank)")
    with_env = {"ACCELERATE_USE_CPU": "1", "RUN_ONLY": "x"}
    for env in (with_env, {}) if env_first else ({}, with_env):
        assert m.run_script(folder / "env.py", env=env) == {0: 0, 1: 0}
        expected = "1 cell x" if env else "None cell None"
        assert f"[rank0]: env: {expected} helper=1" in capsys.readouterr().out
        after = m.run("import os, warnings\n"
                      "[os.environ.get(n) for n in ('ACCELERATE_USE_CPU', 'RUN_ONLY', 'SET_BY_SCRIPT', 'FROM_CELL',"
                      " 'RANK_NAME_KEPT')] + [('ignore', None, Warning, None, 0) in warnings.filters]")
        assert after == {r: [None, None, None, "cell", str(r), False] for r in (0, 1)}
    m.run("del os.environ['FROM_CELL'], os.environ['RANK_NAME_KEPT']")
    usable(m)


def test_modules_beside_the_script_are_read_again(m: Mesh, folder: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    m.run_script(folder / "env.py")
    assert "helper=1" in capsys.readouterr().out
    (folder / "helper_mod.py").write_text("VERSION = 2\n")
    m.run_script(folder / "env.py")
    assert "helper=2" in capsys.readouterr().out
    # The same for python -m (its modules come from the working folder), and after a run that failed.
    monkeypatch.chdir(folder)
    (folder / "helper_mod.py").write_text("VERSION = 3\nraise RuntimeError('broken helper')\n")
    with pytest.raises(MeshError, match="broken helper"):
        m.run_script("env", module=True)
    (folder / "helper_mod.py").write_text("VERSION = 4\n")
    m.run_script("env", module=True)
    assert "helper=4" in capsys.readouterr().out
    assert m.run("import sys; 'helper_mod' in sys.modules") == {0: False, 1: False}
    usable(m)


def test_cells_keep_their_state_reset_is_one_call_and_keep_state_opts_out(
        m: Mesh, folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Within cells, accelerate's state persists as in one process.
    m.run("from accelerate import Accelerator\nacc = Accelerator(cpu=True)")
    with pytest.raises(MeshError, match="AcceleratorState has already been initialized"):
        m.run("Accelerator(cpu=True, mixed_precision='bf16')")
    # --keep-state: the script sees what the cells made (so here it fails as in that one process)...
    shell = magic_shell()
    with pytest.raises(MeshError, match="AcceleratorState has already been initialized"):
        shell.run_line_magic("mesh", f"run --keep-state {folder / 'bf16.py'}")
    assert m.run("acc.num_processes") == {0: 2, 1: 2}  # ... and leaves it to them
    # A plain run starts fresh, and leaves a fresh state behind, as a process that exited.
    assert shell.run_line_magic("mesh", f"run {folder / 'bf16.py'}") == {0: 0, 1: 0}
    assert "[rank0]: bf16 script: bf16 2 MULTI_CPU" in capsys.readouterr().out
    assert m.run("Accelerator(cpu=True, mixed_precision='fp16').mixed_precision") == {0: "fp16", 1: "fp16"}
    # In a cell the reset is one call away.
    cell = textwrap.dedent("""
        import monarch_worker
        done = monarch_worker.reset_state()
        (done, Accelerator(cpu=True, mixed_precision='bf16').mixed_precision)
    """)
    assert m.run(cell) == {r: (["accelerate"], "bf16") for r in (0, 1)}
    m.run("monarch_worker.reset_state(); del acc")
    usable(m)


def test_lightning_warnings_show_again_in_the_next_run(m: Mesh, folder: Path) -> None:
    (folder / "warn_once.py").write_text(textwrap.dedent("""
        from lightning.pytorch.utilities import data

        print(f"seen before: {'monarch test warning' in data.warning_cache}")
        data.warning_cache.add("monarch test warning")
    """))
    m.run_script(folder / "warn_once.py", ranks=0)
    assert m.run("from lightning.pytorch.utilities import data; 'monarch test warning' in data.warning_cache",
                 ranks=0) == {0: False}


@pytest.mark.parametrize("name", ["fabric_run.py", "guarded.py", "accelerate"])
def test_scripts_that_pass_under_torchrun_get_no_init_note(m: Mesh, folder: Path, name: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    if name == "accelerate":
        (folder / "acc.py").write_text("from accelerate import Accelerator\nimport torch\n"
                                       "acc = Accelerator(cpu=True)\n"
                                       "print('acc sum', acc.reduce(torch.ones(1), 'sum').item())\n")
        name = "acc.py"
    assert m.run_script(folder / name) == {0: 0, 1: 0}
    captured = capsys.readouterr()
    assert "sum=2" in captured.out or "acc sum 2.0" in captured.out
    assert NO_INIT not in captured.err
    # A plain script with collectives and no init does get it (under torchrun it fails).
    assert m.run_script(folder / "plain.py") == {0: 0, 1: 0}
    err = capsys.readouterr().err
    assert f"[rank0]: monarch: plain.py {NO_INIT}" in err or NO_INIT in err
    assert err.count(NO_INIT) == 1  # rank 0 only
    usable(m)


def test_the_destroy_note_shows_in_each_cell_that_destroys(m: Mesh, folder: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    (folder / "destroys.py").write_text("import torch.distributed as dist\ndist.init_process_group()\n"
                                        "dist.destroy_process_group()\n")
    m.run_script(folder / "destroys.py")
    assert capsys.readouterr().err.count(DESTROY) == 1
    for _ in range(2):  # each later cell that destroys the group is told, once
        m.run("dist.destroy_process_group(); dist.destroy_process_group()")
        assert capsys.readouterr().err.count(DESTROY) == 1
    m.run("1")
    assert DESTROY not in capsys.readouterr().err
    m.run_script(folder / "destroys.py")
    assert capsys.readouterr().err.count(DESTROY) == 1
    usable(m)


def test_env_must_be_names_and_strings(m: Mesh, folder: Path) -> None:
    from IPython.core.error import UsageError

    with pytest.raises(ValueError, match="letters, digits and underscores"):
        m.run_script(folder / "env.py", env={"BAD NAME": "1"})
    with pytest.raises(TypeError, match="must be a string"):
        m.run_script(folder / "env.py", env={"OK": [1]})
    with pytest.raises(UsageError, match="--env takes NAME=VALUE"):
        magic_shell().run_line_magic("mesh", f"run --env NOVALUE {folder / 'env.py'}")
    assert "NOVALUE" not in os.environ
    usable(m)
