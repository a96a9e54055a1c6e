"""The shape of the code (issues: controller redesign, concurrency): modules readable in one sitting, no import
cycles (imports inside functions and under ``if TYPE_CHECKING:`` count), no reaching into another module's
underscore names, no mixins."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"monarch_jupyter": ROOT / "monarch_jupyter", "monarch_worker": ROOT / "worker"}
SHIM = ROOT / "shim"  # top-level modules: `monarch` (for %load_ext monarch) and its start-up hook
MAX_LINES = 600
FACADE_MAX_LINES = 450  # kernel/mesh.py, the Mesh façade: "about 400"


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [pkg, *rel.parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    for path in SHIM.glob("*.py"):
        out[path.stem] = path
    return out


MODULES = modules()


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, tree: ast.Module) -> tuple[set[str], set[str]]:
    """Project modules that module ``name`` imports anywhere (functions and ``if TYPE_CHECKING:`` too: a cycle
    hidden from the interpreter is still a cycle for the reader), and the packages whose ``__init__`` it takes
    names from (``from .. import Mesh``: it runs that package's imports, not only its own submodule's)."""
    is_pkg = MODULES[name].name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found: set[str] = set()
    names_from: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            for alias in node.names:  # "from . import x" imports the module x; anything else is a name of mod
                found.add(f"{mod}.{alias.name}")
                if f"{mod}.{alias.name}" not in MODULES:
                    names_from.add(mod)
    return {m for m in found if m in MODULES and m != name}, {m for m in names_from if m in MODULES}


def _parents(mod: str) -> set[str]:
    parts = mod.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))} & set(MODULES)


def test_modules_are_readable_in_one_sitting() -> None:
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
    facade = len((ROOT / "monarch_jupyter/kernel/mesh.py").read_text().splitlines())
    assert facade <= FACADE_MAX_LINES, f"kernel/mesh.py (the Mesh façade) has {facade} lines"


def test_no_import_cycles() -> None:
    found = {name: _imports(name, ast.parse(path.read_text())) for name, path in MODULES.items()}
    # A module also runs its packages' __init__ when imported; an __init__ that imports its own submodules back is
    # fine (Python handles it), so edges into a module's own parent packages are dropped, unless the module takes
    # names from that __init__ (then it depends on everything the package imports).
    graph = {name: {m for m in deps if m not in _parents(name) or m in names_from}
             for name, (deps, names_from) in found.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def dfs(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep):], dep])
            elif dep not in state:
                dfs(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            dfs(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


# Private names of other packages the code uses on purpose, each for a reason given where it is used.
ALLOWED_PRIVATE = {
    "sys._current_frames", "sys._getframe", "os._exit",  # the stdlib's documented functions
    "dist.distributed_c10d._abort_process_group",  # the only way to abort NCCL communicators (torch has no public)
    "c10d._dump_fr_trace_json",  # torch's flight recorder dump
    "c10d._world",  # torch's table of process groups (pg_names; no public list): their ranks, for the recorder's names
    "pub._hooks",  # ipykernel's display hooks (ipywidgets' Output capture), run as ipykernel's publish() does
    # A process group's own count of the operations issued on it: the release decision where the flight recorder
    # has nothing (gloo before torch 2.8); present in every torch the package supports.
    "pg._get_sequence_number_for_group",
    # accelerate's own reset of its per-process singletons (its tests call them between runs): a fresh %mesh run.
    "state.AcceleratorState._reset_state", "state.GradientState._reset_state",
}
# Lightning names its launcher API with underscores; a third-party strategy must use it (as Ray's does).
LIGHTNING_PRIVATE = {
    "_Launcher",  # the launcher base a strategy's launcher implements
    "_GlobalStateSnapshot",  # what Lightning's spawn launcher ships to keep the notebook's seeds
    "_MultiProcessingLauncher",  # Fabric.launch() raises its TypeError for these: MeshFabricLauncher registers with it
    "_interrupt", "_teardown",  # what Lightning's _call_and_handle_interrupt calls on an interrupt
    "_set_world_ranks",  # Lightning < 2.6 spelling of set_world_ranks
    "_version",  # torch's tensor version counter and a Lightning logger's version (kept across fits)
    "_batches_that_stepped",  # the fit loop's count of optimizer steps: global_step after an interrupt
}


def _own_private_names(tree: ast.Module) -> set[str]:
    """Underscore names this module defines itself (functions, classes, attributes it assigns)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if n.startswith("_")}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_reaching_into_other_modules_underscore_names(name: str) -> None:
    tree = ast.parse(MODULES[name].read_text())
    own = _own_private_names(tree)
    own_classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in PACKAGES):
            bad += [f"from {node.module} import {a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            if node.attr.endswith("_"):  # IPython's _repr_*_ protocol
                continue
            # This module's own private names, on its own objects only: self, cls, or a class it defines. The same
            # name on another object (``other._lock``) is a reach into that object, whatever this module calls its
            # own attributes.
            if node.attr in own and (not isinstance(base, ast.Attribute) and (
                    not isinstance(base, ast.Name) or base.id in ("self", "cls") or base.id in own_classes)):
                continue
            if name.startswith("monarch_jupyter.lightning") and node.attr in LIGHTNING_PRIVATE:
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            text = ast.unparse(node)
            if text in ALLOWED_PRIVATE or any(text.startswith(a + ".") for a in ALLOWED_PRIVATE):
                continue
            bad.append(f"line {node.lineno}: {text}")
    assert not bad, f"{name} reaches into underscore names: {bad}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_mixins(name: str) -> None:
    tree = ast.parse(MODULES[name].read_text())
    mixins = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and "Mixin" in n.name]
    assert not mixins, f"{name} defines mixins: {mixins}"


