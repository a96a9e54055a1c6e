"""Code written for torchrun on the mesh (issue 11): ``%mesh run`` / ``Mesh.run_script`` run an existing script
unchanged, the script's own init/destroy_process_group meet the mesh's group, bad input gets a clear message and
leaves the mesh usable, and a NameError for a notebook name says how to send it. Real ranks, real gloo."""

from __future__ import annotations

import shutil
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from monarch_jupyter import Mesh, MeshError
from monarch_jupyter.kernel import registry
from tests.conftest import magic_shell

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "torchrun_scripts"


@pytest.fixture(scope="module")
def m() -> Iterator[Mesh]:
    mesh = Mesh(2, start_timeout=120)
    yield mesh
    mesh.stop()


@pytest.fixture()
def script(tmp_path: Path) -> Path:
    """exits.py and the helper module beside it, in a folder of their own (tests edit the helper)."""
    for name in ("exits.py", "exits_helper.py"):
        shutil.copy(SCRIPTS / name, tmp_path / name)
    return tmp_path / "exits.py"


def usable(mesh: Mesh) -> None:
    """The mesh still runs cells and collectives on every rank, and says its group is up."""
    assert mesh.run("t = torch.ones(1); dist.all_reduce(t); t.item()") == {0: 2.0, 1: 2.0}
    assert mesh.state.group_status().startswith("up (gloo, 2 of 2 ranks)")


