"""Every option is declared once (monarch_worker/options.py); Mesh's keyword arguments, MeshMagics' traitlets, what
ranks are sent and docs/configuration.md all follow that declaration."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from monarch_jupyter import Mesh
from monarch_jupyter.kernel import config
from monarch_jupyter.magics import MeshMagics
from monarch_worker.config import RankConfig
from monarch_worker.options import RANK_SETTINGS, MeshOptions, NotebookOptions, option_fields, rank_settings

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_docs_are_generated_from_the_declaration() -> None:
    on_disk = (ROOT / "docs" / "configuration.md").read_text()
    assert on_disk == config.options_markdown(), (
        "docs/configuration.md is stale: regenerate it with the command in its first comment")


def test_mesh_keywords_and_attributes_are_the_declared_options() -> None:
    params = inspect.signature(Mesh).parameters
    for f in option_fields(MeshOptions):
        assert f.name in params and params[f.name].kind is inspect.Parameter.KEYWORD_ONLY
        default = {} if f.default is dataclasses.MISSING else f.default
        assert params[f.name].default == default, f.name
    m = Mesh(2, start=False, interrupt_grace=2.5)
    assert m.interrupt_grace == 2.5 and m.options.interrupt_grace == 2.5
    m.interrupt_grace = 1
    assert m.options.interrupt_grace == 1
    with pytest.raises(ValueError, match="interrupt_grace takes a number"):
        m.interrupt_grace = "soon"


def test_bad_options_name_the_option() -> None:
    with pytest.raises(TypeError, match="unknown option.*start_timout.*start_timeout"):
        Mesh(2, start=False, start_timout=3)
    with pytest.raises(ValueError, match="option backend must be one of auto, gloo, nccl"):
        Mesh(2, start=False, backend="mpi")
    with pytest.raises(ValueError, match="option heartbeat_timeout takes a number >= 0 \\(s\\)"):
        Mesh(2, start=False, heartbeat_timeout=-1)


def test_magics_traitlets_are_the_declared_options() -> None:
    traits = MeshMagics.class_traits(config=True)
    declared = {f.metadata["trait"]: f for cls in (MeshOptions, NotebookOptions) for f in option_fields(cls)
                if f.metadata["trait"]}
    assert set(traits) == set(declared)
    for name, f in declared.items():
        expected = f.default if f.default is not None else traits[name].default_value
        assert traits[name].default_value == expected, name
        assert f.metadata["help"] in traits[name].help


def test_magics_traitlets_refuse_negative_numbers_as_the_options_do() -> None:
    """``%config MeshMagics.output_lines = -1`` was taken (a fresh user saw a wrong count of lines not kept after
    it); numeric traitlets take what ``check_value`` takes: numbers >= 0."""
    from traitlets import TraitError

    magics = MeshMagics()
    for name in ("output_lines", "dashboard_fold", "cell_timeout", "listen_timeout"):
        with pytest.raises(TraitError, match=name):
            setattr(magics, name, -1)
    magics.output_lines = 10
    assert magics.output_lines == 10


def test_ranks_are_sent_the_declared_settings_with_their_defaults() -> None:
    fields = {f.name: f for f in dataclasses.fields(RankConfig)}
    defaults = MeshOptions()
    for rank_field, option in RANK_SETTINGS.items():
        assert rank_field in fields, rank_field
        f = fields[rank_field]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        assert default == getattr(defaults, option), rank_field
    sent = rank_settings(MeshOptions(pg_timeout=12.0, env={"A": "1"}))
    assert sent["pg_timeout"] == 12.0 and sent["env"] == {"A": "1"} and sent["join_timeout"] == 60.0


@pytest.mark.parametrize("bad, error, words", [
    (0, ValueError, "above 0 seconds"), (-1, ValueError, "above 0 seconds"),
    (float("nan"), ValueError, "above 0 seconds"), (float("inf"), ValueError, "a finite number of seconds"),
    ("5", TypeError, "a number of seconds"), (True, TypeError, "a number of seconds")])
def test_a_call_timeout_that_is_not_seconds_is_refused(bad: object, error: type, words: str) -> None:
    with pytest.raises(error, match=words) as caught:
        config.check_timeout(bad)
    assert "None" in str(caught.value)  # how to ask for no limit


def test_a_call_timeout_of_seconds_passes() -> None:
    assert config.check_timeout(None) is None and config.check_timeout(2) == 2.0 and config.check_timeout(0.5) == 0.5
    assert config.check_timeout(0, zero=True) == 0.0  # handle.wait(0): look once
