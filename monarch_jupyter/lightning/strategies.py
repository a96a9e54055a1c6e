"""Lightning classes of ``strategy="mesh"``, built for one Lightning distribution ("family").

Lightning ships twice: ``lightning`` (``lightning.pytorch`` and ``lightning.fabric``) and the standalone
``pytorch_lightning`` / ``lightning_fabric``, each with its own class hierarchy and registries. The classes here
are made per family by ``build_trainer`` / ``build_fabric`` and live as attributes of ``unified.py`` and
``standalone.py`` (so pickle finds them by name on the ranks):

- ``MeshEnvironment`` (a ``ClusterEnvironment``): on a rank, RANK, WORLD_SIZE, LOCAL_RANK and NODE_RANK (or
  torchrun's GROUP_RANK) of the mesh; in the notebook, rank 0 of the configured world. It never creates
  processes and never sets up rendezvous: the mesh's default process group is up on every rank.
- ``MeshStrategy`` (Trainer) and ``MeshFabricStrategy`` (Fabric): Lightning's DDP strategies whose launcher
  runs the job on the mesh's ranks instead of starting processes. Lightning's ``_init_dist_connection`` finds
  the group initialized and leaves it; Lightning's DDP teardown never destroys it.
- ``MeshLauncher`` / ``MeshFabricLauncher`` (Lightning's ``_Launcher`` interface, interactive-compatible). The
  Fabric one is registered as a virtual subclass of Lightning's spawn launcher (an ABC), so that ``Fabric.launch()``
  without a function raises Lightning's own TypeError for spawn launchers (the ranks are other processes).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from . import rank as rank_side
from .rank import FABRIC, PYTORCH

__all__ = ["build_environment", "build_trainer", "build_fabric"]


def build_environment(family: str) -> dict[str, type]:
    base = importlib.import_module(f"{FABRIC[family]}.plugins.environments.cluster_environment").ClusterEnvironment

    class MeshEnvironment(base):  # type: ignore[misc, valid-type]
        """The ranks of a monarch_jupyter mesh, as a Lightning ``ClusterEnvironment``.

        On a rank (while a job runs there) every value comes from the environment the mesh gave the rank, as
        torchrun sets it: RANK, WORLD_SIZE, LOCAL_RANK, and NODE_RANK (GROUP_RANK under torchrun; else the node
        index the controller derived from the mesh's hosts). In the notebook it describes rank 0 of the world the
        strategy was configured for (what ``Trainer`` asks while it is being built).
        """

        def __init__(self) -> None:
            super().__init__()
            self._world_size = 1
            self._global_rank = 0

        @staticmethod
        def _on_rank() -> bool:
            return rank_side.in_job()

        @property
        def creates_processes_externally(self) -> bool:
            return True

        @property
        def main_address(self) -> str:
            return os.environ.get("MASTER_ADDR", "127.0.0.1")

        @property
        def main_port(self) -> int:
            return int(os.environ.get("MASTER_PORT", "0") or 0)

        @staticmethod
        def detect() -> bool:
            return rank_side.in_job()

        def world_size(self) -> int:
            return int(os.environ["WORLD_SIZE"]) if self._on_rank() else self._world_size

        def set_world_size(self, size: int) -> None:
            self._world_size = size

        def global_rank(self) -> int:
            return int(os.environ["RANK"]) if self._on_rank() else self._global_rank

        def set_global_rank(self, rank: int) -> None:
            self._global_rank = rank

        def local_rank(self) -> int:
            return int(os.environ.get("LOCAL_RANK", "0")) if self._on_rank() else 0

        def node_rank(self) -> int:
            if not self._on_rank():
                return 0
            return int(os.environ.get("NODE_RANK") or os.environ.get("GROUP_RANK") or 0)

        def validate_settings(self, num_devices: int, num_nodes: int) -> None:
            pass  # the strategy checks devices x num_nodes against the mesh (launch.configure)

        def teardown(self) -> None:
            pass  # the rank's environment belongs to the mesh

    return {"MeshEnvironment": MeshEnvironment}


def build_trainer(family: str, environment: type) -> dict[str, type]:
    FAMILY = family  # noqa: N806 - a class attribute below
    pl = PYTORCH[family]
    ddp = importlib.import_module(f"{pl}.strategies.ddp")
    launcher_base = importlib.import_module(f"{pl}.strategies.launchers.launcher")._Launcher

    class MeshLauncher(launcher_base):  # type: ignore[misc, valid-type]
        """Runs a Trainer entry point (fit, validate, test, predict) on the mesh's ranks: see launch.py."""

        def __init__(self, strategy: Any) -> None:
            self._strategy = strategy

        @property
        def is_interactive_compatible(self) -> bool:
            return True

        def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
            from . import launch

            return launch.launch_trainer(self._strategy, family, function, args, kwargs, trainer)

        def kill(self, signum: Any) -> None:
            pass  # the ranks are the mesh's: %mesh interrupt / restart

    class MeshStrategy(ddp.DDPStrategy):  # type: ignore[name-defined]  # Lightning is imported at run time
        """``Trainer(strategy="mesh")``: DDP on the ranks of a monarch_jupyter mesh.

        Parameters
        ----------
        mesh:
            The mesh, or a sub-mesh of a split mesh (``m.split``), to run on. Default: the sub-mesh of the ``with
            sub:`` block the Trainer is built in (kept for every later fit, from any thread), else
            ``monarch_jupyter.current_mesh()`` when the Trainer is built and at each launch (lightning/target.py).
        live_view:
            "auto", "widget", "text" or "off": the per-rank dashboard under the cell (default: ``%config
            MeshMagics.live_view`` when the extension is loaded, else "auto").
        progress:
            Replace Lightning's tqdm/rich progress bar on the ranks by one that reports to the dashboard.
        fault_tolerant:
            A ``fit`` that trains through a rank's death (torchft): not available; True raises MeshLightningError
            naming what is missing and what works instead (docs/fault_tolerance.md).
        **kwargs:
            DDP options (``find_unused_parameters``, ``static_graph``, ``timeout``...), as for ``DDPStrategy``.
        """

        strategy_name = "mesh"
        family = FAMILY

        def __init__(self, mesh: Any = None, *, live_view: str | None = None, progress: bool = True,
                     fault_tolerant: bool = False, **kwargs: Any) -> None:
            from . import check_version
            from .errors import MeshLightningError, fault_tolerant_missing

            check_version(family)
            if fault_tolerant:
                raise MeshLightningError(fault_tolerant_missing())
            kwargs.pop("start_method", None)
            if kwargs.get("cluster_environment") is None:
                kwargs["cluster_environment"] = environment()
            super().__init__(**kwargs)
            self.mesh = mesh
            self.live_view = live_view
            self.progress = progress
            self.node_ranks: dict[int, int] = {}

        def _configure_launcher(self) -> None:
            from . import launch

            self._launcher = MeshLauncher(self)
            launch.configure(self, "Trainer")

        def __getstate__(self) -> dict:
            state = dict(self.__dict__)
            state["mesh"] = None  # the ranks never need the controller's objects
            state["_launcher"] = None
            return state

        @classmethod
        def register_strategies(cls, strategy_registry: Any) -> None:
            strategy_registry.register("mesh", cls, description="DDP on the ranks of a monarch_jupyter mesh",
                                       override=True)

    return {"MeshLauncher": MeshLauncher, "MeshStrategy": MeshStrategy}


def build_fabric(family: str, environment: type) -> dict[str, type]:
    FAMILY = family  # noqa: N806 - a class attribute below
    fab = FABRIC[family]
    ddp = importlib.import_module(f"{fab}.strategies.ddp")
    launcher_base = importlib.import_module(f"{fab}.strategies.launchers.launcher")._Launcher

    class MeshFabricLauncher(launcher_base):  # type: ignore[misc, valid-type]
        """Runs ``Fabric.launch(fn, ...)`` on every rank of the mesh; returns rank 0's value (or every rank's)."""

        def __init__(self, strategy: Any) -> None:
            self._strategy = strategy

        @property
        def is_interactive_compatible(self) -> bool:
            return True

        def launch(self, function: Any, *args: Any, **kwargs: Any) -> Any:
            from . import launch

            return launch.launch_fabric(self._strategy, family, function, args, kwargs)

    class MeshFabricStrategy(ddp.DDPStrategy):  # type: ignore[name-defined]  # Lightning is imported at run time
        """``Fabric(strategy="mesh")``: DDP on the ranks of a monarch_jupyter mesh.

        ``fabric.launch(fn, *args)`` runs ``fn(fabric, *args)`` on every rank and returns rank 0's value, or a
        RankMap rank -> value with ``return_all=True``; ``rank_results`` holds every rank's values of the last
        launch either way. ``mesh``, ``live_view`` and DDP options as for ``MeshStrategy``.
        """

        strategy_name = "mesh"
        family = FAMILY

        def __init__(self, mesh: Any = None, *, live_view: str | None = None, return_all: bool = False,
                     **kwargs: Any) -> None:
            from . import check_version

            check_version(family)
            kwargs.pop("start_method", None)
            if kwargs.get("cluster_environment") is None:
                kwargs["cluster_environment"] = environment()
            super().__init__(**kwargs)
            self.mesh = mesh
            self.live_view = live_view
            self.return_all = return_all
            self.rank_results: Any = None
            self.node_ranks: dict[int, int] = {}

        def _configure_launcher(self) -> None:
            from . import launch

            self._launcher = MeshFabricLauncher(self)
            launch.configure(self, "Fabric")

        def __getstate__(self) -> dict:
            state = dict(self.__dict__)
            state["mesh"] = None
            state["_launcher"] = None
            state["rank_results"] = None
            return state

        @classmethod
        def register_strategies(cls, strategy_registry: Any) -> None:
            strategy_registry.register("mesh", cls, description="DDP on the ranks of a monarch_jupyter mesh",
                                       override=True)

    # Fabric.launch() without a function: what Lightning raises for its spawn launchers (its own check, its own
    # TypeError; fabric.setup() then asks for launch() as Lightning does), not a silent no-op in the notebook.
    spawn = importlib.import_module(f"{fab}.strategies.launchers.multiprocessing")._MultiProcessingLauncher
    spawn.register(MeshFabricLauncher)

    return {"MeshFabricLauncher": MeshFabricLauncher, "MeshFabricStrategy": MeshFabricStrategy}
