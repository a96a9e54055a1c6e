"""Every option of a mesh, declared once: its type, default, unit and help.

The controller derives from these declarations the keyword arguments of ``monarch_jupyter.Mesh`` (and its
``mesh.<option>`` attributes), the traitlets of ``MeshMagics`` (``%config MeshMagics.cell_timeout = 60``,
``c.MeshMagics.default_nproc = 8``) and the settings it sends to ranks (``rank_settings``, the fields of
``monarch_worker.config.RankConfig``); docs/configuration.md is generated from them. They live in
``monarch_worker`` because ranks read the defaults of the settings they are sent, and the rank runtime never
imports the controller.

- ``MeshOptions``: options of one mesh (``Mesh(nproc, **options)``), most also magic traitlets.
- ``NotebookOptions``: options of the notebook magics only (how cells show, what ``%mesh start`` defaults to).

Each field's metadata says where it goes: ``trait`` (the MeshMagics traitlet name; "" for none), ``rank`` (the
RankConfig field it sets; "" when ranks never see it), ``unit`` ("s", "ranks", ...), ``choices``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MeshOptions", "NotebookOptions", "option_fields", "rank_settings", "RANK_SETTINGS"]


def _option(default: Any, help: str, *, unit: str = "", choices: tuple[str, ...] = (), trait: str = "",
            rank: str = "", factory: Any = None) -> Any:
    meta = {"help": help, "unit": unit, "choices": choices, "trait": trait, "rank": rank}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class MeshOptions:
    """The options of one mesh; ``Mesh(4, start_timeout=120)`` sets one, ``mesh.start_timeout`` reads it.

    Times are in seconds. Values are checked by ``check`` (a ValueError names the option and what it takes).
    """

    backend: str = _option("auto", "torch.distributed backend: auto = nccl when CUDA has a GPU per rank, else gloo.",
                           choices=("auto", "gloo", "nccl"), trait="default_backend", rank="backend")
    start_timeout: float = _option(60.0, "Seconds for every rank to start and join the process group before the "
                                   "start fails (nothing is left running then).", unit="s", trait="start_timeout",
                                   rank="join_timeout")
    timeout: float | None = _option(None, "Default seconds a cell may run before it is interrupted and each rank's "
                                    "stack is reported (None or 0: no limit).", unit="s", trait="cell_timeout")
    heartbeat_timeout: float = _option(30.0, "Seconds of silence after which a rank exits (it lost the controller: "
                                       "no orphans) and after which the controller declares a rank lost; 0 turns "
                                       "the controller's check off.", unit="s", trait="heartbeat_timeout",
                                       rank="heartbeat_timeout")
    heartbeat_interval: float = _option(1.0, "Seconds between heartbeats, both ways.", unit="s",
                                        rank="heartbeat_interval")
    pg_timeout: float = _option(1800.0, "Seconds a collective may block in torch.distributed before it fails (the "
                                "process group's own timeout).", unit="s", rank="pg_timeout")
    interrupt_grace: float = _option(5.0, "Seconds ranks get to stop after an interrupt or a cell timeout before "
                                     "they are reported as stuck.", unit="s")
    env: dict[str, str] = _option(None, "Extra environment variables for the ranks.", rank="env", factory=dict)
    address: str | None = _option(None, "Where the controller listens for ranks that join (launchers other than "
                                  "local): None or empty (loopback), an interface (eth0), an address or host name "
                                  "of this host, or `*`. Anything but loopback must be asked for.",
                                  trait="listen_address")
    port: int = _option(0, "TCP port the controller listens on for joining ranks (0: any free port).")
    encrypt: bool = _option(False, "Encrypt joining ranks' connections with CurveZMQ (the secret always "
                            "authenticates both sides).")
    secret_file: str | None = _option(None, "Where to write the per-mesh secret (mode 0600) for joining ranks "
                                      "(None: Jupyter's runtime directory).")
    output_fold: int = _option(8, "In a cell on more than this many ranks, a line that several ranks print "
                               "byte for byte alike at about the same time (within 0.1 s) is shown once with their "
                               "ranks, `[rank0-63]: epoch 1 done`; lines that differ in any character never fold. "
                               "0: never fold.", unit="ranks", trait="output_fold")
    oversubscribe: bool = _option(False, "Start local ranks past what this host can carry (more than 32 per CPU "
                                  "core, or more memory or open files than it has); refused otherwise, with what to "
                                  "expect (`%mesh start --force`).")
    output_line_limit: int = _option(65536, "Bytes of one line of rank output shown in the notebook: a longer line "
                                     "shows its first bytes and a note with its size and the file that holds it "
                                     "whole (in the system's temporary folder; on a rank's own host for ranks "
                                     "behind a host agent, which cut at 65,536). 0: no limit.", unit="bytes",
                                     trait="output_line_limit")
    on_rank_death: str = _option("report", "What the mesh does when a rank dies by itself (not killed by the mesh): "
                                 "report (the cell fails, `%mesh restart --rank R` brings it back) or restart (the "
                                 "launcher that started it starts it again at once; it joins a fresh process group "
                                 "with the others and gets back what the notebook sent: docs/fault_tolerance.md).",
                                 choices=("report", "restart"), trait="on_rank_death")
    restart_limit: int = _option(3, "With on_rank_death restart: a rank that dies more than this many times within "
                                 "restart_window seconds is given up (it stays dead, with a message).", unit="deaths",
                                 trait="restart_limit")
    restart_window: float = _option(60.0, "The window of restart_limit.", unit="s", trait="restart_window")
    torchft: bool = _option(False, "Run a torchft Lighthouse with the mesh (a process the mesh owns and ends) and "
                            "make each rank one torchft replica group: TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID and "
                            "NUM_REPLICA_GROUPS on every rank, `monarch_worker.ft.manager(...)` for its Manager "
                            "(docs/fault_tolerance.md).", trait="torchft")
    torchft_min_replicas: int = _option(1, "The Lighthouse's min_replicas: a quorum needs at least this many replica "
                                        "groups (ranks); fewer wait, with the wait shown.", unit="ranks",
                                        trait="torchft_min_replicas")

    def check(self) -> MeshOptions:
        """Validate every value; returns self.

        Raises
        ------
        ValueError
            A value of the wrong kind or out of range (the message names the option and what it takes).
        """
        for f in option_fields(MeshOptions):
            check_value(f, getattr(self, f.name))
        return self


@dataclass
class NotebookOptions:
    """Options of the ``%mesh`` / ``%%mesh`` magics only (traitlets of MeshMagics)."""

    default_nproc: int = _option(4, "Ranks started by `%mesh start` without -n.", unit="ranks",
                                 trait="default_nproc")
    stream_order: str = _option("arrival", "Order of rank output in a cell: arrival (live, as it comes) or rank "
                                "(rank r's lines after lower ranks finished the cell: the same output every run, "
                                "e.g. for nbval).", choices=("arrival", "rank"), trait="stream_order")
    debug_on_interrupt: str = _option("continue", "What ranks stopped at a pdb prompt do when the kernel is "
                                      "interrupted there: continue (the cell runs on, its later breakpoints are "
                                      "skipped) or raise (KeyboardInterrupt where they stopped; the cell is "
                                      "interrupted).", choices=("continue", "raise"), trait="debug_on_interrupt")
    live_view: str = _option("auto", "Live per-rank view under each %%mesh cell and in `%mesh status`: auto = a "
                             "dashboard widget in a Jupyter kernel, compact text in a terminal; widget, text, or off "
                             "(`%%mesh --no-widget` turns it off for one cell).",
                             choices=("auto", "widget", "text", "off"), trait="live_view")
    dashboard_fold: int = _option(16, "Past this many ranks the dashboard folds into a per-state summary plus "
                                  "stragglers and failed ranks (the full table opens on demand).", unit="ranks",
                                  trait="dashboard_fold")
    output_lines: int = _option(1_000_000, "Lines of output a %%mesh cell's view keeps (every rank's together; past "
                                "them the oldest go, and the view says how many): memory bounded by a flood. "
                                "`%%mesh --no-widget` streams every line and keeps none.", unit="lines",
                                trait="output_lines")
    listen_timeout: float = _option(300.0, "Seconds `%mesh listen` waits for every rank to join before it reports "
                                    "who is missing.", unit="s", trait="listen_timeout")
    completion_timeout: float = _option(0.5, "Seconds Tab completion and Shift-Tab inspection in a %%mesh cell (or "
                                        "in auto mode) wait for the rank's answer before the kernel's own are "
                                        "shown.", unit="s", trait="completion_timeout")
    completion_rank: int = _option(0, "The rank whose namespace completes names in %%mesh cells (the first rank "
                                   "of the cell's --ranks when it does not run there).", unit="rank",
                                   trait="completion_rank")
    prewarm: bool = _option(True, "Start the local fork server (which imports torch once) when the extension "
                            "loads, so the first `%mesh start` does not wait for `import torch`.", trait="prewarm")


def option_fields(cls: type) -> tuple[dataclasses.Field, ...]:
    """The declared options of ``MeshOptions`` or ``NotebookOptions``, in declaration order."""
    return dataclasses.fields(cls)


def check_value(f: dataclasses.Field, value: Any) -> None:
    """Raise ValueError when ``value`` does not fit option ``f``."""
    name, kind, meta = f.name, f.type, f.metadata
    if value is None and "None" in str(kind):
        return
    if "dict" in str(kind):
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ValueError(f"option {name} takes a dict of str to str (environment variables), got {value!r}")
        return
    if meta["choices"]:
        if value not in meta["choices"]:
            raise ValueError(f"option {name} must be one of {', '.join(meta['choices'])}; got {value!r}")
        return
    if "bool" in str(kind):
        if not isinstance(value, bool):
            raise ValueError(f"option {name} takes True or False, got {value!r}")
    elif "float" in str(kind) or "int" in str(kind):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            unit = f" ({meta['unit']})" if meta["unit"] else ""
            raise ValueError(f"option {name} takes a number >= 0{unit}, got {value!r}")
        if "int" in str(kind) and "float" not in str(kind) and not isinstance(value, int):
            raise ValueError(f"option {name} takes a whole number, got {value!r}")
    elif "str" in str(kind) and not isinstance(value, str):
        raise ValueError(f"option {name} takes a string, got {value!r}")


#: RankConfig field -> the MeshOptions field whose value it carries (fields with a ``rank`` name).
RANK_SETTINGS: dict[str, str] = {f.metadata["rank"]: f.name for f in option_fields(MeshOptions) if f.metadata["rank"]}


def rank_settings(options: MeshOptions) -> dict[str, Any]:
    """The RankConfig fields ``options`` sets (what a rank is sent at start, or in Welcome when it joined)."""
    return {rank_name: getattr(options, name) for rank_name, name in RANK_SETTINGS.items()}


DEFAULTS = MeshOptions()
"""The declared defaults (RankConfig takes its defaults from here)."""
