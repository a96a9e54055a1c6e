"""IPython magics ``%mesh`` and ``%%mesh``: parse arguments, call the Python API, nothing else.

Options that users set once go in traitlets (``c.MeshMagics.default_nproc = 8`` in ipython_config.py, or
``%config MeshMagics.stream_order = 'rank'``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import math
import re
import shlex
import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from .. import errors
from ..kernel import config, dap, registry
from ..kernel.launch import launcher_for
from ..kernel.mesh import Mesh
from ..kernel.resize import ScaleReport
from ..ranks import parse_ranks
from . import debug as debug_magics
from . import scripts, submesh, transfer
from .auto import AutoMode
from .complete import MeshCompletion

log = logging.getLogger(__name__)

__all__ = ["MeshMagics", "load", "unload"]

SUBCOMMANDS = ("start", "listen", "status", "stop", "restart", "scale", *submesh.SUBCOMMANDS, "stacks",
               *scripts.SUBCOMMANDS,
               *transfer.SUBCOMMANDS, "debug", "inspect", "interrupt", "auto")


class HelpShown(Exception):
    """A subcommand's --help was printed: nothing else runs (caught by ``MeshMagics.mesh``)."""


_SECTION = re.compile(r"\n[ \t]*(?:Parameters|Returns|Raises|Yields|Notes|Examples)\n[ \t]*-{3,}[ \t]*\n")


def help_text(func: Any, prog: str) -> str:
    """The options of magic subcommand ``func`` (its IPython magic_arguments parser), as argparse prints them for
    ``prog --help`` (IPython's parsers are built without -h: ``%magic?`` shows them, not ``%mesh start?``)."""
    parser = copy.copy(func.parser)
    parser.prog, parser.formatter_class = prog, argparse.HelpFormatter
    # The docstring's numpy sections (Raises, Returns, ...) are for readers of the code, not for --help.
    parser.description = _SECTION.split(parser.description or "", 1)[0].rstrip() or None
    return parser.format_help().rstrip()


def _rest(line: str) -> tuple[str, str]:
    parts = line.strip().split(None, 1)
    if not parts:
        return "", ""
    return parts[0], parts[1] if len(parts) > 1 else ""


