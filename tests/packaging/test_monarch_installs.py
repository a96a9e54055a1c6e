"""The `monarch` name across real installs: monarch-jupyter's wheel and a stand-in for PyTorch Monarch
(``torchmonarch``, a tiny distribution that ships ``monarch/__init__.py`` and ``monarch/actor.py``, as the real one
does) installed, upgraded and uninstalled with pip in every order, in one throwaway venv. After each step a
fresh interpreter, started outside the checkout, reports what ``import monarch`` gives and what
``%load_ext monarch`` and ``%load_ext monarch_jupyter`` do in IPython.

The venv has only what loading the extension imports: IPython, pyzmq and cloudpickle (torch is imported by the
fork server, which is not started here), so it costs seconds, not gigabytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .conftest import Dists, run

pytestmark = pytest.mark.slow

TORCHMONARCH_INIT = '''VERSION = {version!r}
OWNER = "torchmonarch"
def __getattr__(name):  # PyTorch Monarch's public API is lazy, behind a module __getattr__
    raise AttributeError(f"module 'monarch' has no attribute {{name!r}}")
'''

# What earlier monarch-jupyter builds shipped as monarch/__init__.py: the same path as PyTorch Monarch's.
OLD_SHIM = '''def load_ipython_extension(ipython):
    from monarch_jupyter import load_ipython_extension as load
    load(ipython)
'''

REPORT = textwrap.dedent('''
    import contextlib, io, json
    out = {}
    try:
        import monarch
        out["file"] = monarch.__file__
        out["owner"] = getattr(monarch, "OWNER", None)
        out["version"] = getattr(monarch, "VERSION", None)
        out["has_ext"] = hasattr(monarch, "load_ipython_extension")
    except Exception as e:
        out["import_error"] = f"{type(e).__name__}: {e} {getattr(e, '__notes__', '')}"
    try:
        import monarch.actor
        out["actor"] = "ok"
    except Exception as e:
        out["actor"] = f"{type(e).__name__}: {e}"
    try:
        from IPython.core.interactiveshell import InteractiveShell
        ip = InteractiveShell.instance()
        ip.config.MeshMagics.prewarm = False  # no fork server: torch is not installed here
        for name in ("monarch", "monarch_jupyter"):
            stdout, stderr = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                try:
                    ip.run_line_magic("load_ext", name)
                except Exception as e:
                    print(f"{type(e).__name__}: {e}", getattr(e, "__notes__", ""))
            out[name] = {"magics": "mesh" in ip.magics_manager.magics["cell"],
                         "said": stdout.getvalue() + stderr.getvalue()}
            if out[name]["magics"]:
                ip.run_line_magic("unload_ext", name)
    except ImportError as e:
        out["ipython_error"] = str(e)
    print("REPORT" + json.dumps(out))
''')


@dataclass
class Venv:
    root: Path
    wheel: Path
    fakes: dict[str, Path]

    @property
    def python(self) -> str:
        return str(self.root / "bin" / "python")

    @property
    def site(self) -> Path:
        return next((self.root / "lib").glob("python3*/site-packages"))

    def pip(self, *args: str) -> None:
        run([self.python, "-m", "pip", *args, "-q", "--disable-pip-version-check"])

    def install(self, what: str, *flags: str) -> None:
        """Install "us" (this checkout's wheel) or a fake distribution, never with dependencies."""
        self.pip("install", "--no-deps", *flags, str(self.wheel if what == "us" else self.fakes[what]))

    def uninstall(self, *dists: str) -> None:
        self.pip("uninstall", "-y", *dists)

    def report(self) -> dict[str, Any]:
        done = subprocess.run([self.python, "-c", REPORT], cwd=self.root, capture_output=True, text=True,
                              timeout=120)
        line = [x for x in done.stdout.splitlines() if x.startswith("REPORT")]
        assert line, f"no report (exit {done.returncode})\n{done.stdout}\n{done.stderr}"
        return json.loads(line[-1][len("REPORT"):])

    # What each state looks like from the inside.

    def expect_ours(self) -> None:
        r = self.report()
        assert r.get("file") == str(self.site / "monarch.py"), r
        assert r["has_ext"] and r["monarch"] == {"magics": True, "said": ""}, r
        assert r["monarch_jupyter"]["magics"], r
        assert "Fix: pip install torchmonarch" in r["actor"], r

    def expect_theirs(self, version: str, hooked: bool) -> None:
        """PyTorch Monarch's package, intact; with our hook, `%load_ext monarch` loads monarch-jupyter and says why."""
        r = self.report()
        assert r.get("file") == str(self.site / "monarch" / "__init__.py"), r
        assert (r["owner"], r["version"], r["actor"]) == ("torchmonarch", version, "ok"), r
        assert r["has_ext"] is hooked, r
        if hooked:
            said = r["monarch"]["said"]
            assert r["monarch"]["magics"], r
            assert "PyTorch Monarch" in said and str(self.site / "monarch" / "__init__.py") in said, said
            assert "from torchmonarch" in said and "%load_ext monarch_jupyter" in said, said
            assert r["monarch_jupyter"] == {"magics": True, "said": ""}, r
        else:  # monarch-jupyter is not installed: nothing of ours is left to run
            assert not r["monarch"]["magics"] and not (self.site / "_monarch_jupyter_hook.py").exists(), r

    def expect_nothing(self) -> None:
        r = self.report()
        assert r.get("import_error", "").startswith("ModuleNotFoundError: No module named 'monarch'"), r
        left = [p.name for p in self.site.iterdir() if p.name.startswith(("monarch", "_monarch"))]
        assert left == [], left


def fake_dist(python: str, folder: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """Build (with ``python``'s setuptools) a wheel of a one-package distribution ``name`` with ``files``."""
    src = folder / f"{name}-{version}"
    for rel, text in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    (src / "pyproject.toml").write_text(textwrap.dedent(f'''
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{name}"
        version = "{version}"
        [tool.setuptools]
        packages = ["monarch"]
    '''))
    run([python, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(folder), str(src)])
    (wheel,) = folder.glob(f"{name.replace('-', '_')}-{version}-*.whl")
    return wheel


@pytest.fixture(scope="module")
def venv(dists: Dists, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    folder = tmp_path_factory.mktemp("monarch-installs")
    v = Venv(folder / "venv", dists.wheel, {})
    run([sys.executable, "-m", "venv", str(v.root)])
    # What loading the extension imports (torch, numpy and widgets are imported later, the fork server is not
    # started), and what builds the fakes.
    v.pip("install", "ipython", "pyzmq", "cloudpickle", "setuptools>=70.1")
    actor = {"monarch/actor.py": "NAME = 'actor'\n"}
    for key, name, version, files in [
            ("tm1", "torchmonarch", "1.0", {"monarch/__init__.py": TORCHMONARCH_INIT.format(version="1.0"), **actor}),
            ("tm2", "torchmonarch", "2.0", {"monarch/__init__.py": TORCHMONARCH_INIT.format(version="2.0"), **actor}),
            ("old", "monarch-jupyter", "0.0.1", {"monarch/__init__.py": OLD_SHIM})]:
        v.fakes[key] = fake_dist(v.python, folder, name, version, files)
    return v


@pytest.fixture
def clean(venv: Venv) -> Iterator[Venv]:
    venv.uninstall("monarch-jupyter", "torchmonarch")
    yield venv


def test_us_then_torchmonarch_then_uninstall_torchmonarch_first(clean: Venv) -> None:
    v = clean
    v.install("us")
    v.expect_ours()
    v.install("tm1")
    v.expect_theirs("1.0", hooked=True)
    v.uninstall("torchmonarch")
    v.expect_ours()
    v.uninstall("monarch-jupyter")
    v.expect_nothing()


def test_us_then_torchmonarch_then_uninstall_us_first(clean: Venv) -> None:
    v = clean
    v.install("us")
    v.install("tm1")
    v.expect_theirs("1.0", hooked=True)
    v.uninstall("monarch-jupyter")
    v.expect_theirs("1.0", hooked=False)
    v.uninstall("torchmonarch")
    v.expect_nothing()


def test_torchmonarch_then_us_then_uninstall_us_first(clean: Venv) -> None:
    v = clean
    v.install("tm1")
    v.expect_theirs("1.0", hooked=False)
    v.install("us")
    v.expect_theirs("1.0", hooked=True)
    v.uninstall("monarch-jupyter")
    v.expect_theirs("1.0", hooked=False)
    v.uninstall("torchmonarch")
    v.expect_nothing()


def test_torchmonarch_then_us_then_uninstall_torchmonarch_first(clean: Venv) -> None:
    v = clean
    v.install("tm1")
    v.install("us")
    v.uninstall("torchmonarch")
    v.expect_ours()
    v.uninstall("monarch-jupyter")
    v.expect_nothing()


def test_upgrading_either_keeps_both_working(clean: Venv) -> None:
    v = clean
    v.install("us")
    v.install("tm1")
    v.install("tm2", "--upgrade")
    v.expect_theirs("2.0", hooked=True)
    v.install("us", "--force-reinstall")
    v.expect_theirs("2.0", hooked=True)
    v.uninstall("torchmonarch")
    v.expect_ours()
    v.uninstall("monarch-jupyter")
    v.expect_nothing()


def test_upgrade_from_a_release_that_shipped_monarch_init_names_the_fix(clean: Venv) -> None:
    """Earlier builds shipped monarch/__init__.py; torchmonarch installed after one overwrote that file, and
    replacing the old build removes it (it is in the old build's RECORD). `%load_ext monarch` still works, and PyTorch
    Monarch's users are told the one command that restores its file."""
    v = clean
    v.install("old")
    v.install("tm1")
    v.install("us")  # upgrade: pip uninstalls 0.0.1, taking torchmonarch's monarch/__init__.py with it
    r = v.report()
    assert r.get("file") == str(v.site / "monarch.py") and r["monarch"]["magics"], r
    assert "torchmonarch 1.0 is installed" in r["actor"], r
    assert "Fix: pip install --force-reinstall --no-deps torchmonarch" in r["actor"], r
    v.install("tm1", "--force-reinstall")  # the fix it names
    v.expect_theirs("1.0", hooked=True)
    v.uninstall("torchmonarch", "monarch-jupyter")
    v.expect_nothing()
