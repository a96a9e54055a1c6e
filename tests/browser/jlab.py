"""Real-browser test harness: JupyterLab server + headless Chromium via Playwright.

Typical use in a test::

    from tests.browser import jlab

    def test_something(tmp_path):
        nb = jlab.write_notebook(tmp_path / "demo.ipynb", ["%load_ext monarch", "print(1 + 1)"])
        with jlab.jupyterlab_server(tmp_path) as server, jlab.chromium() as browser:
            with jlab.open_notebook(browser, server, nb.name) as notebook:
                notebook.run_all()
                assert notebook.output_text(1) == "2"
                notebook.screenshot(tmp_path / "shot.png")

Design notes
------------
* The server is ``python -m jupyterlab`` from the *same* interpreter as pytest, so
  the ``python3`` kernel sees the same site-packages (and ``extra_env`` such as
  ``PYTHONPATH``).  It listens on 127.0.0.1 on a free port with a random token,
  ``--allow-root --no-browser``.
* Every per-user Jupyter directory that could make runs differ (config, runtime,
  lab settings, lab workspaces, IPython profile) is a fresh temporary directory.
  ``page_config.json`` there disables plugins that pop dialogs or reach the
  network (announcements / news / update check, extension manager); user
  settings switch off autosave and notebook windowing (so every cell is in the
  DOM and can be queried even when scrolled out of view).
* On exit the server is shut down via ``/api/shutdown`` (which shuts its kernels
  down cleanly); then every process left in the server's session, in any
  kernel's session, or below the server in the process tree is SIGTERMed and
  then SIGKILLed.  No orphans are left behind.
* Chromium is Debian's ``/usr/bin/chromium``; ``playwright install`` is never
  needed (nor possible without network).
* Cells are run like a user does: click the cell's prompt, press Ctrl+Enter
  ("run and stay", so no new cell is appended).  Completion is detected by an
  in-page MutationObserver armed before the run: the prompt went to ``[*]:`` and
  no prompt shows ``*`` any more (robust to kernel restarts and errors).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # playwright is optional at import time (tests skip without it)
    from playwright.sync_api import Browser, ConsoleMessage, Locator, Page
    from playwright.sync_api import Error as PlaywrightError

__all__ = [
    "CHROMIUM_PATH",
    "CHROMIUM_ARGS",
    "DEFAULT_DISABLED_EXTENSIONS",
    "LabServer",
    "Execution",
    "NotebookPage",
    "HarnessError",
    "browser_prerequisites_missing",
    "write_notebook",
    "jupyterlab_server",
    "chromium",
    "open_notebook",
]

CHROMIUM_PATH = "/usr/bin/chromium"
"""Debian's Chromium (``apt-get install chromium``)."""

CHROMIUM_ARGS: tuple[str, ...] = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # Containers often mount a tiny /dev/shm; use /tmp for shared memory instead.
    "--disable-dev-shm-usage",
)
"""Flags Chromium is launched with (the networking ones keep it quiet on a closed network)."""

DEFAULT_DISABLED_EXTENSIONS: tuple[str, ...] = (
    # "Would you like to receive official Jupyter news?" toast + update checks.
    "@jupyterlab/apputils-extension:announcements",
    # Talks to PyPI and asks for a disclaimer.
    "@jupyterlab/extensionmanager-extension",
)
"""JupyterLab plugins disabled in the test server's ``page_config.json``."""

# User settings written into the temporary JUPYTERLAB_SETTINGS_DIR.
_USER_SETTINGS: dict[str, dict[str, Any]] = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        # Keep every cell attached to the DOM (no virtualisation).
        "windowingMode": "none",
    },
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {
        # No saves -> no "file changed on disk" dialog if a test rewrites the file.
        "autosave": False,
    },
}


class HarnessError(RuntimeError):
    """Something in the server/browser harness went wrong (timeouts, dialogs, crashes)."""