@magics_class
class MeshMagics(Magics):
    """``%mesh SUBCOMMAND ...`` manages the mesh; ``%%mesh [options]`` runs a cell on its ranks.

    Its configurable traitlets (``default_nproc``, ``cell_timeout``, ...) are derived from the one declaration of
    the options (``monarch_worker.options``); docs/configuration.md lists them.
    """

    locals().update(config.traits())  # the class body's namespace: one traitlet per declared option

    def __init__(self, shell: Any = None, **kwargs: Any) -> None:
        super().__init__(shell=shell, **kwargs)
        self.meshes: list[Mesh] = []
        self.auto = AutoMode(shell)  # %mesh auto, %%local (auto.py)
        self.completion = MeshCompletion(self)  # Tab and Shift-Tab from a rank (complete.py)

    def option(self, name: str) -> Any:
        """The value of mesh option ``name`` (a MeshOptions field) as configured here (``cell_timeout`` 0 -> None)."""
        return config.trait_value(self, name)

    def setting(self, name: str) -> Any:
        """The value of the magics' own option ``name`` (a NotebookOptions traitlet)."""
        return getattr(self, name)

    @property
    def user_ns(self) -> dict[str, Any]:
        """The notebook's namespace."""
        assert self.shell is not None, "the magics are not registered with a shell"
        return self.shell.user_ns

    # ------------------------------------------------------------------ %mesh / %%mesh

    @line_cell_magic
    def mesh(self, line: str, cell: str | None = None) -> Any:
        """%mesh start|listen|status|stop|restart|stacks|run|interrupt|push|pull|scatter|gather|debug|inspect ...,
        and %%mesh ...

        Run `%mesh SUBCOMMAND --help` for each subcommand's options, `%mesh --help` for the cell magic's.
        """
        try:
            if cell is not None:
                return self._cell(line, cell)
            return self._line(line)
        except HelpShown:
            return None

    def _line(self, line: str) -> Any:
        sub, rest = _rest(line)
        if not sub:
            raise UsageError(
                f"%mesh needs a subcommand: {', '.join(SUBCOMMANDS)} (e.g.  %mesh start -n 4); %%mesh as a cell "
                "magic runs the cell on the ranks. `%mesh SUBCOMMAND --help` lists each one's options.")
        if sub in ("-h", "--help", "help"):  # %%mesh --help alone in a cell is refused by IPython (no body)
            print(f"%mesh SUBCOMMAND: {', '.join(SUBCOMMANDS)}; `%mesh SUBCOMMAND --help` lists each one's "
                  f"options.\n\n{help_text(self._cell, '%%mesh')}")
            raise HelpShown("%mesh")
        handler = {
            "start": self._start,
            "listen": self._listen,
            "status": self._status,
            "stop": self._stop,
            "restart": self._restart,
            "scale": self._scale,
            "split": lambda rest: submesh.split(self, rest),
            "merge": lambda rest: submesh.merge(self, rest),
            "stacks": self._stacks,
            "run": lambda rest: scripts.run(self, rest),
            "push": lambda rest: transfer.push(self, rest),
            "pull": lambda rest: transfer.pull(self, rest),
            "scatter": lambda rest: transfer.scatter(self, rest),
            "gather": lambda rest: transfer.gather(self, rest),
            "debug": lambda rest: debug_magics.debug(self, rest),
            "inspect": lambda rest: debug_magics.inspect(self, rest),
            "interrupt": self._interrupt,
            "auto": self.auto.command,
        }.get(sub)
        if handler is None and sub == "select":
            raise UsageError("%mesh select R goes in the visual debugger's Evaluate Code dialog while ranks are "
                             "stopped at a breakpoint (it shows rank R in the sidebar); no notebook cell runs then")
        if handler is None:
            raise UsageError(
                f"unknown %mesh subcommand {sub!r}; use one of: {', '.join(SUBCOMMANDS)} "
                "(e.g.  %mesh start -n 4), or %%mesh as a cell magic to run code on the ranks")
        try:
            return handler(rest)
        except errors.MeshInterrupt:
            raise
        except KeyboardInterrupt:  # one line, not the controller's frames (start and restart say more)
            raise errors.mesh_interrupt(
                f"%mesh {sub} was interrupted while it waited; what it had begun may still complete: "
                "%mesh status  shows where each rank is") from None

    # ------------------------------------------------------------------ subcommands

    @magic_arguments()
    @argument("-n", "--world-size", "--nproc", dest="world_size", type=int, default=None,
              help="number of ranks: the world size (default: default_nproc)")
    @argument("--backend", choices=["auto", "gloo", "nccl"], default=None, help="torch.distributed backend")
    @argument("--timeout", type=float, default=None, help="seconds for every rank to start and join")
    @argument("--launcher", choices=["local", "torchrun", "agent", "slurm"], default="local",
              help="local: fork server on this host; torchrun: torchrun on this host; agent: one host agent on this "
                   "host (the controller pays per host: the choice for 16 ranks or more); slurm: srun (in an "
                   "allocation)")
    @argument("--nodes", type=int, default=None, help="slurm: nodes for srun (--nodes)")
    @argument("--srun-args", default="", help='slurm: extra srun arguments, quoted: --srun-args "--partition gpu"')
    @argument("--nnodes", type=int, default=1, help="torchrun: must be 1 (use %%mesh listen for several hosts)")
    @argument("--nproc-per-node", type=int, default=None, help="torchrun/agent/slurm: ranks per node")
    @argument("--address", default=None, help="slurm/torchrun/agent: interface or address the ranks connect to")
    @argument("--port", type=int, default=0, help="slurm/torchrun/agent: TCP port to listen on (0: any)")
    @argument("--encrypt", action="store_true", help="slurm/torchrun/agent: encrypt connections (CurveZMQ)")
    @argument("--force", action="store_true",
              help="local/torchrun/agent: start (or scale to) more ranks than the host can carry (oversubscribe)")
    @argument("--on-rank-death", choices=["report", "restart"], default=None,
              help="restart: a rank that dies is started again and gets back what the notebook sent "
                   "(default: on_rank_death)")
    @argument("--torchft", action="store_true", help="run a torchft Lighthouse; each rank is one replica group")
    def _start(self, rest: str) -> Mesh:
        """%mesh start [-n N] [--backend gloo|nccl] [--timeout S] [--launcher local|torchrun|agent|slurm] [...]:
        start N ranks on this host, under torchrun, behind one host agent, or with srun inside a SLURM allocation."""
        args = self.parse_args(self._start, rest, "start")
        self._check_none_running()
        world_size = args.world_size
        if args.nproc_per_node is not None and args.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
        if world_size is None:
            per_node = args.nproc_per_node if args.launcher in ("torchrun", "agent") else None
            world_size = (per_node or self.setting("default_nproc")) * args.nnodes
        if world_size < 1:
            raise UsageError(f"-n must be at least 1 rank, got {world_size}")
        address = args.address if args.address is not None else self.option("address")
        if args.launcher == "local" and (args.address is not None or args.port or args.encrypt):
            raise UsageError("--address/--port/--encrypt are for --launcher torchrun, agent or slurm (local ranks use "
                             "the fork server over loopback)")
        if args.launcher == "slurm" and address is None:
            raise UsageError("--launcher slurm starts ranks on other hosts: give --address with an interface or "
                             "address of this host that they reach (e.g. --address ib0; --address 127.0.0.1 when "
                             "the allocation is this host only). Nothing listens beyond loopback unless asked.")
        try:
            launcher = launcher_for(args.launcher, world_size, nproc_per_node=args.nproc_per_node,
                                    nnodes=args.nnodes, nodes=args.nodes, srun_args=args.srun_args)
            m = Mesh(
                world_size,
                launcher=args.launcher if launcher is None else launcher,
                backend=args.backend or self.option("backend"),
                start_timeout=args.timeout if args.timeout is not None else self.option("start_timeout"),
                timeout=self.option("timeout"),
                heartbeat_timeout=self.option("heartbeat_timeout"),
                output_fold=self.option("output_fold"),
                output_line_limit=self.option("output_line_limit"),
                address=address if args.launcher != "local" else None,
                port=args.port,
                encrypt=args.encrypt,
                oversubscribe=args.force,
                on_rank_death=args.on_rank_death or self.option("on_rank_death"),
                restart_limit=self.option("restart_limit"),
                restart_window=self.option("restart_window"),
                torchft=args.torchft or self.option("torchft"),
                torchft_min_replicas=self.option("torchft_min_replicas"),
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
        except KeyboardInterrupt:  # Mesh.start tore down what it had started: one line, not the start's frames
            raise errors.mesh_interrupt(f"%mesh start was interrupted; no rank is left running "
                                        f"(%mesh start {rest.strip()}  starts again)") from None
        self.meshes.append(m)
        from ..widgets import monitor_for

        monitor_for(m)  # live views see every event from the start
        return m

    @magic_arguments()
    @argument("-n", "--world-size", dest="world_size", type=int, required=True,
              help="number of ranks that will join: the world size")
    @argument("--address", default=None, help="interface (eth0), address or host name of this host that the ranks "
              "reach (default: loopback only)")
    @argument("--port", type=int, default=0, help="TCP port (0: any free port)")
    @argument("--timeout", type=float, default=None, help="seconds for every rank to join (then: who is missing)")
    @argument("--nproc-per-node", type=int, default=None, help="ranks per host in the printed commands")
    @argument("--encrypt", action="store_true", help="encrypt the connections (CurveZMQ)")
    @argument("--backend", choices=["auto", "gloo", "nccl"], default=None, help="torch.distributed backend")
    def _listen(self, rest: str) -> None:
        """%mesh listen --world-size N [--address HOST_OR_INTERFACE] [--timeout S] [--port P] [--nproc-per-node P]
        [--encrypt]: wait for N ranks started elsewhere (torchrun, srun, ...); prints the commands that start
        them. Cells run once all joined."""
        args = self.parse_args(self._listen, rest, "listen")
        self._check_none_running()
        address = args.address if args.address is not None else self.option("address")
        try:
            m = Mesh.listen(
                args.world_size,
                address=address,
                port=args.port,
                timeout=args.timeout if args.timeout is not None else self.setting("listen_timeout"),
                encrypt=args.encrypt,
                nproc_per_node=args.nproc_per_node,
                backend=args.backend or self.option("backend"),
                heartbeat_timeout=self.option("heartbeat_timeout"),
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
        m.options.timeout = self.option("timeout")  # a cell's default timeout (listen's `timeout` is the join's)
        self.meshes.append(m)

    def _check_none_running(self) -> None:
        running = registry.peek_current()
        if running is not None and running.start_failure:
            running.stop()  # a listen whose ranks did not all come (it said so in its cell): release it
        if running is not None and (running.running or running.listening):
            raise UsageError(f"a mesh is already running ({running!r}); use  %mesh restart  for fresh ranks or "
                             "%mesh stop  first")

    @magic_arguments()
    def _status(self, rest: str) -> Any:
        """%mesh status: state, pid, device and memory of every rank."""
        self.parse_args(self._status, rest, "status")
        m = self.current()
        from ..widgets import status_view

        waiting = ", ".join(f"{h} ({n} ranks)" for h, n in m.waiting_hosts.items())
        notes = [self.auto.status()] if self.auto.on else []
        if waiting:
            notes.append(f"hosts waiting for  %mesh scale -n N  to admit them: {waiting}")
        return status_view(m, mode=self.setting("live_view"), fold_threshold=self.setting("dashboard_fold"),
                           note="\n".join(notes))

    @magic_arguments()
    def _stop(self, rest: str) -> None:
        """%mesh stop: stop every rank."""
        self.parse_args(self._stop, rest, "stop")
        m = self.current(require_running=False)
        if m.listening or m.start_failure:  # still waiting for its ranks to join (or they did not all come)
            late = "whose ranks did not all join in time" if m.start_failure else "which was waiting for its ranks"
            m.stop()
            print(f"stopped the mesh, {late}; the ranks that had joined were told to exit")
            return
        if not m.running:
            print("the mesh is already stopped (%mesh restart starts it again)")
            return
        m.stop()
        print(f"stopped {m.nproc} ranks{_ended(m)}")

    @magic_arguments()
    @argument("--rank", "--ranks", dest="ranks", default=None,
              help="restart only these ranks (e.g. the dead ones); the others keep their state")
    def _restart(self, rest: str) -> Mesh:
        """%mesh restart [--rank SPEC]: fresh processes, fresh namespaces, a fresh process group; with --rank,
        fresh processes for those ranks only, and every other rank keeps its namespace and joins a fresh
        process group with them."""
        args = self.parse_args(self._restart, rest, "restart")
        m = self.current(require_running=args.ranks is not None)
        try:
            m.restart(ranks=args.ranks)
            if args.ranks is None and (ended := _ended(m)):
                print(f"restarted{ended}")
            return m
        except ValueError as e:
            raise UsageError(str(e)) from None
        except KeyboardInterrupt:  # one line, not the restart's frames
            where = ("the mesh is stopped and no rank is left running (%mesh restart  starts it again)"
                     if not m.running else "%mesh status  shows where each rank is")
            raise errors.mesh_interrupt(f"%mesh restart was interrupted; {where}") from None

    @magic_arguments()
    @argument("-n", "--nproc", dest="world_size", type=int, required=True, help="the number of ranks to have")
    @argument("--timeout", type=float, default=None, help="seconds new ranks have to start (default: the mesh's "
              "start timeout); past it they are stopped and the mesh stays as it was")
    def _scale(self, rest: str) -> ScaleReport:
        """%mesh scale -n N: grow or shrink the running mesh to N ranks (local, or on its host agents); the ranks
        that stay keep their namespaces, and every rank joins a fresh process group of N ranks."""
        args = self.parse_args(self._scale, rest, "scale")
        m = self.current(require_running=True)
        try:
            return m.scale(args.world_size, args.timeout)
        except ValueError as e:
            raise UsageError(str(e)) from None

    @magic_arguments()
    @argument("--ranks", "-r", default=None, help="ranks to interrupt (default: all)")
    @argument("--force", action="store_true",
              help="tear the process group down (releases collectives) and SIGKILL ranks that still do not stop")
    @argument("--grace", type=float, default=None, help="seconds the ranks get to stop (default: interrupt_grace)")
    def _interrupt(self, rest: str) -> None:
        """%mesh interrupt [--ranks SPEC] [--force] [--grace S]: KeyboardInterrupt in what the ranks run now
        (e.g. a %%mesh --async cell, or ranks that did not stop after the notebook's interrupt)."""
        args = self.parse_args(self._interrupt, rest, "interrupt")
        try:
            report = self.current().interrupt(args.ranks, force=args.force, grace=args.grace)
        except ValueError as e:
            raise UsageError(str(e)) from None
        print(report.text)

    @magic_arguments()
    @argument("--ranks", default=None, help="ranks to ask (default: all)")
    def _stacks(self, rest: str) -> Any:
        """%mesh stacks [--ranks SPEC]: where each rank's main thread is now, identical stacks grouped."""
        args = self.parse_args(self._stacks, rest, "stacks")
        try:
            return self.current().stacks(args.ranks)
        except ValueError as e:
            raise UsageError(str(e)) from None

    # ------------------------------------------------------------------ %%mesh

    @magic_arguments()
    @argument("--ranks", "-r", default=None, help="ranks to run on: 0 | 0,2 | 1-3 | ::2 (default: all)")
    @argument("--mesh", dest="sub", default=None,
              help="run on this sub-mesh (%%mesh split); --ranks then counts inside it")
    @argument("--timeout", "-t", type=float, default=None, help="seconds before the cell is interrupted")
    @argument("--out", "-o", default=None, help="store rank -> value of the last expression under this name")
    @argument("--order", choices=["arrival", "rank"], default=None, help="output order (see stream_order)")
    @argument("--pdb-commands", default=None, help='pdb commands separated by ";" answering the first breakpoint() '
              'prompts (e.g. "p x; c"); prompts left without one continue')
    @argument("--on-interrupt", choices=["continue", "raise"], default=None,
              help="ranks stopped at a pdb prompt when the kernel is interrupted: continue or raise "
                   "(default: debug_on_interrupt)")
    @argument("--no-widget", action="store_true", help="no live per-rank view for this cell")
    @argument("--async", dest="async_", action="store_true",
              help="return a CellHandle at once (done(), wait(timeout), result()); the live view keeps updating")
    @argument("--replay", action="store_true",
              help="on_rank_death restart: run this cell again on a rank's replacement (it defines the namespace)")
    @argument("--rejoin", action="store_true",
              help="on_rank_death restart: a rank's replacement rejoins this cell while it runs (a torchft loop)")
    def _cell(self, line: str, cell: str) -> Any:
        """%%mesh [--ranks SPEC] [--mesh NAME] [--timeout S] [--out NAME] [--order arrival|rank] [--no-widget]
        [--async]: run the cell on the ranks (of sub-mesh NAME)."""
        args = self.parse_args(self._cell, line, None)
        m = self.current()
        sub = submesh.sub_mesh(m, args.sub) if args.sub is not None else None
        target: Any = sub if sub is not None else m
        if args.out is not None and not args.out.isidentifier():
            raise UsageError(f"--out needs a Python name, got {args.out!r}")
        if args.async_ and (args.out or args.timeout is not None):
            raise UsageError("%%mesh --async returns a CellHandle: use handle.result(timeout=S) instead of "
                             "--out / --timeout")
        filename = f"<mesh In[{count}]>" if (count := self._prompt_count()) is not None else None
        debugged = dap.prepare_cell(self.shell, m, cell, args.ranks)  # None unless the visual debugger is attached
        if debugged is not None:
            cell, filename = debugged
        view = None
        if not args.no_widget:
            from ..widgets import cell_view

            try:
                chosen = sub.to_global(args.ranks) if sub is not None else parse_ranks(args.ranks, m.nproc)
            except ValueError as e:
                raise UsageError(str(e)) from None
            title = "mesh cell (auto mode)" if self.auto.on else "mesh cell"
            view = cell_view(m, chosen, mode=self.setting("live_view"), fold_threshold=self.setting("dashboard_fold"),
                             title=title if sub is None else f"{title} on {args.sub}",
                             defer=0.0 if args.async_ else None,  # an --async cell returns at once: show it now
                             lines_kept=self.setting("output_lines"))
        capture = view.capture() if view is not None else contextlib.nullcontext()
        try:
            with capture, m.debugger.options(args.pdb_commands,
                                             args.on_interrupt or self.setting("debug_on_interrupt")):
                result = target.run(
                    cell,
                    ranks=args.ranks,
                    timeout=args.timeout if args.timeout is not None else self.option("timeout"),
                    namespace=self.user_ns if self.shell is not None else None,
                    filename=filename,
                    order=args.order or self.setting("stream_order"),
                    block=not args.async_,
                    replay=args.replay,
                    rejoin=args.rejoin,
                )
        except ValueError as e:
            raise UsageError(str(e)) from None
        except SyntaxError as e:
            # IPython shows any SyntaxError with the frames it passed through; this shows only the cell's line.
            raise errors.CellSyntaxError(e) from None
        except errors.MeshError as e:
            if args.out:
                self.user_ns[args.out] = e.results
            raise
        finally:
            if view is not None and (not args.async_ or view.handle is None):
                view.finish()  # the final state, before the result or the traceback
        if args.async_:
            return result
        if args.out:
            self.user_ns[args.out] = result if result is not None else {}
            return None
        return result

    @cell_magic
    def local(self, line: str, cell: str) -> None:
        """%%local: run this cell in the kernel (in auto mode, where other cells run on the mesh)."""
        self.auto.run_local(cell)

    # ------------------------------------------------------------------ helpers

    def _prompt_count(self) -> int | None:
        """The number the notebook shows beside the running cell (``In [N]``), or None outside a shell.

        IPython's displayhook knows it (its ``Out[N]``): IPython 9 increments ``execution_count`` before it runs a cell,
        IPython 8 after, so ``execution_count`` itself is one too many with IPython 9.
        """
        hook = getattr(self.shell, "displayhook", None)
        count = getattr(hook, "prompt_count", None)
        return count if isinstance(count, int) else getattr(self.shell, "execution_count", None)

    def parse_args(self, func: Any, rest: str, sub: str | None) -> Any:
        """Parse the arguments ``rest`` of subcommand ``sub`` (None: the cell magic) with ``func``'s parser.

        Raises UsageError naming the subcommand and pointing at its --help."""
        # Split as a POSIX shell does (shlex), as torchrun's command line would be: quotes group words and go away
        # (--msg='hi there' is one argument, --rank '2' is 2). IPython's own parse_argstring keeps the quotes.
        try:
            argv = shlex.split(rest)
        except ValueError as e:
            raise UsageError(f"cannot parse {rest!r}: {e}") from None
        prog = f"%mesh {sub}" if sub else "%%mesh"
        try:
            args = func.parser.parse_args(argv)
        except UsageError as e:
            # -h / --help where the parser takes options (after a script's name they are the script's own)
            if {"-h", "--help"} & set(argv):
                print(help_text(func, prog))
                raise HelpShown(prog) from None
            shown = f"{prog} --help" if sub else "%mesh --help"  # IPython runs no %%mesh cell without a body
            raise UsageError(f"{prog}: {e}. Run  {shown}  for the options.") from None
        ranks = getattr(args, "ranks", None)
        if isinstance(ranks, str) and not ranks.strip():
            raise UsageError(f"{prog}: the rank selection is empty; give ranks (e.g. 0,2 or 1-3), or leave the "
                             "option out for every rank")
        timeout = getattr(args, "timeout", None)
        if timeout is not None and not 0 < timeout < math.inf:
            raise UsageError(f"{prog}: --timeout takes a positive, finite number of seconds, got {timeout:g} (leave "
                             "it out for no limit)")
        return args

    def current(self, require_running: bool = True) -> Mesh:
        """The mesh the magics act on (the current one, else the last one they started).

        Raises UsageError when there is none, or (``require_running``) when it is stopped."""
        m = registry.peek_current()
        if m is None and self.meshes:
            m = self.meshes[-1]
        if m is None:
            raise UsageError("no mesh is running: start one with  %mesh start -n N  (N ranks, e.g. -n 4)")
        if require_running and not m.running and not m.listening:
            raise UsageError("the mesh is stopped: start it with  %mesh restart  (or  %mesh start -n N)")
        return m


def _ended(m: Mesh) -> str:
    """What a stop or a full restart ended besides the ranks: cells still running (an --async cell's handle)."""
    n = m.lifecycle.ended_cells
    return (f"; it ended {n} cell{'s' * (n > 1)} still running (an --async cell's handle.result() raises "
            "RankDiedError: the mesh was stopped)") if n else ""


# Output that reaches a cell after it returned (block=False, --async, late rank output) is routed by the parent
# header captured when the cell ran; ipykernel keeps that header in a ContextVar from 6.29 on. Older kernels send
# such output to whichever cell runs then. pyproject.toml requires 6.29; this catches environments that bypassed it.
IPYKERNEL_FLOOR = (6, 29)


def _check_ipykernel() -> str | None:
    """A note when the running kernel is an ipykernel older than IPYKERNEL_FLOOR, else None."""
    ipykernel = sys.modules.get("ipykernel")
    version = getattr(ipykernel, "version_info", None)
    if not isinstance(version, tuple) or tuple(version[:2]) >= IPYKERNEL_FLOOR:
        return None
    floor = ".".join(map(str, IPYKERNEL_FLOOR))
    return (f"note: this kernel runs ipykernel {getattr(ipykernel, '__version__', version)}, older than {floor}: "
            f"output that arrives after a cell returned can land in the next cell. Fix:  "
            f"pip install 'ipykernel>={floor}'  and restart the kernel.")


_MAGICS: dict[int, MeshMagics] = {}


def load(ipython: Any) -> None:
    """Register the magics on ``ipython`` (idempotent) and warm the fork server up."""
    if id(ipython) in _MAGICS:
        return
    magics = MeshMagics(shell=ipython, parent=ipython)
    ipython.register_magics(magics)
    magics.auto.install()
    magics.completion.install()
    dap.install(ipython)
    _MAGICS[id(ipython)] = magics
    note = _check_ipykernel()
    if note:
        print(note, file=sys.stderr)
    if magics.setting("prewarm"):
        from ..kernel.launch.local import prewarm

        prewarm(magics.option("start_timeout"))


def unload(ipython: Any) -> None:
    """Stop every mesh the magics started, stop the fork server, remove the magics."""
    magics = _MAGICS.pop(id(ipython), None)
    if magics is None:
        return
    for m in magics.meshes:
        if m.running:
            m.stop()
    current = registry.peek_current()
    if current is not None and current.running:
        current.stop()
    from ..kernel.launch.local import shutdown

    shutdown()
    # Loaded as `monarch` or as `monarch_jupyter`: unloading one name unloads both, so either loads again.
    loaded = getattr(getattr(ipython, "extension_manager", None), "loaded", None)
    if isinstance(loaded, set):
        loaded.discard("monarch")
        loaded.discard("monarch_jupyter")
    mm = ipython.magics_manager
    magics.auto.uninstall()
    magics.completion.uninstall()
    dap.uninstall(ipython)
    for kind in ("line", "cell"):
        mm.magics[kind].pop("mesh", None)
    mm.magics["cell"].pop("local", None)
    if magics in mm.registry.values():
        mm.registry = {k: v for k, v in mm.registry.items() if v is not magics}
