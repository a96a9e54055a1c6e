"""``python -m monarch_worker``: join a listening controller as one rank (see monarch_worker.join)."""

from __future__ import annotations

import sys

from .join import main

if __name__ == "__main__":
    sys.exit(main())
