"""The docs tests need the [docs] extra (mkdocs, pymdown-extensions, nbclient), which scripts/docs.sh installs."""

from __future__ import annotations

import importlib.util

collect_ignore_glob: list[str] = []
_missing = [m for m in ("mkdocs", "pymdownx", "nbclient", "yaml") if importlib.util.find_spec(m) is None]
if _missing:
    import warnings

    warnings.warn(f"tests/docs skipped: {', '.join(_missing)} not installed; run  bash scripts/docs.sh  (it installs "
                  "the [docs] extra) or  pip install -e '.[docs]'", stacklevel=1)
    collect_ignore_glob.append("test_*.py")
