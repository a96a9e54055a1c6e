"""MkDocs hooks (mkdocs.yml ``hooks:``): generated pages and notebooks, and the markers the pages use.

* Before the build: the tutorial notebooks are written to ``docs/notebooks/`` in English and Chinese
  (:mod:`doctools.notebooks`).
* mkdocs-static-i18n rebuilds the file list after mkdocs-jupyter wrapped the notebooks, so the notebooks would be
  copied as plain files; ``on_files`` marks them as pages again.
* Markers in a page's Markdown, expanded in the language being built:

  ``<!-- mj:KIND -->`` ... ``<!-- /mj:KIND -->``  a generated part (the magics reference, the Chinese option
                              tables, the versions table), written into the page itself by
                              ``python -m doctools.generated`` (:mod:`doctools.generated`) and rewritten the same
                              way here, so the site shows what the code says even before the page is rewritten
  ``<!-- norun: REASON -->``  before a code block: a visible note that CI does not run that block, and why
* Chinese pages lose the line breaks between two Chinese characters, which Markdown would show as spaces
  (:mod:`doctools.cjk`).
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # hooks are loaded by path; make `doctools` importable beside them
    sys.path.insert(0, str(ROOT))

from doctools import cjk, generated, notebooks  # noqa: E402

log = logging.getLogger("mkdocs.hooks.doctools")

NORUN = re.compile(r"^(?P<indent>[ \t]*)<!-- norun: (?P<reason>.+?) -->[ \t]*$", re.MULTILINE)
NORUN_TITLE = {"en": "Not run in CI", "zh": "CI 中不运行"}


def language(config: Any) -> str:
    i18n = config.plugins.get("i18n")
    return getattr(i18n, "current_language", None) or "en"


def on_pre_build(config: Any) -> None:
    notebooks.write_all()


@event_priority(-200)  # after mkdocs-static-i18n (-100)
def on_files(files: Any, config: Any) -> Any:
    for f in files:
        if f.src_uri.endswith(".ipynb") and not f.is_documentation_page():
            f.is_documentation_page = lambda: True  # type: ignore[method-assign]
    return files


def expand(markdown: str, lang: str) -> str:
    """The page's Markdown with the markers replaced (also used by the tests); in Chinese, without the line breaks
    that would show as gaps between Chinese characters (:mod:`doctools.cjk`)."""
    if lang == "zh":
        markdown = cjk.join_lines(markdown)
    markdown = generated.strip_markers(generated.regenerate(markdown, lang))

    def note(m: re.Match[str]) -> str:
        indent = m.group("indent")
        return (f'{indent}!!! info "{NORUN_TITLE.get(lang, NORUN_TITLE["en"])}"\n'
                f"{indent}    {m.group('reason').strip()}\n")

    return NORUN.sub(note, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return expand(markdown, language(config))