def browser_prerequisites_missing() -> str | None:
    """Return why browser tests cannot run here, or ``None`` if they can.

    Checks for ``/usr/bin/chromium`` and the ``playwright`` package (JupyterLab is a
    hard requirement: without it the tests fail rather than skip).  Use as
    ``pytest.mark.skipif(bool(reason), reason=reason)``.
    """
    missing = []
    if not os.access(CHROMIUM_PATH, os.X_OK):
        missing.append(f"{CHROMIUM_PATH} is not installed (apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("python package 'playwright' is not installed (pip install playwright)")
    if not missing:
        return None
    return "; ".join(missing) + " -- see tests/browser/INSTALL.sh"


# --------------------------------------------------------------------------------------
# Notebook files
# --------------------------------------------------------------------------------------


def write_notebook(path: os.PathLike[str] | str, cells: Iterable[str | tuple[str, str]]) -> Path:
    """Write an nbformat-4 notebook with the ``python3`` kernelspec and return its path.

    ``cells`` items are code sources, or ``("markdown" | "code", source)`` pairs.
    The kernelspec metadata avoids JupyterLab's "Select Kernel" dialog.
    """
    nb_cells = []
    for i, item in enumerate(cells):
        kind, source = ("code", item) if isinstance(item, str) else item
        cell: dict[str, Any] = {"cell_type": kind, "id": f"cell-{i}", "metadata": {}, "source": source}
        if kind == "code":
            cell.update(execution_count=None, outputs=[])
        nb_cells.append(cell)
    notebook = {
        "cells": nb_cells,
        "metadata": {
            "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    out = Path(path)
    out.write_text(json.dumps(notebook, indent=1) + "\n")
    return out


# --------------------------------------------------------------------------------------
# Process bookkeeping (Linux /proc)
# --------------------------------------------------------------------------------------


def _proc_table() -> dict[int, tuple[int, int, int]]:
    """Map pid -> (ppid, session id, start time) for every visible process."""
    table: dict[int, tuple[int, int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # Fields after "(comm)": state ppid pgrp session ... starttime is field 22 overall.
        rest = stat[stat.rfind(")") + 2 :].split()
        try:
            table[int(entry)] = (int(rest[1]), int(rest[3]), int(rest[19]))
        except (IndexError, ValueError):
            continue
    return table


def _related_processes(root_pid: int, extra_sids: Iterable[int] = ()) -> dict[int, int]:
    """Processes below ``root_pid`` or in the session of any of them; pid -> start time.

    Kernels run in their own sessions (jupyter_client uses ``start_new_session``),
    so collecting sessions also catches their double-forked grandchildren.
    """
    table = _proc_table()
    own_sid = os.getsid(0)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    stack = [root_pid] if root_pid in table else []
    while stack:
        pid = stack.pop()
        if pid in found:
            continue
        found.add(pid)
        stack.extend(children.get(pid, ()))
    sids = {table[p][1] for p in found} | set(extra_sids)
    sids.discard(own_sid)
    sids.discard(0)
    for pid, (_, sid, _) in table.items():
        if sid in sids:
            found.add(pid)
    found.discard(os.getpid())
    return {pid: table[pid][2] for pid in found if pid in table}


def _kill_all(procs: Mapping[int, int], grace_s: float = 3.0) -> None:
    """SIGTERM then SIGKILL ``procs`` (pid -> start time), skipping recycled pids."""

    def alive() -> list[int]:
        table = _proc_table()
        return [p for p, start in procs.items() if p in table and table[p][2] == start]

    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = alive()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = alive()
        if not pids:
            return


# --------------------------------------------------------------------------------------
# JupyterLab server
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LabServer:
    """A running test JupyterLab server (yielded by :func:`jupyterlab_server`)."""

    base_url: str
    """E.g. ``http://127.0.0.1:43123/`` (always ends with ``/``)."""
    token: str
    """Auth token; pass as ``?token=`` or ``Authorization: token ...``."""
    root_dir: Path
    """Directory the server serves; notebook paths are relative to it."""
    pid: int
    """PID of the ``jupyter lab`` process (its own session leader)."""
    log_path: Path
    """Server stdout+stderr (kept until the context exits; included in errors)."""

    def __iter__(self) -> Iterator[str]:
        """Allow ``base_url, token = server``."""
        return iter((self.base_url, self.token))

    def lab_url(self, path: str = "") -> str:
        """URL of ``/lab/tree/<path>`` with the token (path relative to ``root_dir``)."""
        return f"{self.base_url}lab/tree/{path.lstrip('/')}?token={self.token}"

    def api(self, method: str, endpoint: str, body: Any = None, timeout: float = 10.0) -> Any:
        """Call the Jupyter REST API (e.g. ``api("GET", "api/kernels")``); returns parsed JSON or None."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base_url + endpoint.lstrip("/"),
            data=data,
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def log_tail(self, n_chars: int = 4000) -> str:
        """Last ``n_chars`` of the server log (for error messages)."""
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return "<no server log>"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _write_jupyter_dirs(base: Path, disabled_extensions: Sequence[str]) -> dict[str, str]:
    """Create isolated Jupyter dirs under ``base``; return the env vars pointing at them."""
    config = base / "config"
    (config / "labconfig").mkdir(parents=True)
    (config / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": dict.fromkeys(disabled_extensions, True)}, indent=1)
    )
    (config / "jupyter_server_config.json").write_text(
        json.dumps(
            {
                "LabApp": {
                    "news_url": None,
                    "check_for_updates_class": "jupyterlab.handlers.announcements.NeverCheckForUpdate",
                    # No PyPI queries from the server-side extension manager.
                    "extension_manager": "readonly",
                    # window.jupyterapp, for NotebookPage.execute_command().
                    "expose_app_in_browser": True,
                },
                "ServerApp": {"terminals_enabled": False},
            },
            indent=1,
        )
    )
    settings = base / "lab-settings"
    for rel, values in _USER_SETTINGS.items():
        target = settings / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(values, indent=1))
    for sub in ("runtime", "workspaces", "ipython"):
        (base / sub).mkdir()
    return {
        "JUPYTER_CONFIG_DIR": str(config),
        "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(settings),
        "JUPYTERLAB_WORKSPACES_DIR": str(base / "workspaces"),
        "IPYTHONDIR": str(base / "ipython"),
        "JUPYTER_PLATFORM_DIRS": "1",
        "PYTHONUNBUFFERED": "1",
    }


def _wait_until_up(proc: subprocess.Popen[bytes], server: LabServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise HarnessError(
                f"jupyter lab exited with code {proc.returncode} during startup:\n{server.log_tail()}"
            )
        try:
            status = server.api("GET", "api/status", timeout=2.0)
            if isinstance(status, dict):
                return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise HarnessError(f"jupyter lab did not answer within {timeout:.0f}s:\n{server.log_tail()}")
        time.sleep(0.2)


def _shutdown(proc: subprocess.Popen[bytes], server: LabServer) -> None:
    """Stop the server and every process it (or its kernels) started."""
    victims = _related_processes(proc.pid)  # server, kernels, and anything they started
    table = _proc_table()
    sessions = {table[p][1] for p in victims if p in table} | {proc.pid}
    if proc.poll() is None:
        with contextlib.suppress(Exception):
            server.api("POST", "api/shutdown", timeout=15.0)  # shuts kernels down cleanly
        try:
            proc.wait(timeout=15.0)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    # Anything still around from the server's tree or the server's/kernels' sessions.
    victims.update(_related_processes(-1, sessions))
    _kill_all(victims)


@contextlib.contextmanager
def jupyterlab_server(
    root_dir: os.PathLike[str] | str,
    *,
    extra_env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    disabled_extensions: Sequence[str] = DEFAULT_DISABLED_EXTENSIONS,
    startup_timeout: float = 60.0,
) -> Iterator[LabServer]:
    """Run ``jupyter lab`` serving ``root_dir``; yield a :class:`LabServer`.

    The server binds 127.0.0.1 on a free port, with ``--allow-root --no-browser``,
    a random token, and isolated temporary config/runtime/settings/workspace/IPython
    dirs.  ``extra_env`` is added to the server's (and so the kernels') environment,
    e.g. ``{"PYTHONPATH": repo_root}``; ``extra_args`` are appended to the command
    line (e.g. ``["--ServerApp.kernel_manager_class=..."]``).

    On exit the server and all its kernels (and their children) are stopped.
    """
    root = Path(root_dir).resolve()
    with tempfile.TemporaryDirectory(prefix="jlab-harness-") as tmp:
        base = Path(tmp)
        env = dict(os.environ)
        env.update(_write_jupyter_dirs(base, disabled_extensions))
        if extra_env:
            env.update(extra_env)
        log_path = base / "server.log"
        last_error: Exception | None = None
        for _attempt in range(3):  # retry only if the free port got taken meanwhile
            port = _free_port()
            token = secrets.token_hex(24)
            cmd = [
                sys.executable,
                "-m",
                "jupyterlab",
                "--allow-root",
                "--no-browser",
                "--ip=127.0.0.1",
                f"--port={port}",
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={token}",
                f"--ServerApp.root_dir={root}",
                *extra_args,
            ]
            log_offset = log_path.stat().st_size if log_path.exists() else 0
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(
                    cmd,
                    cwd=root,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            server = LabServer(f"http://127.0.0.1:{port}/", token, root, proc.pid, log_path)
            try:
                _wait_until_up(proc, server, startup_timeout)
            except HarnessError as exc:
                _shutdown(proc, server)
                last_error = exc
                if "already in use" in log_path.read_text(errors="replace")[log_offset:]:
                    continue
                raise
            break
        else:
            raise HarnessError(f"could not start jupyter lab: {last_error}")
        try:
            yield server
        finally:
            _shutdown(proc, server)


# --------------------------------------------------------------------------------------
# Browser
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def chromium(
    *, headless: bool = True, extra_args: Sequence[str] = (), slow_mo_ms: float = 0
) -> Iterator[Browser]:
    """Launch Debian's headless Chromium through Playwright (sync API); yield the Browser.

    Uses ``executable_path=/usr/bin/chromium`` and :data:`CHROMIUM_ARGS`; never
    needs ``playwright install``.  Browser and Playwright driver are closed on exit.
    """
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM_PATH,
            headless=headless,
            args=[*CHROMIUM_ARGS, *extra_args],
            slow_mo=slow_mo_ms,
        )
        try:
            yield browser
        finally:
            browser.close()


_NOTEBOOK_CSS = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook"

_JS_PROMPT_OF = """
(cell) => {
  const p = cell.querySelector('.jp-InputPrompt');
  return p ? p.textContent.trim() : '';
}
"""

# Arms a MutationObserver on one cell (arg.index) or the whole notebook (arg.index === null)
# *before* the run is triggered.  The run is done once a '[*]' prompt has been seen and no
# prompt shows '*' any more (JupyterLab clears the '*' of cells aborted after an error).
# Unlike comparing execution counts this also works after a kernel restart ([1] -> [1]).
_JS_ARM = """
(arg) => {
  const H = window.__jlabHarness || (window.__jlabHarness = {runs: {}, next: 0});
  const nb = document.querySelector(arg.css);
  const root = arg.index === null ? nb : nb.querySelectorAll('.jp-Cell')[arg.index];
  if (!root) throw new Error('no cell ' + arg.index);
  const state = {sawStar: false, done: false};
  const id = H.next++;
  H.runs[id] = state;
  const check = () => {
    const prompts = Array.from(root.querySelectorAll('.jp-InputPrompt'), p => p.textContent);
    if (prompts.some(p => p.includes('*'))) {
      state.sawStar = true;
    } else if (state.sawStar) {
      state.done = true;
      observer.disconnect();
    }
  };
  const observer = new MutationObserver(check);
  observer.observe(root, {subtree: true, childList: true, characterData: true});
  return id;
}
"""

_JS_RUN_DONE = "(id) => window.__jlabHarness.runs[id].done"


@dataclass
class Execution:
    """A run started by :meth:`NotebookPage.run_cell` / :meth:`NotebookPage.run_all`."""

    notebook: NotebookPage
    index: int | None
    """Cell index, or None for run-all."""
    run_id: int | None
    """Id of the in-page observer; None when nothing will execute (empty/markdown cell)."""

    def done(self) -> bool:
        """True once the execution finished (started, and no prompt shows ``[*]`` any more)."""
        if self.run_id is None:
            return True
        return bool(self.notebook.page.evaluate(_JS_RUN_DONE, self.run_id))

    def wait(self, timeout: float = 60.0) -> None:
        """Block until :meth:`done`; raise :class:`HarnessError` after ``timeout`` seconds."""
        if self.run_id is None:
            return
        what = "run-all" if self.index is None else f"cell {self.index}"
        self.notebook._wait_for(
            _JS_RUN_DONE, self.run_id, timeout, f"{what} did not finish within {timeout:.0f}s"
        )


class NotebookPage:
    """A notebook open in JupyterLab in a Playwright page; cell indices are 0-based.

    Created by :func:`open_notebook`.  ``page`` is the raw Playwright Page for
    anything not covered here; ``console`` collects browser console errors and
    uncaught page errors.
    """

    def __init__(self, page: Page, server: LabServer, path: str) -> None:
        self.page = page
        self.server = server
        self.path = path
        self.console: list[str] = []
        page.on("console", self._on_console)
        page.on("pageerror", self._on_page_error)

    def _on_console(self, msg: ConsoleMessage) -> None:
        if msg.type == "error":
            self.console.append(msg.text)

    def _on_page_error(self, exc: PlaywrightError) -> None:
        self.console.append(f"pageerror: {exc}")

    # ---- locators ---------------------------------------------------------------------

    @property
    def notebook(self) -> Locator:
        """The visible notebook's ``.jp-Notebook`` element."""
        return self.page.locator(_NOTEBOOK_CSS).first

    def cells(self) -> Locator:
        """All cells (code and markdown) of the notebook, in order."""
        return self.notebook.locator(".jp-Cell")

    def cell(self, index: int) -> Locator:
        """Cell ``index``."""
        return self.cells().nth(index)

    def output_area(self, index: int) -> Locator:
        """The output area (``.jp-OutputArea``) of code cell ``index``."""
        return self.cell(index).locator(".jp-OutputArea").first

    def widget(self, index: int, selector: str = ".jupyter-widgets") -> Locator:
        """Elements matching ``selector`` inside cell ``index``'s outputs.

        E.g. ``".widget-hprogress .progress-bar"`` (IntProgress bar; width is ``style.width``)
        or ``".widget-html-content"`` (HTML widget).
        """
        return self.output_area(index).locator(selector)

    # ---- reading ----------------------------------------------------------------------

    def cell_count(self) -> int:
        """Number of cells."""
        return self.cells().count()

    def prompt(self, index: int) -> str:
        """Input prompt text of cell ``index``: ``"[ ]:"``, ``"[*]:"`` or ``"[N]:"`` ("" for markdown)."""
        return str(self.cell(index).evaluate(_JS_PROMPT_OF))

    def output_text(self, index: int) -> str:
        """Visible text of cell ``index``'s outputs (stdout, results, tracebacks), stripped.

        Output prompts (``[3]:``) are excluded; several outputs are joined with newlines.
        """
        outputs = self.cell(index).locator(".jp-OutputArea-output")
        return "\n".join(t.strip() for t in outputs.all_inner_texts()).strip()

    def status_text(self) -> str:
        """Kernel status as shown in the status bar, e.g. ``"Idle"``, ``"Busy"``, ``"Starting"``."""
        text = self.page.locator("#jp-main-statusbar").inner_text()
        match = re.search(r"\|\s*(\w[\w ]*?)\s*(?:\n|$)", text)
        return match.group(1) if match else text

    # ---- waiting ----------------------------------------------------------------------

    def _wait_for(self, js: str, arg: Any, timeout: float, message: str) -> None:
        from playwright.sync_api import TimeoutError as PwTimeout

        try:
            self.page.wait_for_function(js, arg=arg, timeout=timeout * 1000, polling=100)
        except PwTimeout:
            raise HarnessError(self._describe(message)) from None

    def wait_until(self, js: str, arg: Any = None, timeout: float = 60.0, message: str = "") -> None:
        """Wait until the in-page function ``js`` (called with ``arg``) returns a truthy value, polling every
        0.1 s; raise :class:`HarnessError` with ``message`` (and what the page shows) after ``timeout`` seconds."""
        self._wait_for(js, arg, timeout, message or f"page condition not met within {timeout:.0f}s")

    def _describe(self, message: str) -> str:
        extra = [message]
        dialog = self.page.locator(".jp-Dialog")
        if dialog.count():
            extra.append(f"open dialog: {dialog.first.inner_text()!r}")
        with contextlib.suppress(Exception):
            extra.append(f"status bar: {self.page.locator('#jp-main-statusbar').inner_text()!r}")
        if self.console:
            extra.append("browser console errors:\n  " + "\n  ".join(self.console[-10:]))
        extra.append("server log tail:\n" + self.server.log_tail(2000))
        return "\n".join(extra)

    def wait_for_kernel_idle(self, timeout: float = 60.0, *, settle: float = 0.5) -> None:
        """Wait until the status bar has shown the kernel as "Idle" for ``settle`` seconds.

        The settle time skips the short busy blips right after a kernel starts
        (kernel_info / widget comm_info requests).  Fails fast if a dialog opens.
        """
        js = """
        (settleMs) => {
          if (document.querySelector('.jp-Dialog')) return 'dialog';
          const bar = document.querySelector('#jp-main-statusbar');
          const idle = !!bar && /\\|\\s*Idle\\b/.test(bar.innerText);
          const now = performance.now();
          if (!idle) { window.__jlabHarnessIdleSince = null; return false; }
          if (window.__jlabHarnessIdleSince == null) window.__jlabHarnessIdleSince = now;
          return now - window.__jlabHarnessIdleSince >= settleMs ? 'idle' : false;
        }
        """
        from playwright.sync_api import TimeoutError as PwTimeout

        self.page.evaluate("() => { window.__jlabHarnessIdleSince = null; }")
        try:
            handle = self.page.wait_for_function(js, arg=settle * 1000, timeout=timeout * 1000, polling=100)
        except PwTimeout:
            raise HarnessError(self._describe(f"kernel not Idle within {timeout:.0f}s")) from None
        if handle.json_value() == "dialog":
            raise HarnessError(self._describe("a dialog opened while waiting for the kernel"))

    # ---- running ----------------------------------------------------------------------

    def run_cell(self, index: int, *, wait: bool = True, timeout: float = 60.0) -> Execution:
        """Run cell ``index`` like a user: click its prompt, press Ctrl+Enter ("run, stay").

        With ``wait=False`` returns at once; sample the DOM, then call ``.wait()``
        on the result.  Markdown cells are rendered; empty code cells do nothing.
        """
        cell = self.cell(index)
        cell.scroll_into_view_if_needed()
        executes = "jp-CodeCell" in (cell.get_attribute("class") or "") and bool(
            cell.locator(".jp-InputArea-editor").inner_text().strip()
        )
        run_id = self.page.evaluate(_JS_ARM, {"css": _NOTEBOOK_CSS, "index": index}) if executes else None
        cell.locator(".jp-InputPrompt").first.click()
        self.page.keyboard.press("Control+Enter")
        execution = Execution(self, index, run_id)
        if wait:
            execution.wait(timeout)
        return execution

    def run_all(self, *, wait: bool = True, timeout: float = 120.0) -> Execution:
        """Run all cells (the Run > Run All Cells command); by default wait until none is queued or running.

        After a cell raises, JupyterLab skips the remaining cells; this still returns.
        """
        run_id = self.page.evaluate(_JS_ARM, {"css": _NOTEBOOK_CSS, "index": None})
        self.page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        execution = Execution(self, None, run_id)
        if wait:
            execution.wait(timeout)
        return execution

    def execute_command(self, command_id: str, args: Mapping[str, Any] | None = None) -> Any:
        """Execute a JupyterLab command (``window.jupyterapp.commands.execute``) and await it.

        E.g. ``execute_command("notebook:clear-all-cell-outputs")``.  Returns the
        command's result if it is a JSON primitive, else None.
        """
        return self.page.evaluate(
            """async ([id, args]) => {
                 const result = await window.jupyterapp.commands.execute(id, args);
                 return result === null || typeof result !== 'object' ? result ?? null : null;
               }""",
            [command_id, dict(args or {})],
        )

    def restart_kernel(self, timeout: float = 60.0) -> None:
        """Restart the kernel without a confirmation dialog and wait for "Idle"."""
        self.page.evaluate(
            "() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.restart()"
        )
        self.wait_for_kernel_idle(timeout)

    # ---- artefacts --------------------------------------------------------------------

    def screenshot(self, path: os.PathLike[str] | str, *, full_page: bool = False) -> Path:
        """Save a PNG screenshot of the page to ``path`` (parents created); return the path."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(out), full_page=full_page)
        return out


@contextlib.contextmanager
def open_notebook(
    browser: Browser,
    server: LabServer,
    path: str,
    *,
    viewport: tuple[int, int] = (1280, 900),
    kernel_timeout: float = 90.0,
    default_timeout: float = 30.0,
    collapse_sidebars: bool = True,
    failure_screenshot: os.PathLike[str] | str | None = None,
) -> Iterator[NotebookPage]:
    """Open notebook ``path`` (relative to the server's root) in a new page; yield a :class:`NotebookPage`.

    Waits until the notebook is rendered and its kernel shows "Idle".  With
    ``collapse_sidebars`` the file browser is folded away (roomier screenshots).
    If the ``with`` body (or opening) raises and ``failure_screenshot`` is given,
    a screenshot is saved there first.  The page's browser context is closed on
    exit (the kernel stays until the server exits).
    """
    context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
    context.set_default_timeout(default_timeout * 1000)
    page = context.new_page()
    notebook = NotebookPage(page, server, path)
    try:
        page.goto(server.lab_url(path), wait_until="domcontentloaded")
        try:
            notebook.notebook.locator(".jp-Cell").first.wait_for(
                state="attached", timeout=kernel_timeout * 1000
            )
        except Exception:
            raise HarnessError(notebook._describe(f"notebook {path!r} did not render")) from None
        if collapse_sidebars:
            page.evaluate(
                "() => { window.jupyterapp.shell.collapseLeft(); window.jupyterapp.shell.collapseRight(); }"
            )
        notebook.wait_for_kernel_idle(kernel_timeout)
        yield notebook
    except BaseException:
        if failure_screenshot is not None:
            with contextlib.suppress(Exception):
                notebook.screenshot(failure_screenshot)
        raise
    finally:
        context.close()
