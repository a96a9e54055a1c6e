"""The Mesh: the notebook kernel as single controller of persistent ranks; the public façade of the controller.

``Mesh`` holds the parts (each in its own module, sharing one ``MeshState``, wired in parts.py) and forwards to
them; docs/architecture.md has the module map.

Threads: the caller's thread submits work, waits for it, runs ``registry.on_start`` hooks; ``monarch-io`` owns the
socket; the launcher's reader thread delivers output and exits; ``monarch-events`` calls listeners."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from monarch_worker import protocol as P
from monarch_worker.serialize import dumps

from ..errors import MeshError, MeshNotRunningError
from ..ranks import RankMap, chosen_ranks
from . import config, hints, registry, scripts
from .cells import CellHandle
from .compiling import compile_cell, notebook_refs, sources_of
from .launch import JoinCommands, launcher_for
from .parts import build
from .recovery import InterruptReport
from .resize import ScaleReport
from .stacks import StackReport
from .state import RankState
from .submesh import SubMesh

__all__ = ["Mesh", "RankState", "CellHandle", "StackReport", "InterruptReport", "SubMesh"]


class Mesh:
    """A mesh of persistent worker processes, one per rank, each with torch.distributed initialized.

    Parameters
    ----------
    nproc:
        Number of ranks (the world size).
    start:
        Start at once (default). Otherwise call ``start()``.
    launcher:
        "local" (default: a fork server on this host), "join" (ranks started elsewhere join; see ``listen``),
        "torchrun" (torchrun on this host), "agent" (one host agent here, no torchrun: the controller pays per host),
        "slurm" (srun in an allocation), or a ``JoinLauncher`` object; docs/multihost.md explains each.
    **options:
        Any option of ``monarch_worker.options.MeshOptions`` (docs/configuration.md lists them with units and
        defaults: ``backend``, ``start_timeout``, ``on_rank_death``, ``torchft``, ...). Each is also an attribute:
        ``mesh.interrupt_grace = 2``.

    Ranks see RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun sets them,
    and names ``rank``, ``world_size``, ``local_rank``, ``device``, ``dist`` and ``torch`` in their namespace.

    Raises
    ------
    MeshStartError
        A rank failed to start or to join within ``start_timeout`` (its error and output are in the message);
        every process started is gone when it is raised.
    TypeError, ValueError
        An unknown option, or a value that does not fit it; more local ranks than this host can carry, unless
        ``oversubscribe`` (launch/capacity.py: the message says what to expect).
    """

    def __init__(self, nproc: int = 4, *, start: bool = True, launcher: Any = "local", **options: Any) -> None:
        if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
            raise ValueError(f"nproc must be a positive number of ranks, got {nproc!r}")
        self.options = config.make_options(**options)
        if self.options.backend == "nccl":
            config.check_gpus(nproc)
        join_launcher = launcher_for(launcher, nproc)
        if join_launcher is None and (self.options.address not in (None, "", "127.0.0.1", "localhost")
                                      or self.options.encrypt):
            raise ValueError("address and encrypt are for ranks that join (launcher 'join', 'torchrun', 'agent' or "
                             "'slurm'); local ranks always talk to the controller over loopback")
        self.parts = parts = build(nproc, self.options, join_launcher)
        # The parts a user or a tool may want (each module's docstring says what it owns).
        self.state, self.events, self.listener = parts.state, parts.events, parts.listener
        self.transfers = parts.transfers
        self.debugger = parts.debugger  # breakpoint() prompts, post-mortem, inspect
        self.waiter, self.recovery, self.lifecycle = parts.waiter, parts.restarts, parts.lifecycle
        if start:
            self.start()

    # ------------------------------------------------------------------ lifecycle

    @property
    def nproc(self) -> int:
        """The number of ranks (world size; ``world_size`` is the same)."""
        return self.state.nproc

    world_size = nproc

    running = property(lambda self: self.state.running, doc="True while every rank runs (started, not stopped).")
    generation = property(lambda self: self.state.generation,
                          doc="Counts the starts and full restarts (what ranks kept is gone when it changes).")
    address = property(lambda self: self.state.address, doc="Where ranks connect to the controller (tcp://HOST:PORT).")

    @property
    def listening(self) -> bool:
        """True while the mesh waits for ranks to join (``listen``); ``run`` then waits for them first."""
        li = self.listener
        return not self.state.running and li is not None and li.is_open and not li.failed

    @property
    def start_failure(self) -> str:
        """Why the ranks of a listening mesh did not all join in time ("" when they did or are still joining);
        the next ``run`` or ``wait_ready`` raises it as MeshStartError and stops the mesh."""
        return self.listener.failed if self.listener is not None and self.listener.is_open else ""

    @classmethod
    def listen(cls, world_size: int, *, timeout: float = 300.0, nproc_per_node: int | None = None,
               show: bool = True, **options: Any) -> Mesh:
        """Open the controller to ``world_size`` ranks started elsewhere, print the commands that start them
        (torchrun, sbatch/srun, plain python) and return at once; the mesh is ready when all have joined.

        ``timeout``: seconds for every rank to join (after it, the report says who is missing);
        ``nproc_per_node``: ranks per host in the printed commands; ``options`` as for ``Mesh`` (``address``,
        ``port``, ``encrypt``, ``secret_file``, ...). ``wait_ready()`` (or the first ``run``) waits for the ranks;
        ``join_commands()`` returns the commands again. Raises ValueError: bad address, port or world size.
        """
        mesh = cls(world_size, launcher=launcher_for("join", world_size, nproc_per_node=nproc_per_node),
                   start_timeout=timeout, start=False, **options)
        mesh.start(wait=False)
        if show:
            print(mesh.join_commands())
        return mesh

    def join_commands(self) -> JoinCommands:
        """The commands that start this mesh's ranks elsewhere (a mesh with a launcher other than "local").

        Raises MeshNotRunningError when the mesh is not listening."""
        if self.listener is None or self.listener.commands is None or not self.listener.is_open:
            raise MeshNotRunningError("this mesh does not listen for ranks: use Mesh.listen(N) or  %mesh listen")
        return self.listener.commands

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: until the start timeout passed) for every rank of a listening
        mesh to join; True when the mesh is running. Raises MeshStartError when the start timeout passed first
        (the message names who joined and who is missing) or a rank failed; the mesh is stopped then.
        """
        return self.lifecycle.wait_ready(timeout)

    def start(self, wait: bool | None = None) -> Mesh:
        """Start every rank and wait until each has joined the process group (``start_timeout`` seconds).

        ``wait`` False (the default for launcher "join", where someone else starts the ranks) returns once the
        controller listens; ``wait_ready`` or the first ``run`` waits for the ranks. Raises MeshStartError when a
        rank failed to start or to join in time; nothing is left running.
        """
        self.lifecycle.start(wait)
        registry.set_current(self)
        self.events.flush()  # listeners saw the start when it returns
        registry.started(self)  # hooks: e.g. the ranks import Lightning in the background (if the notebook did)
        return self

    def stop(self) -> None:
        """Stop every rank (Shutdown, then SIGKILL after 3 s) and release the controller's socket."""
        self.lifecycle.teardown(graceful=True)
        self.parts.releases.close()  # its watches of abandoned cells (they end with the mesh)
        registry.clear_current(self)
        self.events.emit("stopped")
        self.events.flush()

    def restart(self, ranks: str | int | Iterable[int] | None = None) -> Mesh:
        """Stop and start again: fresh processes, fresh namespaces, a fresh process group.

        A mesh whose ranks were started elsewhere (``listen``) listens again and prints the new commands.

        ``ranks``: restart only these (e.g. the ones that died): fresh processes for them, while every other
        rank keeps its namespace and joins a fresh process group with them. Objects bound to the old group
        (DistributedDataParallel wrappers, ``new_group`` handles) must be created again; with on_rank_death="restart"
        they get back what the notebook sent, as after a death. Ends a split; prints one line saying what happened.

        Raises
        ------
        MeshStartError
            Ranks did not start or join within ``start_timeout``.
        MonarchError
            ``ranks`` given but other ranks are dead too, survivors are stuck in a cell, or the ranks were
            started one by one elsewhere (the message says what to run instead).
        """
        if ranks is not None:
            self._check_running()
            self.parts.resizer.restart_ranks(ranks, joined=self.lifecycle.joined)
            self.events.flush()
            return self
        self.lifecycle.teardown(graceful=True)
        self.start()
        if self.listening:
            print(self.join_commands())
        return self

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ running code

    def run(self, code: str, ranks: str | int | Iterable[int] | None = None, *, timeout: float | None = None,
            block: bool = True, namespace: dict[str, Any] | None = None, filename: str | None = None,
            order: str = "arrival", replay: bool = False, rejoin: bool = False) -> RankMap | None | CellHandle:
        """Run ``code`` (a cell) on ``ranks`` (default: all) in their persistent namespaces.

        Parameters
        ----------
        code:
            Python source. Its last expression's value on each rank comes back, as in IPython's Out.
        ranks:
            Rank selection: None/"all", an int, a list, or a spec like "0,2", "1-3", "::2".
        timeout:
            Seconds before the cell is interrupted and reported with each rank's stack (default: the mesh's); a
            cell that waits for a rank's restart (on_rank_death="restart") waits that long at most before it is sent.
        block:
            False returns a CellHandle at once (``done()``, ``wait(timeout)``, ``result()``).
        namespace:
            The notebook's namespace: functions and classes defined there that the cell refers to are sent
            with it (by value, with their source for tracebacks) unless a rank defined that name itself.
        filename:
            Name of the cell in tracebacks (default ``<mesh cell N>``).
        order:
            "arrival" writes output lines as they arrive; "rank" writes rank r's lines only after every lower
            rank of the cell finished it, so the output is the same every run (rank 0 still streams live).
        replay, rejoin:
            With ``on_rank_death="restart"``: ``replay`` runs the cell again on a rank's replacement (it defines the
            namespace); ``rejoin``: a replacement rejoins the cell while it runs (a torchft loop). See healing.py.

        Returns
        -------
        RankMap (rank -> value) when any rank's last expression had a value, else None; a CellHandle when
        ``block`` is False.

        Raises
        ------
        TypeError, ValueError
            ``code``, ``ranks`` or ``timeout`` is not one of the forms above (nothing runs).
        SyntaxError
            The code does not compile (reported once, nothing runs).
        MeshError
            It raised on some ranks or some ranks died; the other ranks' results are in ``.results``.
        MeshTimeoutError
            It ran past ``timeout``.
        KeyboardInterrupt
            Interrupted (the ranks were interrupted too and keep their state).
        """
        self._check_running()
        if order not in ("arrival", "rank"):
            raise ValueError(f"order must be 'arrival' or 'rank', got {order!r}")
        config.check_timeout(timeout)
        chosen = chosen_ranks(ranks, self.state.nproc)
        cell_id = next(self.state.ids)
        filename = filename or f"<mesh cell {cell_id}>"
        compiled = compile_cell(code, filename)  # SyntaxError here, before anything runs
        refs, sources = notebook_refs(code, namespace, compiled) if namespace is not None else ({}, {})
        payload, buffers = dumps(refs) if refs else (b"", [])
        handle = self.waiter.submit(cell_id, [(chosen, P.Exec(cell_id, code, filename, sources), payload, buffers)],
                                    "the cell", order, waited=block, rejoin=rejoin,
                                    timeout=timeout)
        self.parts.history.cell(code, filename, sources, refs, chosen, replay)
        try:
            return self._finish(handle, timeout, block)
        except MeshError as e:  # a NameError for a notebook name: how to send it (hints.py)
            hints.name_hints(e, namespace or {})
            raise

    def call(self, fn: Callable[..., Any], *args: Any, ranks: str | int | Iterable[int] | None = None,
             timeout: float | None = None, block: bool = True, **kwargs: Any) -> RankMap | None | CellHandle:
        """Call ``fn(*args, **kwargs)`` on each chosen rank; returns rank -> return value.

        ``fn`` may be defined in the notebook (sent by value with cloudpickle). Raises as ``run`` does (TypeError: not
        callable), and SerializationError (nothing sent) when ``fn`` or its arguments cannot be pickled.
        """
        self._check_running()
        if not callable(fn):
            raise TypeError(f"fn is a function to call on the ranks, got {type(fn).__name__}: source is mesh.run(code)")
        config.check_timeout(timeout)
        chosen = chosen_ranks(ranks, self.state.nproc)
        cell_id = next(self.state.ids)
        payload, buffers = dumps((fn, args, kwargs))
        handle = self.waiter.submit(cell_id, [(chosen, P.Call(cell_id, sources_of([fn])), payload, buffers)],
                                    f"call of {getattr(fn, '__qualname__', fn)!s}",
                                    timeout=timeout)
        return self._finish(handle, timeout, block)

    def run_script(self, path: Any, *args: Any, module: bool = False, ranks: str | int | Iterable[int] | None = None,
                   timeout: float | None = None, order: str = "arrival", env: dict[str, Any] | None = None,
                   keep_state: bool = False) -> RankMap:
        """Run a torchrun script (``module``: ``python -m path``) unchanged on ``ranks`` as torchrun would, frameworks'
        state fresh (``keep_state``: as cells left it), ``env`` added for this run (docs/torchrun.md); rank -> exit
        status (0). Raises FileNotFoundError (no such script here; nothing runs), and as ``run``: MeshError when it
        raised or exited with a non-zero status (``ScriptExit``) on some ranks."""
        self._check_running()
        return scripts.run_script(self.state, self.waiter, path, args, module=module, local=not self.lifecycle.joined,
                                  ranks=ranks, timeout=timeout, order=order, keep_state=keep_state, env=env)

    def _finish(self, handle: CellHandle, timeout: float | None, block: bool) -> RankMap | None | CellHandle:
        if not block:
            self.parts.cells.keep_outcome(handle.record)
            self.events.flush()  # views made for this cell follow it before the caller gets the handle
            return handle
        return self.waiter.result(handle.record, timeout if timeout is not None else (self.options.timeout or None))

    # ------------------------------------------------------------------ values between notebook and ranks

    def push(self, values: dict[str, Any] | None = None, /, *, ranks: str | int | Iterable[int] | None = None,
             device: Any = None, timeout: float | None = None, via: str = "auto", **kwvalues: Any) -> None:
        """Bind each value under its name in every chosen rank's namespace; returns when every rank has.

        ``mesh.push(x=x, w=model.state_dict())`` or ``mesh.push({"x": x})``. Any picklable value works; tensor and
        array memory travels out of band (one shared memory segment to ranks on this host). ``device``: None
        (tensors stay on the CPU), "rank" (each rank's own device, cuda:LOCAL_RANK or cpu) or a device;
        ``timeout`` in seconds; ``via``: "auto", "shm", "socket" or "broadcast". docs/transfers.md has the details.

        Raises
        ------
        ValueError
            A name is not a Python identifier or is one the mesh defines on every rank (``rank``, ``world_size``,
            ``local_rank``, ``device``, ``dist``, ``torch``), ranks or via are invalid, or via="shm" for ranks
            elsewhere.
        monarch_worker.serialize.SerializationError
            A value cannot be pickled (the message names the type and where it sits); nothing is sent.
        MeshError
            Some ranks failed (e.g. ``device='cuda'`` on a rank without GPUs); a rank binds all values or none.
        """
        merged = {**(values or {}), **kwvalues}
        self._check_running()
        self.transfers.push(merged, ranks, device, timeout, via)

    def scatter(self, name: str, value: Any, dim: int = 0, *, ranks: str | int | Iterable[int] | None = None,
                device: Any = None, timeout: float | None = None) -> None:
        """Split ``value`` along ``dim`` as torch.tensor_split does and bind part i as ``name`` on the i-th chosen
        rank (10 rows on 4 ranks give 3, 3, 2, 2). ``value``: a torch.Tensor (parts keep its dtype), a NumPy array
        or a list/tuple (dim 0); ``device`` and ``timeout`` as for ``push``.

        Raises ValueError (fewer elements along ``dim`` than ranks, ``dim`` out of range, a 0-dim value, a name
        the mesh defines, as for ``push``), TypeError (not splittable), MeshError (as for ``push``).
        """
        self._check_running()
        self.transfers.scatter(name, value, dim, ranks, device, timeout)

    def pull(self, name: str, ranks: str | int | Iterable[int] | None = None, *,
             timeout: float | None = None) -> RankMap:
        """Fetch the value bound to ``name`` on each chosen rank: a RankMap rank -> value. CUDA tensors come back
        as CPU tensors (same dtype, shape, requires_grad); large values from this host are views of shared memory.

        Raises MeshError when ``name`` is not defined (or not picklable) on some ranks; ``.results`` has the rest.
        """
        self._check_running()
        return self.transfers.pull(name, ranks, timeout)

    def gather(self, name: str, dim: int = 0, *, ranks: str | int | Iterable[int] | None = None,
               timeout: float | None = None) -> Any:
        """Pull ``name`` from each chosen rank and concatenate the parts in rank order along ``dim`` (tensors: one
        CPU tensor; arrays: one array; lists: one list): the inverse of ``scatter``.

        Raises MeshError as ``pull``; TypeError or ValueError when the parts do not fit together (shapes named).
        """
        self._check_running()
        return self.transfers.gather(name, dim, ranks, timeout)

    # ------------------------------------------------------------------ introspection and faults

    def status(self) -> dict[int, dict[str, Any]]:
        """rank -> its "state", "pid", "host", "device", memory in bytes, "returncode", "backend" (MeshState.status)."""
        return self.state.status()

    def hosts(self) -> dict[str, list[int]]:
        """host name -> its ranks (the ranks that joined, or all of this host's for a local mesh)."""
        out: dict[str, list[int]] = {}
        for r, s in self.status().items():
            out.setdefault(s["host"] or "?", []).append(r)
        return out

    def stacks(self, ranks: str | int | Iterable[int] | None = None, timeout: float = 5.0) -> StackReport:
        """Where each rank's main thread is now, asked of its I/O thread (works while it blocks in a collective,
        and while a ``block=False`` cell runs). Identical stacks are grouped: "ranks 0,1,3: all_reduce at cell
        line 4". Ranks that do not answer within ``timeout`` seconds (dead, stopped) are listed as such."""
        self._check_running(refuse_while_joining="no stacks to show")
        return self.parts.stacks.ask(ranks, timeout)

    def complete(self, code: str, cursor_pos: int, rank: int = 0, *, inspect: bool = False,
                 timeout: float = 0.5) -> Any:
        """Completions of ``code`` at ``cursor_pos`` in ``rank``'s namespace, asked of its I/O thread (it answers while
        the rank runs a cell): a ``CompleteReply`` (``matches``, ``cursor_start``, ``cursor_end``; ``text`` for
        ``inspect``), or None when the rank is dead or did not answer within ``timeout`` seconds."""
        return self.parts.completions.ask(rank, code, cursor_pos, inspect, timeout)

    def interrupt(self, ranks: str | int | Iterable[int] | None = None, *, force: bool = False,
                  grace: float | None = None) -> InterruptReport:
        """Interrupt what the chosen ranks run now: KeyboardInterrupt in their main thread; they keep their state.

        ``force``: also tear the process group down on every rank (releases ranks blocked in a collective),
        SIGKILL the chosen ranks that still run after ``grace`` seconds (default: ``interrupt_grace``), and
        re-create the process group when none had to be killed (else bring them back with ``restart(ranks=)``).
        Returns an InterruptReport (its ``text`` says what happened and what to do next).

        Raises MeshNotRunningError (not running, or ranks still joining) or ValueError (bad rank selection).
        """
        self._check_running(refuse_while_joining="nothing to interrupt")
        report = self.recovery.interrupt(ranks, force, grace)
        self.events.flush()
        return report

    def add_listener(self, fn: Callable[[str, dict], None]) -> None:
        """Call ``fn(kind, data)`` on every mesh event, from the events thread, outside the mesh lock (it must not
        block). The events and their data are listed in monarch_jupyter/kernel/events.py."""
        self.events.add(fn)

    def remove_listener(self, fn: Callable[[str, dict], None]) -> None:
        self.events.remove(fn)

    def placement(self) -> dict[int, dict[str, Any]]:
        """rank -> {"host", "local_rank", "local_world_size", "launcher_env"} of ranks that joined ({} for a local
        mesh, whose ranks are all on this host with local rank = rank)."""
        return self.listener.placement() if self.listener is not None else {}

    def on_rejoin(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """With ``on_rank_death="restart"``: run ``fn()`` on every replacement of a rank that died, after it got back
        what the notebook had sent (pushes, notebook functions, ``--replay`` cells). Returns ``fn`` (a decorator)."""
        return self.parts.history.add_hook(fn)

    def scale(self, n: int, timeout: float | None = None) -> ScaleReport:
        """``%mesh scale -n N``: grow or shrink to ``n`` ranks (``timeout``: s for new ranks to start): resize.py."""
        return self.parts.resizer.scale(n, timeout)

    waiting_hosts = property(lambda self: self.parts.resizer.waiting_hosts(), doc="{host: ranks} waiting for scale")

    def split(self, groups: int | Sequence[Sequence[int]], names: Sequence[str] | None = None) -> list[SubMesh]:
        """Sub-meshes (``%mesh split``): ``groups`` a count or rank lists; each its own process group, numbered from 0,
        running while the others do. Raises ValueError (ranks not covered, overlap), MonarchError: submesh.py."""
        return self.parts.splitter.split(self, groups, names)

    def merge(self) -> None:
        """One process group of the whole mesh again (``%mesh merge``), namespaces kept; MonarchError while a
        sub-mesh runs a cell (submesh.py)."""
        self.parts.splitter.merge()

    subs = property(lambda self: self.parts.splitter.current(), doc="The sub-meshes by name ({}: not split).")

    def __repr__(self) -> str:
        return f"<Mesh {self.state.describe()}>"

    def _check_running(self, refuse_while_joining: str = "") -> None:
        self.lifecycle.check_running(refuse_while_joining)


config.add_option_attributes(Mesh)
Mesh.__init__.__signature__ = config.mesh_signature(Mesh.__init__)  # type: ignore[attr-defined]
