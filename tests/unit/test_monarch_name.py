"""The `monarch` name in one process: which module `import monarch` gets and what `%load_ext monarch` then does.

The start-up hook (shim/_monarch_jupyter_hook.py) runs here against fake `monarch` packages in temporary folders,
with every other finder of `monarch` removed; tests/packaging/test_monarch_installs.py does the same with real
installs and uninstalls in throwaway venvs.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SHIM_DIR = Path(__file__).resolve().parents[2] / "shim"


@pytest.fixture
def hook(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """A fresh copy of the hook, installed in a sys.meta_path and sys.path that find `monarch` only in
    SHIM_DIR and the folders a test adds."""
    if not (SHIM_DIR / "_monarch_jupyter_hook.py").exists():
        pytest.skip(f"no {SHIM_DIR} (tests run outside a checkout or an sdist)")
    for name in [n for n in sys.modules if n == "monarch" or n.startswith("monarch.")]:
        monkeypatch.delitem(sys.modules, name)
    frozen = ("_frozen_importlib", "_frozen_importlib_external")  # BuiltinImporter, FrozenImporter, PathFinder
    plain = [f for f in sys.meta_path if getattr(f, "__module__", "") in frozen]
    monkeypatch.setattr(sys, "meta_path", plain)
    stdlib = [p for p in sys.path if p and "site-packages" not in p and Path(p).resolve() != Path.cwd().resolve()]
    monkeypatch.setattr(sys, "path", [*stdlib, str(SHIM_DIR)])
    spec = importlib.util.spec_from_file_location("_monarch_jupyter_hook_under_test",
                                                  SHIM_DIR / "_monarch_jupyter_hook.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # installs its finder first in the (patched) sys.meta_path
    importlib.invalidate_caches()
    yield module
    for name in [n for n in sys.modules if n == "monarch" or n.startswith("monarch.")]:
        del sys.modules[name]


# Like PyTorch Monarch's monarch/__init__.py: a lazy public API behind a module __getattr__.
TORCHMONARCH_INIT = """OWNER = 'torchmonarch'
def __getattr__(name):
    raise AttributeError(f"module 'monarch' has no attribute {name!r}")
"""


def fake_monarch(folder: Path, body: str = TORCHMONARCH_INIT) -> Path:
    """A stand-in for PyTorch Monarch's package: folder/monarch/__init__.py (and a submodule)."""
    pkg = folder / "monarch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(body)
    (pkg / "actor.py").write_text("NAME = 'actor'\n")
    return pkg


def test_without_another_monarch_import_monarch_is_the_shim(hook: ModuleType) -> None:
    import monarch

    assert Path(monarch.__file__) == SHIM_DIR / "monarch.py"
    assert monarch.load_ipython_extension.__module__ == "monarch"
    with pytest.raises(AttributeError, match="PyTorch Monarch is not installed here. Fix: pip install torchmonarch"):
        monarch.actor  # noqa: B018
    with pytest.raises(ModuleNotFoundError, match="'monarch.actor': .* Fix: pip install torchmonarch"):
        import monarch.actor  # noqa: F401


def test_hook_installs_one_finder_and_ignores_other_names(hook: ModuleType) -> None:
    hook.install()
    hook.install()
    finders = [f for f in sys.meta_path if getattr(f, "monarch_jupyter_finder", False)]
    assert len(finders) == 1 and sys.meta_path[0] is finders[0]
    assert finders[0].find_spec("json") is None
    assert finders[0].find_spec("monarch.actor", None) is None


@pytest.mark.parametrize("where", ["before", "after"])
def test_another_monarch_wins_from_any_folder_and_gets_the_extension(
        hook: ModuleType, tmp_path: Path, where: str) -> None:
    fake_monarch(tmp_path)
    if where == "before":
        sys.path.insert(0, str(tmp_path))
    else:  # where plain Python would find the shim first
        sys.path.append(str(tmp_path))
    import monarch
    import monarch.actor

    assert monarch.__file__ == str(tmp_path / "monarch" / "__init__.py")
    assert monarch.OWNER == "torchmonarch" and monarch.actor.NAME == "actor"  # its code works as before
    assert monarch.load_ipython_extension is hook.load_ipython_extension
    assert monarch.unload_ipython_extension is hook.unload_ipython_extension
    assert type(monarch.__loader__).__name__ == "SourceFileLoader"  # its loader, patched on that instance only


def test_another_monarch_with_its_own_extension_is_left_alone(hook: ModuleType, tmp_path: Path) -> None:
    fake_monarch(tmp_path, "def load_ipython_extension(ip):\n    return 'theirs'\n")
    sys.path.insert(0, str(tmp_path))
    import monarch

    assert monarch.load_ipython_extension(None) == "theirs"
    assert not hasattr(monarch, "unload_ipython_extension")


def test_added_extension_says_why_and_loads_monarch_jupyter(
        hook: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import monarch_jupyter

    calls: list[Any] = []
    monkeypatch.setattr(monarch_jupyter, "load_ipython_extension", calls.append)
    fake_monarch(tmp_path)
    sys.path.insert(0, str(tmp_path))
    import monarch

    shell = object()
    monarch.load_ipython_extension(shell)
    assert calls == [shell]
    err = capsys.readouterr().err
    assert str(tmp_path / "monarch" / "__init__.py") in err
    assert "PyTorch Monarch" in err and "%load_ext monarch_jupyter" in err


def test_another_monarch_that_fails_to_import_names_the_way_out(hook: ModuleType, tmp_path: Path) -> None:
    fake_monarch(tmp_path, "raise ImportError('libmonarch_rust.so: cannot open shared object file')\n")
    sys.path.insert(0, str(tmp_path))
    with pytest.raises(ImportError, match="libmonarch_rust") as info:
        import monarch  # noqa: F401
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "%load_ext monarch_jupyter" in notes and str(tmp_path / "monarch" / "__init__.py") in notes


def test_a_leftover_folder_without_init_does_not_hide_the_shim(hook: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "monarch" / "__pycache__").mkdir(parents=True)  # what an uninstall can leave behind
    sys.path.insert(0, str(tmp_path))
    import monarch

    assert Path(monarch.__file__) == SHIM_DIR / "monarch.py"
