"""Lightning on the mesh: ``Trainer(strategy="mesh")`` and ``Fabric(strategy="mesh")`` from ordinary notebook cells.

::

    %load_ext monarch
    %mesh start -n 2
    trainer = Trainer(strategy="mesh", accelerator="cpu", devices=2, max_epochs=3)
    trainer.fit(model, datamodule=dm)      # DDP on the mesh's ranks; `model` holds the trained weights after

Loading the extension, or importing this module, registers the name ``"mesh"`` with Lightning's Trainer
strategy registry and with Fabric's, for ``lightning`` and for the standalone ``pytorch_lightning`` /
``lightning_fabric``: at once for those already imported, otherwise when they are imported (an import hook, so
that loading the extension never pays for importing Lightning). The classes (``MeshStrategy``,
``MeshFabricStrategy``, ``MeshEnvironment``, ``MeshLauncher``, ``MeshFabricLauncher``) come from ``lightning`` when
it is installed, else from ``pytorch_lightning``; ``monarch_jupyter.lightning.standalone`` has the latter's.

See docs/lightning.md.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import sys
import threading
from types import ModuleType
from typing import Any

from monarch_worker.hooks import after_import

from .errors import LightningVersionError, MeshLightningError, TrainingInterrupted, UnpicklableJobError

log = logging.getLogger(__name__)

__all__ = [
    "MeshStrategy",
    "MeshFabricStrategy",
    "MeshEnvironment",
    "MeshLauncher",
    "MeshFabricLauncher",
    "register",
    "check_version",
    "TESTED_VERSIONS",
    "MeshLightningError",
    "LightningVersionError",
    "UnpicklableJobError",
    "TrainingInterrupted",
]

TESTED_VERSIONS = ((2, 5), (2, 7))
"""Lightning releases ``strategy="mesh"`` was tested with: at least the first, below the second."""

_TOP = {"lightning": "lightning", "standalone": "pytorch_lightning"}
_PYTORCH = {"lightning": "lightning.pytorch", "standalone": "pytorch_lightning"}
_FABRIC = {"lightning": "lightning.fabric", "standalone": "lightning_fabric"}
_MODULES = {"lightning": "monarch_jupyter.lightning.unified", "standalone": "monarch_jupyter.lightning.standalone"}
_WATCHED = {_PYTORCH["lightning"]: ("lightning", "trainer"), _FABRIC["lightning"]: ("lightning", "fabric"),
            _PYTORCH["standalone"]: ("standalone", "trainer"), _FABRIC["standalone"]: ("standalone", "fabric")}
_registered: set[tuple[str, str]] = set()
_lock = threading.RLock()


def _version_of(family: str) -> str:
    top = sys.modules.get(_TOP[family]) or sys.modules.get(_FABRIC[family])
    version = getattr(top, "__version__", None)
    if version is None:
        from importlib import metadata

        for dist in (("lightning",) if family == "lightning" else ("pytorch-lightning", "lightning-fabric")):
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
        return "0"
    return str(version)


def _parse(version: str) -> tuple[int, int]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return ([*parts, 0, 0])[0], ([*parts, 0, 0])[1]


def check_version(family: str = "lightning") -> None:
    """Raise LightningVersionError when the installed Lightning of ``family`` is outside ``TESTED_VERSIONS``
    (``MONARCH_LIGHTNING_ANY_VERSION=1`` skips the check)."""
    if os.environ.get("MONARCH_LIGHTNING_ANY_VERSION") == "1":
        return
    version = _version_of(family)
    low, high = TESTED_VERSIONS
    if not low <= _parse(version) < high:
        package = "lightning" if family == "lightning" else "pytorch-lightning"
        raise LightningVersionError(
            f"strategy='mesh' is tested with Lightning {low[0]}.{low[1]} up to (not including) {high[0]}.{high[1]}; "
            f"this environment has {package} {version}. Install a tested release:  pip install "
            f"'{package}>={low[0]}.{low[1]},<{high[0]}.{high[1]}'  (or set MONARCH_LIGHTNING_ANY_VERSION=1 to try "
            "it anyway)")


def _classes(family: str) -> ModuleType:
    return importlib.import_module(_MODULES[family])


def _register_one(family: str, kind: str) -> bool:
    """Register "mesh" with one registry (its package must be imported). Returns True when it did."""
    with _lock:
        if (family, kind) in _registered:
            return False
        if kind == "trainer":
            registry = importlib.import_module(f"{_PYTORCH[family]}.strategies").StrategyRegistry
        else:
            registry = importlib.import_module(f"{_FABRIC[family]}.strategies").STRATEGY_REGISTRY
        try:
            check_version(family)
            cls = getattr(_classes(family), "MeshStrategy" if kind == "trainer" else "MeshFabricStrategy")
            cls.register_strategies(registry)
        except Exception as e:  # noqa: BLE001 - an unsupported Lightning: "mesh" explains itself when used
            log.debug("strategy 'mesh' unavailable for %s %s: %s", family, kind, e)
            registry.register("mesh", _Unavailable(family, e), description="(unavailable: see its error)",
                              override=True)
        _registered.add((family, kind))
    try:
        from .reports import install_ddp_hint

        install_ddp_hint()  # in a notebook: strategy="ddp" gets a line pointing to strategy="mesh"
    except Exception:  # noqa: BLE001 - a hint only
        log.debug("no ddp hint", exc_info=True)
    if kind == "trainer":
        try:
            from ..kernel import registry
            from .launch import warm_up

            warm_up(family)  # a mesh already runs: its ranks import Lightning now, not at the first fit
            if _warms_ranks():  # local ranks started from now on: forked with Lightning imported (one import)
                from ..kernel.launch.local import preload
                from .rank import modules

                preload(list(modules(family)))
            # Meshes started (or restarted) later: their ranks import it as soon as they are up.
            registry.on_start(_WARM_ON_START.setdefault(family, functools.partial(_warm_on_start, family)))
        except Exception:  # noqa: BLE001
            log.debug("no warm-up", exc_info=True)
    return True


_WARM_ON_START: dict[str, Any] = {}  # family -> its start hook (one per family, so registering is idempotent)


def _warms_ranks() -> bool:
    """Ranks get Lightning ahead of the first fit (below) in a Jupyter kernel; elsewhere (a script or test process
    that merely imported Lightning) ranks stay as they are, unless ``MONARCH_LIGHTNING_WARM_ON_START`` is "1"
    (always) or "0" (never)."""
    env = os.environ.get("MONARCH_LIGHTNING_WARM_ON_START")
    if env in ("0", "1"):
        return env == "1"
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


def _warm_on_start(family: str, mesh: Any) -> None:
    """A mesh started after Lightning was imported: its ranks import Lightning at once, in the background
    (``launch.warm_up``; nothing to do for local ranks forked after the fork server imported it), so the first fit
    does not wait for it."""
    if _warms_ranks():
        from .launch import warm_up

        warm_up(family, mesh)


class _Unavailable:
    """Stands in the registry for a Lightning that strategy='mesh' does not support: raises why when used."""

    def __init__(self, family: str, error: BaseException) -> None:
        self.family = family
        self.error = error

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.error, MeshLightningError):
            raise self.error
        check_version(self.family)
        raise MeshLightningError(f"strategy='mesh' cannot be built with this Lightning: {self.error}")


def register() -> list[str]:
    """Register ``"mesh"`` with the registries of the Lightning packages imported now, and install the import hook
    that registers it with the others when they are imported. Idempotent; cheap (imports no Lightning).

    Returns the packages registered by this call (e.g. ``["lightning.pytorch", "lightning.fabric"]``).
    """
    done = []
    for module, (family, kind) in _WATCHED.items():
        if module in sys.modules and getattr(sys.modules[module], "__spec__", None) is not None:
            if not _initializing(sys.modules[module]) and _register_one(family, kind):
                done.append(module)
        elif module not in sys.modules:
            _hook(module, family, kind)
    return done


def _initializing(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


_hooked: set[str] = set()  # watched packages whose import registers "mesh" (monarch_worker.hooks)


def _hook(module: str, family: str, kind: str) -> None:
    """Register "mesh" with ``module``'s registry right after it is imported."""
    with _lock:
        if module in _hooked:
            return
        _hooked.add(module)

    def registered(package: ModuleType) -> None:
        try:
            if (family, kind) not in _registered:
                _register_one(family, kind)
        except Exception:  # noqa: BLE001 - never break the user's `import lightning`
            log.warning("could not register strategy 'mesh' with %s", package.__name__, exc_info=True)

    after_import(module, registered)


# ------------------------------------------------------------------------------------------------ public classes

_PUBLIC = ("MeshStrategy", "MeshFabricStrategy", "MeshEnvironment", "MeshLauncher", "MeshFabricLauncher")


def _default_family() -> str:
    if "lightning" in sys.modules or importlib.util.find_spec("lightning") is not None:
        return "lightning"
    if importlib.util.find_spec("pytorch_lightning") is not None or importlib.util.find_spec("lightning_fabric"):
        return "standalone"
    raise ImportError("strategy='mesh' needs Lightning:  pip install 'monarch-jupyter[lightning]'  (or pip install "
                      "lightning)")


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(_classes(_default_family()), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register()
