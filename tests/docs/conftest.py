"""The docs tests need the documentation sources (docs/, doctools/, mkdocs.yml: a checkout, not an sdist) and the
[docs] extra (mkdocs, pymdown-extensions, nbclient), which scripts/docs.sh installs. Without them they are not
collected, with a warning that says why."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

collect_ignore_glob: list[str] = []
_missing = [m for m in ("mkdocs", "pymdownx", "nbclient", "yaml") if importlib.util.find_spec(m) is None]
_missing += [p for p in ("mkdocs.yml", "doctools", "docs") if not (ROOT / p).exists()]
if _missing:
    warnings.warn(f"tests/docs not collected: {', '.join(_missing)} missing; in a checkout, run  bash scripts/docs.sh  "
                  "(it installs the [docs] extra) or  pip install -e '.[docs]'", stacklevel=1)
    collect_ignore_glob.append("test_*.py")
