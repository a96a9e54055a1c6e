"""Declared dependencies: every third-party import of the package is declared with a floor, the floors pin
(scripts/floors.py), and an old ipykernel is named when the extension loads."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("floors", ROOT / "scripts" / "floors.py")
assert _spec is not None and _spec.loader is not None
floors = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(floors)

# Top-level modules of the package's own distributions, and the distribution that provides each import name
# where the two differ.
OWN = {"monarch", "monarch_jupyter", "monarch_worker", "_monarch_jupyter_hook"}
# pydevd and pydevd_tracing: the copy of pydevd that debugpy vendors (importable once debugpy is imported).
DISTRIBUTION = {"zmq": "pyzmq", "IPython": "ipython", "pydevd": "debugpy", "pydevd_tracing": "debugpy"}
# Extras for working on the project, not for using it: an import of the package is never declared by these alone.
DEVELOPMENT_EXTRAS = {"test", "notebooks", "bench", "frameworks", "lint", "docs"}


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def third_party_imports() -> dict[str, list[str]]:
    """Top-level names the package's source imports (at any depth, lazy imports included) that are neither the
    standard library nor its own, each with the files that import it."""
    found: dict[str, list[str]] = {}
    for folder in ("monarch_jupyter", "worker", "shim"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in OWN and top != "__future__":
                        found.setdefault(top, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_import_of_the_package_is_a_declared_dependency() -> None:
    """A dependency, or a requirement of an extra for users (an optional integration, imported only there)."""
    extras = project().get("optional-dependencies", {})
    texts = project()["dependencies"] + [r for name, reqs in extras.items() if name not in DEVELOPMENT_EXTRAS
                                         for r in reqs]
    declared = {canonicalize_name(Requirement(r).name) for r in texts}
    imports = third_party_imports()
    assert {"torch", "numpy", "zmq", "IPython"} <= imports.keys()  # the scan sees lazy imports too
    missing = {name: files for name, files in imports.items()
               if canonicalize_name(DISTRIBUTION.get(name, name)) not in declared}
    assert not missing, f"imported but not declared in [project] dependencies of pyproject.toml: {missing}"


def test_every_runtime_dependency_states_a_floor_and_the_floors_pin() -> None:
    pins = floors.constraints(extras=("test",), build=True)
    pinned = {line.split("==")[0] for line in pins}
    for text in project()["dependencies"]:
        req = Requirement(text)
        assert floors.floor(req) is not None, f"{text}: no floor"
        assert f"{canonicalize_name(req.name)}=={floors.floor(req)}" in pins
    assert {"torch", "numpy", "ipykernel", "pytest", "setuptools"} <= pinned
    assert "tqdm" not in pinned  # an extra's requirement without a floor claims nothing


def test_floors_refuses_a_runtime_dependency_without_floor(tmp_path: Path) -> None:
    toml = tmp_path / "pyproject.toml"
    toml.write_text('[build-system]\nrequires = ["setuptools>=77"]\n'
                    '[project]\nname = "x"\ndependencies = ["numpy>=1.24", "torch"]\n'
                    '[project.optional-dependencies]\ntest = ["pytest>=8", "tqdm"]\n')
    with pytest.raises(ValueError, match="'torch' states no floor"):
        floors.constraints(toml)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "floors.py"), "--pyproject", str(toml)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "'torch' states no floor" in out.stderr
    toml.write_text(toml.read_text().replace('"torch"', '"torch>=2.4; python_version < \'3\'"'))
    assert floors.constraints(toml, extras=("test",)) == ["numpy==1.24", "pytest==8"]


@pytest.mark.parametrize(("version", "noted"), [((6, 28, 0), True), ((6, 29, 0), False), ((7, 4, 0), False)])
def test_an_old_ipykernel_is_named_with_the_fix(
        monkeypatch: pytest.MonkeyPatch, version: tuple[int, ...], noted: bool) -> None:
    from monarch_jupyter.magics import _check_ipykernel

    fake = SimpleNamespace(version_info=version, __version__=".".join(map(str, version)))
    monkeypatch.setitem(sys.modules, "ipykernel", fake)
    note = _check_ipykernel()
    if noted:
        assert note is not None and "ipykernel 6.28.0" in note and "pip install 'ipykernel>=6.29'" in note
    else:
        assert note is None
    monkeypatch.delitem(sys.modules, "ipykernel")
    assert _check_ipykernel() is None  # not in a kernel: nothing to say
