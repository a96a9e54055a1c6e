"""The mesh's process group on a rank: joining it, and what user code's own ``init_process_group`` and
``destroy_process_group`` do while it is up.

The mesh owns the default process group of every rank: it makes it when the rank joins (``MeshGroup.join``), and
again on Regroup (monarch_worker.recovery), and keeps it up between cells. Code written for torchrun makes its own
(``dist.init_process_group(...)`` near the top of a script, ``destroy_process_group()`` at its end, Lightning's or
accelerate's teardown), so while a cell runs the two functions of ``torch.distributed`` behave as follows
(``MeshGroup.install`` replaces ``torch.distributed.init_process_group`` and ``destroy_process_group``, and their
``distributed_c10d`` originals, by wrappers that pass every other call through unchanged):

- ``init_process_group(...)`` while the mesh's group is up returns at once when it asks for a compatible group (the
  same backend, world size and rank, where it names them; its ``init_method``, ``store``, ``timeout`` and
  ``device_id`` are not used: the mesh's group already did the rendezvous, and keeps the mesh's ``pg_timeout``).
  A request the group does not satisfy raises ``MeshGroupError`` naming what differs and the fix. With no group
  up (the mesh's group was torn down after a fault) it raises ``MeshGroupError`` too, naming the command that
  brings the group back: never a rendezvous that waits for peers that will not come.
- ``destroy_process_group()`` (or of ``group.WORLD``) leaves the mesh's group up: harmless, so the next cell, the
  next run of the script, and ``%mesh status`` all see the group that is really there. Rank 0 says so once in
  each cell (or run) that does it. Destroying a group of the user's own (``new_group``) is passed through.

While a script runs (``watch_guards``), ``torch.distributed.is_initialized`` is wrapped too: a call of it from code
outside torch (a framework's ``if not dist.is_initialized(): dist.init_process_group()``, or the script's own) is
counted, so that scripts.py says "would fail under torchrun" only of scripts that would.

Outside cells (the rank runtime itself: joining, Regroup, Abort) both functions are torch's own.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from . import protocol as P
from .addresses import address_toward

log = logging.getLogger(__name__)

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

__all__ = ["MeshGroup", "MeshGroupError", "DESTROY_NOTE", "default_backend", "installed"]

DESTROY_NOTE = ("monarch: destroy_process_group() left the mesh's process group up: the mesh owns it, and the next "
                "cells and runs use it (docs/torchrun.md). This note shows once per cell or run.\n")


_installed: list[MeshGroup] = []  # the MeshGroup whose wrappers this process runs (at most one)


def installed() -> MeshGroup | None:
    """The MeshGroup of this rank process once it joined (None before, and outside ranks)."""
    return _installed[0] if _installed else None


class MeshGroupError(RuntimeError):
    """User code asked for a process group the mesh's does not satisfy (the message says what differs and the
    fix), or for one while the mesh's group is down."""


def default_backend(backend: str, local_world_size: int) -> str:
    """``auto`` -> nccl when CUDA has a GPU per local rank, else gloo; other names unchanged."""
    if backend != "auto":
        return backend
    import torch

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size
    return "nccl" if cuda else "gloo"


