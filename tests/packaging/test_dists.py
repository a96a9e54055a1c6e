"""What ``python -m build`` ships: the wheel holds the package and nothing else, its metadata states the license
and the dependencies of pyproject.toml, and the sdist holds what it needs to build and to run its tests."""

from __future__ import annotations

import sys
import tarfile
import tomllib
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from .conftest import ROOT, Dists, run

pytestmark = pytest.mark.slow

NAME = "monarch_jupyter-0.1.0"


def source_files(folder: str) -> set[str]:
    """Files under ``folder`` of the checkout, relative to it, without compiled or cached files."""
    base = ROOT / folder
    return {p.relative_to(base).as_posix() for p in base.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
            and ".egg-info" not in p.as_posix()}


def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def sdist_names(sdist: Path) -> set[str]:
    with tarfile.open(sdist) as t:
        return {m.name.split("/", 1)[1] for m in t.getmembers() if m.isfile()}


def metadata(wheel: Path) -> dict[str, list[str]]:
    with zipfile.ZipFile(wheel) as z:
        msg = HeaderParser().parsestr(z.read(f"{NAME}.dist-info/METADATA").decode())
    fields: dict[str, list[str]] = {}
    for key, value in msg.items():
        fields.setdefault(key, []).append(value)
    return fields


def test_wheel_holds_every_module_and_nothing_else(dists: Dists) -> None:
    def packages(folder: str, name: str) -> set[str]:
        return {f"{name}/{f}" for f in source_files(folder) if f.endswith((".py", "py.typed"))}

    expected = (packages("monarch_jupyter", "monarch_jupyter") | packages("worker", "monarch_worker")
                | {"monarch.py", "_monarch_jupyter_hook.py", "monarch_jupyter.pth"}
                | {f"{NAME}.dist-info/{f}" for f in ("METADATA", "WHEEL", "RECORD", "top_level.txt",
                                                      "licenses/LICENSE")})
    names = wheel_names(dists.wheel)
    assert names - expected == set(), "in the wheel but not expected"
    assert expected - names == set(), ("missing from the wheel (a new subpackage must be listed in "
                                       "[tool.setuptools] packages of pyproject.toml)")
    assert "monarch/__init__.py" not in names  # the file PyTorch Monarch ships: never ours again


def test_wheel_pth_imports_the_hook_and_the_license_is_spdx(dists: Dists) -> None:
    with zipfile.ZipFile(dists.wheel) as z:
        assert z.read("monarch_jupyter.pth").decode().split() == ["import", "_monarch_jupyter_hook"]
        assert z.read(f"{NAME}.dist-info/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    meta = metadata(dists.wheel)
    assert meta["License-Expression"] == ["BSD-3-Clause"] and meta["License-File"] == ["LICENSE"]
    assert "License" not in meta
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License")


def test_wheel_requires_what_pyproject_declares(dists: Dists) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    meta = metadata(dists.wheel)
    runtime = {str(Requirement(r)) for r in meta["Requires-Dist"] if "extra ==" not in r}
    assert runtime == {str(Requirement(r)) for r in project["dependencies"]}
    assert {"numpy", "ipykernel", "torch"} <= {Requirement(r).name for r in runtime}
    assert meta["Requires-Python"] == [project["requires-python"]]


def test_sdist_holds_the_sources_and_the_whole_test_suite(dists: Dists) -> None:
    names = sdist_names(dists.sdist)
    tests = {f"tests/{f}" for f in source_files("tests")}
    assert tests - names == set(), "test files missing from the sdist"
    assert {"tests/conftest.py", "tests/unit/test_protocol.py", "tests/integration/test_kernel.py"} <= names
    expected = (tests | {f"monarch_jupyter/{f}" for f in source_files("monarch_jupyter")}
                | {f"worker/{f}" for f in source_files("worker")} | {f"shim/{f}" for f in source_files("shim")}
                | {"LICENSE", "README.md", "pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in", "PKG-INFO",
                   "scripts/floors.py", "docs/configuration.md"})
    extra = {n for n in names - expected if not n.startswith("shim/monarch_jupyter.egg-info/")}
    assert extra == set(), "in the sdist but not expected"
    assert expected - names == set(), "missing from the sdist"


def test_tests_run_from_the_unpacked_sdist(dists: Dists, tmp_path: Path) -> None:
    with tarfile.open(dists.sdist) as t:
        t.extractall(tmp_path, filter="data")
    unpacked = tmp_path / NAME
    # These read pyproject.toml, shim/ and scripts/floors.py of the tree they run in: the sdist's.
    done = run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                "tests/unit/test_requirements.py", "tests/unit/test_monarch_name.py"], cwd=unpacked)
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout
