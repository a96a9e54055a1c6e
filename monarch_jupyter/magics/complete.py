"""Tab completion and Shift-Tab inspection inside ``%%mesh`` cells (and auto-mode cells) from a rank's namespace.

Completion is an IPython matcher (``shell.Completer.custom_matchers``, matcher API v2): in a cell that runs on the
mesh it asks the rank (``completion_rank``, or the first of the cell's ``--ranks``) through the rank's I/O thread
(``Mesh.complete``), so it answers while the rank is busy. The rank's names replace the kernel's; when the rank does
not answer within ``completion_timeout`` seconds (dead, stopped, no mesh) the kernel's own completions are shown.

Inspection: ipykernel answers ``inspect_request`` with ``shell.object_inspect_mime(name)`` and IPython has no hook
for it, so the shell's bound method is wrapped (on this shell object only, undone at unload): for an inspect
request whose code runs on the mesh, the rank describes the name; otherwise, or without an answer, IPython does.
"""

from __future__ import annotations

import html
import re
from typing import TYPE_CHECKING, Any

from ..kernel import registry
from ..ranks import parse_ranks

if TYPE_CHECKING:
    from .host import MagicsHost

__all__ = ["MeshCompletion"]

_RANKS = re.compile(r"(?:--ranks?|-r)[ =]+(\S+)")


class MeshCompletion:
    """The matcher and the inspection wrapper of one shell (see the module docstring)."""

    def __init__(self, magics: MagicsHost) -> None:
        self.magics = magics
        self.shell = magics.shell
        self._inspect_orig: Any = None
        matcher = self.matcher

        def mesh_matcher(context: Any) -> dict:
            return matcher(context)

        mesh_matcher.matcher_api_version = 2  # type: ignore[attr-defined]
        mesh_matcher.matcher_priority = 1.0  # type: ignore[attr-defined]
        self._matcher = mesh_matcher

    # ------------------------------------------------------------------ which cells, which rank

    def mesh_code(self, full_text: str) -> tuple[str, int, int] | None:
        """(the code the ranks run, the offset of its first character in ``full_text``, the rank to ask), or None
        when ``full_text`` is not a cell that runs on the mesh."""
        m = registry.peek_current()
        if m is None or not m.running:
            return None
        stripped = full_text.lstrip()
        lead = len(full_text) - len(stripped)
        spec = None
        if stripped.startswith("%%mesh"):
            first, _, _ = stripped.partition("\n")
            offset = lead + len(first) + 1
            found = _RANKS.search(first)
            spec = found.group(1) if found else None
        elif self.magics.auto.on and not stripped.startswith(("%", "!")):
            offset = 0
            found = _RANKS.search(self.magics.auto.line)
            spec = found.group(1) if found else None
        else:
            return None
        rank = int(self.magics.setting("completion_rank"))
        if spec is not None:
            try:
                chosen = parse_ranks(spec, m.nproc)
            except ValueError:
                chosen = []
            if chosen and rank not in chosen:
                rank = chosen[0]
        return full_text[offset:], offset, rank

    # ------------------------------------------------------------------ completion

    def matcher(self, context: Any) -> dict:
        """IPython matcher (API v2): the rank's completions of ``context.token``, suppressing the kernel's."""
        empty = {"completions": [], "suppress": False}
        full = context.full_text
        lines = full.split("\n")
        pos = sum(len(line) + 1 for line in lines[:context.cursor_line]) + context.cursor_position
        where = self.mesh_code(full)
        if where is None:
            return empty
        code, offset, rank = where
        if pos < offset:  # on the %%mesh line itself
            return empty
        reply = registry.peek_current().complete(
            code, pos - offset, rank, timeout=float(self.magics.setting("completion_timeout")))
        if reply is None or not reply.matches:
            return empty
        from IPython.core.completer import SimpleCompletion

        token = context.token
        # IPython replaces the token; the rank's matches replace code[cursor_start:cursor_end].
        typed = code[reply.cursor_start:pos - offset]
        matches = [token[:len(token) - len(typed)] + m for m in reply.matches if m.startswith(typed)]
        return {"completions": [SimpleCompletion(m, type=f"rank {rank}") for m in matches], "suppress": True}

    # ------------------------------------------------------------------ inspection

    def object_inspect_mime(self, oname: str, *args: Any, **kwargs: Any) -> dict:
        parent = self._parent()
        content = parent.get("content", {}) if parent.get("msg_type") == "inspect_request" else {}
        code, cursor = content.get("code"), content.get("cursor_pos")
        where = self.mesh_code(code) if isinstance(code, str) and isinstance(cursor, int) else None
        if where is not None:
            body, offset, rank = where
            if cursor >= offset:  # type: ignore[operator]
                reply = registry.peek_current().complete(
                    body, cursor - offset, rank, inspect=True,  # type: ignore[operator]
                    timeout=float(self.magics.setting("completion_timeout")))
                if reply is not None and reply.text:
                    text = f"rank {rank}:\n{reply.text}"
                    return {"text/plain": text, "text/html": f"<pre>{html.escape(text)}</pre>"}
        return self._inspect_orig(oname, *args, **kwargs)

    def _parent(self) -> dict:
        kernel = getattr(self.shell, "kernel", None)
        try:
            parent = kernel.get_parent("shell") if kernel is not None else {}
        except Exception:  # noqa: BLE001 - an older kernel: no inspection from ranks
            parent = {}
        return parent if isinstance(parent, dict) else {}

    # ------------------------------------------------------------------ install

    def install(self) -> None:
        shell: Any = self.shell
        completer = getattr(shell, "Completer", None)
        if completer is not None and self._matcher not in completer.custom_matchers:
            completer.custom_matchers.append(self._matcher)
        if self._inspect_orig is None and hasattr(shell, "object_inspect_mime"):
            self._inspect_orig = shell.object_inspect_mime
            shell.object_inspect_mime = self.object_inspect_mime

    def uninstall(self) -> None:
        shell: Any = self.shell
        completer = getattr(shell, "Completer", None)
        if completer is not None and self._matcher in completer.custom_matchers:
            completer.custom_matchers.remove(self._matcher)
        if self._inspect_orig is not None:
            if shell.__dict__.get("object_inspect_mime") == self.object_inspect_mime:
                del shell.object_inspect_mime
            self._inspect_orig = None