class MeshGroup:
    """The default process group of this rank as the mesh made it (see the module docstring).

    Parameters
    ----------
    in_cell:
        Returns True while the main thread runs user code (a cell, a call, a script).
    send:
        Queues a message for the controller (``Rank.send``): StoreReady when this rank hosts the store.
    """

    def __init__(self, in_cell: Callable[[], bool], send: Callable[[P.Message], None]) -> None:
        self.in_cell = in_cell
        self.send = send
        self.backend = ""  # of the mesh's group ("" before the first join)
        self.rank = -1
        self.world_size = -1
        self.store: Any = None  # rank 0's TCPStore: kept for the generation (MASTER_PORT stays reachable)
        self.sockets: Any = None  # recovery.GroupSockets recording the connections the group opens
        self.init_calls = 0  # calls of init_process_group by user code (scripts report when there were none)
        self.guard_calls = 0  # calls of dist.is_initialized() from outside torch while guards are watched
        #: The id of the cell (or call, or script run) the main thread runs; the rank runtime sets it (startup.py).
        self.current_cell: Callable[[], int] = lambda: -1
        self._noted_in: int | None = None  # the cell in which rank 0 last showed DESTROY_NOTE
        self._original_init: Callable[..., Any] | None = None
        self._original_destroy: Callable[..., Any] | None = None

    # ------------------------------------------------------------------ the mesh's own group

    def join(self, rank: int, world_size: int, local_rank: int, local_world_size: int, master_addr: str,
             master_port: int, backend: str, controller: str, join_timeout: float,
             pg_timeout: float) -> tuple[Any, str]:
        """Join the default process group (at start, and again on Regroup); returns (device, backend).

        ``master_port`` < 0: the launcher's rendezvous (env://: torchrun's store, or MASTER_ADDR/PORT); 0: host
        a TCPStore here (on ``master_addr``, or our address toward ``controller`` when it is empty) and report it
        with StoreReady; > 0: the TCPStore at ``master_addr:master_port``. Times in seconds: ``join_timeout`` for
        the store, ``pg_timeout`` for collectives. ``protocol.NO_GROUP``: no group now (backend "").
        """
        import torch.distributed as dist

        backend = default_backend(backend, local_world_size)
        if master_port == P.NO_GROUP:  # a replacement whose group a Regroup makes later (kernel/healing.py)
            return self.device_for(backend, local_rank), ""
        store: Any = None
        if master_port < 0:  # the launcher's rendezvous (torchrun's store, or MASTER_ADDR/PORT): env://
            addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        elif master_port == 0:
            addr = master_addr or address_toward(controller)  # an address the other ranks can reach
            store = dist.TCPStore(addr, 0, world_size, is_master=True,
                                  timeout=timedelta(seconds=join_timeout), wait_for_workers=False)
            port = store.port
            self.send(P.StoreReady(port=port, addr=addr))
        else:
            addr, port = master_addr, master_port
            store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timedelta(seconds=join_timeout))
        os.environ["MASTER_ADDR"] = addr
        os.environ["MASTER_PORT"] = str(port)
        device = self.device_for(backend, local_rank)
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = device
        if store is None:
            kwargs["init_method"] = "env://"
        else:
            kwargs["store"] = store
        init = self._original_init or dist.init_process_group
        if self.sockets is not None:
            with self.sockets:  # the connections this group opens (see recovery.GroupSockets)
                init(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout), **kwargs)
        else:
            init(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout), **kwargs)
        self.store = store if master_port == 0 else None
        self.backend, self.rank, self.world_size = backend, rank, world_size
        return device, backend

    @staticmethod
    def device_for(backend: str, local_rank: int) -> Any:
        """The rank's torch.device: cuda:``local_rank`` (made current) with nccl, else the CPU."""
        import torch

        if backend == "nccl":
            torch.cuda.set_device(local_rank)
            return torch.device("cuda", local_rank)
        return torch.device("cpu")

    def leave(self) -> None:
        """Destroy the default process group (the mesh's own teardown: Abort, Regroup); no-op when there is none."""
        import torch.distributed as dist

        if dist.is_initialized():
            (self._original_destroy or dist.destroy_process_group)()

    @staticmethod
    def current_backend() -> str:
        """The backend of this process's default group, or "" when it has none (any thread; for heartbeats)."""
        dist = sys.modules.get("torch.distributed")
        try:
            if dist is None or not dist.is_available() or not dist.is_initialized():
                return ""
            return str(dist.get_backend())
        except Exception:  # noqa: BLE001 - torn down meanwhile on the main thread
            return ""

    # ------------------------------------------------------------------ user code's calls

    def install(self) -> None:
        """Wrap torch.distributed's init_process_group and destroy_process_group (see the module docstring), and
        new_group, whose connections ``Abort`` shuts down with the mesh group's (recovery.GroupSockets.record)."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if self._original_init is not None:
            return
        self._original_init = c10d.init_process_group
        self._original_destroy = c10d.destroy_process_group
        @functools.wraps(self._original_init)
        def init(*args: Any, **kwargs: Any) -> None:
            self.on_init(*args, **kwargs)

        @functools.wraps(self._original_destroy)
        def destroy(group: Any = None) -> None:
            self.on_destroy(group)

        original_new = c10d.new_group

        @functools.wraps(original_new)
        def new_group(*args: Any, **kwargs: Any) -> Any:
            if self.sockets is None:
                return original_new(*args, **kwargs)
            return self.sockets.record(original_new, *args, **kwargs)  # Abort shuts its connections down too

        for module in (dist, c10d):
            module.init_process_group = init  # type: ignore[attr-defined]
            module.destroy_process_group = destroy  # type: ignore[attr-defined]
            module.new_group = new_group  # type: ignore[attr-defined]
        _installed[:] = [self]

    def on_init(self, backend: Any = None, init_method: Any = None, timeout: Any = None, world_size: int = -1,
              rank: int = -1, store: Any = None, group_name: str = "", pg_options: Any = None, device_id: Any = None,
              **more: Any) -> None:
        import torch.distributed as dist

        assert self._original_init is not None
        if not self.in_cell():
            self._original_init(backend, init_method, timeout, world_size, rank, store, group_name, pg_options,
                                device_id, **more)
            return
        self.init_calls += 1
        if not dist.is_initialized():
            raise MeshGroupError(
                f"rank {self.rank}: the mesh's process group is down (it was torn down after a fault), and "
                "init_process_group() in a cell cannot bring it back: the other ranks are not waiting for it. Run  "
                "%mesh interrupt --force  (or  %mesh restart --rank R  for dead ranks; mesh.restart() for a fresh "
                "mesh), then run this again")
        differences = self.differences(backend, world_size, rank)
        if differences:
            raise MeshGroupError(
                f"init_process_group() asks for {'; '.join(differences)}, but the mesh's process group (backend "
                f"{self.backend}, world size {self.world_size}, this rank {self.rank}) is already up and serves "
                f"every cell. Fix: {self.fix(differences)}")

    def differences(self, backend: Any, world_size: int, rank: int) -> list[str]:
        """What a request of init_process_group asks for that the mesh's group is not (empty: compatible)."""
        out = []
        wanted = _backend_for(backend, self.backend)
        if wanted and wanted != self.backend:
            out.append(f"backend {backend!s}")
        if world_size not in (-1, None) and int(world_size) != self.world_size:
            out.append(f"world size {world_size}")
        if rank not in (-1, None) and int(rank) != self.rank:
            out.append(f"rank {rank}")
        return out

    def fix(self, differences: list[str]) -> str:
        if any(d.startswith("backend") for d in differences):
            return ("start the mesh with the backend the code asks for (%mesh start -n N --backend gloo|nccl, or "
                    "Mesh(N, backend=...)), or let the code take the default (init_process_group() without backend)")
        return (f"start a mesh of that many ranks (%mesh start -n N), or take the ranks from the environment "
                f"(RANK, WORLD_SIZE: this is rank {self.rank} of {self.world_size})")

    def on_destroy(self, group: Any = None) -> None:
        import torch.distributed as dist

        assert self._original_destroy is not None
        default = group is None or (dist.is_initialized() and group is dist.group.WORLD)
        if not (self.in_cell() and default):
            self._original_destroy(group)
            return
        cell = self.current_cell()
        if self.rank == 0 and self._noted_in != cell:
            self._noted_in = cell
            sys.stderr.write(DESTROY_NOTE)

    @contextlib.contextmanager
    def watch_guards(self) -> Iterator[None]:
        """Count calls of ``torch.distributed.is_initialized()`` made by code outside torch and this package
        (``guard_calls``) until the block ends; the first such call puts torch's own function back (one is enough
        to know, and nothing is left wrapped for ``torch.compile`` to trace)."""
        import torch
        import torch.distributed as dist

        original = dist.is_initialized
        skip = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, _PACKAGE_DIR)

        @functools.wraps(original)
        def is_initialized() -> bool:
            caller = sys._getframe(1).f_code.co_filename
            if self.in_cell() and not caller.startswith(skip) and not caller.startswith("<frozen "):
                self.guard_calls += 1
                if dist.is_initialized is is_initialized:
                    dist.is_initialized = original
            return original()

        dist.is_initialized = is_initialized
        try:
            yield
        finally:
            if dist.is_initialized is is_initialized:
                dist.is_initialized = original


def _backend_for(requested: Any, mesh_backend: str) -> str:
    """The backend a request of init_process_group means for the mesh's device ("" for "whatever is default").

    ``"cpu:gloo,cuda:nccl"`` names one per device type: the one for the mesh's device (cuda for nccl, else cpu).
    """
    if requested is None:
        return ""
    text = str(requested).strip().lower()
    if text in ("", "undefined"):
        return ""
    if ":" not in text:
        return text
    device = "cuda" if mesh_backend == "nccl" else "cpu"
    for part in text.split(","):
        kind, _, name = part.partition(":")
        if kind.strip() == device:
            return name.strip()
    return text