RECORD_OWNERS = {"monarch_jupyter.kernel.cells", "monarch_jupyter.kernel.records"}
RECORD_NAMES = {"rec", "cell", "target"}  # what the controller calls a CellRecord where it holds one
MUTATORS = {"add", "update", "pop", "clear", "append", "extend", "remove", "discard", "setdefault", "popleft"}


def _record_base(node: ast.AST) -> bool:
    """``node`` is a cell record: a name the controller gives records, or ``<x>.record`` (a handle's record)."""
    return (isinstance(node, ast.Name) and node.id in RECORD_NAMES) or (
        isinstance(node, ast.Attribute) and node.attr == "record")


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith(("monarch_jupyter.kernel",
                                                                             "monarch_jupyter.lightning"))
                                         and n not in RECORD_OWNERS))
def test_only_the_cell_table_changes_cell_records(name: str) -> None:
    """Issue 25: every change of a cell's state is a CellTable method; other modules read records, never write them
    (an assignment to a record's field, to an item of one, or a mutating call on one)."""
    tree = ast.parse(MODULES[name].read_text())
    bad = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            while isinstance(t, ast.Subscript):
                t = t.value
            if isinstance(t, ast.Attribute) and _record_base(t.value):
                bad.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and _record_base(owner.value):
                bad.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    assert not bad, f"{name} changes cell records outside the cell table: {bad}"


# Calls that write, send, sign, verify, (un)pickle or wait for another thread: never inside the mesh lock.
IO_CALLS = {"write_lines", "print", "write", "flush", "send_to", "send_frames", "pack", "unpack", "loads", "dumps",
            "ask", "publish", "_write", "_send", "_send_all"}


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("monarch_jupyter.kernel")))
def test_nothing_is_written_or_sent_under_the_mesh_lock(name: str) -> None:
    """Issue 25: in a ``with ....lock:`` (or ``.cond``) block of the controller, no stdout write, socket send,
    HMAC signature or check, pickling, or wait for another thread: verify first, then lock, change, unlock, then
    write (lines nobody waits for are queued to the OutputWriter, output.py)."""
    bad = []
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if not isinstance(node, ast.With) or not any(
                ast.unparse(i.context_expr).endswith((".lock", ".cond")) for i in node.items):
            continue
        for sub in ast.walk(ast.Module(body=node.body, type_ignores=[])):
            if isinstance(sub, ast.Call):
                f = sub.func
                called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if called in IO_CALLS:
                    bad.append(f"line {sub.lineno}: {ast.unparse(sub)[:80]}")
    assert not bad, f"{name} does I/O under the lock: {bad}"