def test_a_script_runs_as_python_runs_it(m: Mesh, script: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(script.parent)  # a path relative to the notebook's folder: argv[0] is the file, as __file__
    assert m.run_script(script.name, "--status", 0) == {0: 0, 1: 0}
    out = capsys.readouterr().out
    for r in (0, 1):
        # sys.argv with the script's path, the script's folder first on sys.path, its helper importable, its own
        # init and destroy_process_group fine: the all_reduce saw both ranks.
        assert (f"[rank{r}]: argv=[{str(script)!r}, '--status', '0'] path0={script.parent} helper=1 sum=2"
                in out)
    # Afterwards the rank is as before: its own argv and sys.path, the cell namespace's __main__.
    state = m.run("import sys; (sys.argv == [a for a in sys.argv if 'exits' not in a], "
                  f"{str(script.parent)!r} not in sys.path, __name__, dist.is_initialized())")
    assert state == {0: (True, True, "__main__", True), 1: (True, True, "__main__", True)}
    # An edit of a module beside the script shows in the next run, as in a fresh torchrun process.
    (script.parent / "exits_helper.py").write_text("VERSION = 2\n")
    m.run_script(script)
    assert "helper=2" in capsys.readouterr().out
    usable(m)


def test_exit_statuses_are_reported_per_rank(m: Mesh, script: Path) -> None:
    with pytest.raises(MeshError) as info:
        m.run_script(script, "--rank-exits", "1", "--status", "3")
    e = info.value
    assert list(e.errors) == [1] and e.results == {0: 0}
    assert e.errors[1].ename == "ScriptExit"
    assert "exits.py exited with status 3 on this rank" in e.errors[1].evalue
    with pytest.raises(MeshError) as info:
        m.run_script(script, "--rank-exits", "0", "--message", "bad config")
    assert "status 1 on this rank: bad config" in info.value.errors[0].evalue
    usable(m)


def test_argparse_errors_and_help_behave_as_in_a_shell(m: Mesh, script: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert m.run_script(script, "--help") == {0: 0, 1: 0}  # SystemExit(0): success, usage printed
    assert "[rank0]: usage: exits.py" in capsys.readouterr().out
    with pytest.raises(MeshError) as info:
        m.run_script(script, "--no-such-option")
    assert sorted(info.value.errors) == [0, 1]
    assert "exited with status 2" in info.value.errors[0].evalue
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err
    usable(m)


def test_a_missing_script_is_named_before_anything_runs(m: Mesh, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no script .*nope\.py.* does not exist .* working folder"):
        m.run_script(tmp_path / "nope.py")
    with pytest.raises(FileNotFoundError, match="is a folder"):
        m.run_script(tmp_path)
    with pytest.raises(TypeError, match="command-line strings"):
        m.run_script(tmp_path / "x.py", {"a": 1})
    usable(m)


def test_a_module_runs_as_python_dash_m(m: Mesh, script: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(script.parent)  # python -m looks in the working folder: the notebook's
    assert m.run_script("exits", "--status", "0", module=True) == {0: 0, 1: 0}
    out = capsys.readouterr().out
    assert f"argv=[{str(script)!r}, '--status', '0'] path0={script.parent}" in out  # argv[0]: the module's file
    with pytest.raises(MeshError, match="No module named 'no_such_module_here' on this rank"):
        m.run_script("no_such_module_here", module=True)
    usable(m)


def test_a_script_that_never_initializes_is_told_what_torchrun_would_do(
        m: Mesh, script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert m.run_script(script, "--no-init") == {0: 0, 1: 0}
    err = capsys.readouterr().err
    assert "[rank0]: monarch: " in err and "ran collectives without calling torch.distributed.init_process_group" in err
    usable(m)


def test_init_process_group_with_another_backend_says_what_differs(m: Mesh, script: Path) -> None:
    with pytest.raises(MeshError) as info:
        m.run_script(script, "--backend", "nccl")
    err = info.value.errors[0]
    assert err.ename == "MeshGroupError"
    assert "asks for backend nccl" in err.evalue and "backend gloo" in err.evalue and "--backend" in err.evalue
    with pytest.raises(MeshError, match="asks for world size 3"):
        m.run("dist.init_process_group('gloo', world_size=3, rank=rank)")
    # Compatible requests return at once, whatever rendezvous they name: no store is touched, nothing waits.
    t0 = time.monotonic()
    m.run("dist.init_process_group(init_method='tcp://127.0.0.1:1', world_size=2, rank=rank, backend='gloo')\n"
          "dist.init_process_group('cpu:gloo,cuda:nccl')")
    assert time.monotonic() - t0 < 30
    usable(m)


def test_destroy_process_group_in_a_cell_is_harmless(m: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    cell = textwrap.dedent("""
        dist.destroy_process_group()
        t = torch.ones(1) * (rank + 1)
        dist.all_reduce(t)   # under torchrun: 'Default process group has not been initialized'
        (dist.is_initialized(), t.item())
    """)
    assert m.run(cell) == {0: (True, 3.0), 1: (True, 3.0)}
    assert m.state.group_status().startswith("up")
    assert all(s["group"] == "gloo" for s in m.status().values())
    from monarch_jupyter.widgets.text import StatusText

    assert "process group: up (gloo, 2 of 2 ranks)" in StatusText(m).text()  # what  %mesh status  prints
    # A group of the user's own is destroyed for real.
    assert m.run("g = dist.new_group([0, 1]); dist.destroy_process_group(g); dist.is_initialized()") == {0: True,
                                                                                                     1: True}
    usable(m)


def test_accelerate_state_persists_and_resets_in_one_line(m: Mesh) -> None:
    first = m.run("from accelerate import Accelerator\nacc = Accelerator(cpu=True)\n"
                  "(acc.num_processes, acc.process_index, acc.distributed_type.value)")
    assert first == {0: (2, 0, "MULTI_CPU"), 1: (2, 1, "MULTI_CPU")}
    with pytest.raises(MeshError, match="AcceleratorState has already been initialized"):
        m.run("Accelerator(cpu=True, mixed_precision='bf16')")
    # end_training() destroys the process group under torchrun: harmless here; then the documented reset.
    again = m.run("acc.end_training()\n"
                  "from accelerate.state import AcceleratorState\n"
                  "AcceleratorState._reset_state(reset_partial_state=True)\n"
                  "acc = Accelerator(cpu=True, mixed_precision='bf16')\n"
                  "(acc.mixed_precision, acc.num_processes)")
    assert again == {0: ("bf16", 2), 1: ("bf16", 2)}
    usable(m)


def test_mesh_run_magic_and_name_hints(m: Mesh, script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert registry.peek_current() is m
    shell = magic_shell()
    assert shell.run_line_magic("mesh", f"run --ranks 0,1 {script} --status 0") == {0: 0, 1: 0}
    assert f"[rank1]: argv=[{str(script)!r}, '--status', '0']" in capsys.readouterr().out
    # Quotes work as in the shell torchrun runs from: they group words and go away.
    assert shell.run_line_magic("mesh", f"run --ranks '0,1' {script} --message 'two words' --backend=\"gloo\"") \
        == {0: 0, 1: 0}
    assert f"[rank1]: argv=[{str(script)!r}, '--message', 'two words', '--backend=gloo']" in capsys.readouterr().out
    with pytest.raises(UsageError, match="%mesh run: no script"):
        shell.run_line_magic("mesh", "run does_not_exist.py --x")
    shell.user_ns.update(model_in_notebook=[1, 2, 3], np_in_notebook=textwrap, lock_in_notebook=__import__(
        "threading").Lock())
    for name, hint in (("model_in_notebook", "%mesh push model_in_notebook"),
                       ("np_in_notebook", "import it in the cell (import textwrap as np_in_notebook)"),
                       ("lock_in_notebook", "cannot be sent to the ranks")):
        with pytest.raises(MeshError) as info:
            shell.run_cell_magic("mesh", "--no-widget", f"len({name})")
        assert hint in info.value.hint, info.value.hint
        assert "hint: " in "\n".join(info.value._render_traceback_())
    with pytest.raises(MeshError) as info:
        shell.run_cell_magic("mesh", "--no-widget", "undefined_everywhere_xyz")
    assert "hint" not in info.value.hint
    usable(m)
