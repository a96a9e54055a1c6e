"""``%mesh SUBCOMMAND --help`` (and ``-h``, and ``%%mesh --help``) prints that subcommand's options and does nothing
else: IPython builds magic_arguments parsers without -h, so without this a user got "unrecognized arguments:
--help. Run %mesh start --help for the options". After a script's name, --help is the script's own."""

from __future__ import annotations

import pytest

from monarch_jupyter.kernel import registry
from monarch_jupyter.magics import SUBCOMMANDS, MeshMagics
from monarch_jupyter.magics import scripts as script_magics
from tests.conftest import magic_shell


@pytest.mark.parametrize("sub", SUBCOMMANDS)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_subcommand_prints_its_options(sub: str, flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    shell = magic_shell()
    before = registry.peek_current()
    assert shell.run_line_magic("mesh", f"{sub} {flag}") is None  # type: ignore[attr-defined]
    out = capsys.readouterr().out
    assert f"%mesh {sub}" in out, out
    assert "unrecognized" not in out and "arguments are required" not in out
    assert "Raises" not in out and "------" not in out, out  # the docstring's sections are not help
    assert registry.peek_current() is before  # nothing started or stopped


def test_the_cell_magic_prints_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    shell = magic_shell()
    assert shell.run_cell_magic("mesh", "--help", "raise AssertionError('the cell must not run')") is None  # type: ignore[attr-defined]
    out = capsys.readouterr().out
    assert out.startswith("usage: %%mesh") and "--ranks" in out


@pytest.mark.parametrize("flag", ["--help", "-h", "help"])
def test_the_line_magic_alone_prints_the_subcommands_and_the_cell_magics_options(
        flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """IPython refuses ``%%mesh --help`` alone in a cell (a cell magic needs a body), so ``%mesh --help`` is where
    the cell magic's errors send the user: the subcommands and the cell magic's options."""
    from IPython.core.error import UsageError

    shell = magic_shell()
    assert shell.run_line_magic("mesh", flag) is None  # type: ignore[attr-defined]
    out = capsys.readouterr().out
    assert "start" in out and "scale" in out and "usage: %%mesh" in out and "--ranks" in out, out
    magics = shell.magics_manager.registry["MeshMagics"]  # type: ignore[attr-defined]
    with pytest.raises(UsageError, match=r"^%%mesh: .*Run  %mesh --help  for the options\.$"):
        magics.parse_args(magics._cell, "--no-such-option", None)


def test_help_after_a_script_name_is_the_scripts_own() -> None:
    magics = magic_shell().magics_manager.registry["MeshMagics"]  # type: ignore[attr-defined]
    assert isinstance(magics, MeshMagics)
    args = magics.parse_args(script_magics.run, "--ranks 0 train.py --help", "run")
    assert args.target == "train.py" and args.args == ["--help"]


def test_arguments_split_as_a_shell_splits_them_and_empty_ranks_are_refused() -> None:
    """Quotes group words and go away, as in the shell torchrun runs from (IPython's own splitting keeps them):
    %mesh run's script gets the argv ``python train.py ...`` would give it, --rank '2' is rank 2, and an empty
    rank selection is an error that says what to write, not a parse error quoting the quotes, nor every rank."""
    from IPython.core.error import UsageError

    from monarch_jupyter.magics import debug as debug_magics

    magics = magic_shell().magics_manager.registry["MeshMagics"]  # type: ignore[attr-defined]
    args = magics.parse_args(script_magics.run, "--ranks '0,2' args.py a 'b c' \"d e\" --msg='hi there' x\\ y",
                             "run")
    assert args.ranks == "0,2" and args.target == "args.py"
    assert args.args == ["a", "b c", "d e", "--msg=hi there", "x y"]
    assert magics.parse_args(script_magics.run, '--ranks "1-3" train.py', "run").ranks == "1-3"
    assert magics.parse_args(debug_magics.debug, "--rank '2' --commands \"p x; up\"", "debug").rank == 2
    assert magics.parse_args(debug_magics.debug, "--rank '2' --commands \"p x; up\"", "debug").commands == "p x; up"
    for empty in ("''", '""', "' '"):
        with pytest.raises(UsageError, match=r"%mesh run: the rank selection is empty; give ranks \(e.g. 0,2"):
            magics.parse_args(script_magics.run, f"--ranks {empty} train.py", "run")
    with pytest.raises(UsageError, match="cannot parse"):
        magics.parse_args(script_magics.run, "train.py 'unclosed", "run")


def test_mesh_select_in_a_cell_says_where_it_belongs() -> None:
    """``%mesh select R`` is the visual debugger's rank picker (kernel/dap.py), typed in its Evaluate dialog."""
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="Evaluate Code dialog while ranks are stopped"):
        magic_shell().run_line_magic("mesh", "select 1")  # type: ignore[attr-defined]
