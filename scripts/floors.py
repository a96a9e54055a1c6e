"""Print pip constraints pinning the requirements of pyproject.toml to their floors: the oldest versions CI tests.

    python scripts/floors.py [--extra NAME ...] [--build] > constraints.txt

Each requirement states its floor as ``name>=X``; this prints ``name==X`` for every runtime dependency, for the
requirements of each ``--extra``, and with ``--build`` for the build system's. scripts/test-floors.sh installs
with these constraints and runs the tests, so every floor in pyproject.toml is a tested claim. A runtime
dependency without a floor is an error (exit status 1); a requirement of an extra without one is left free
(nothing claimed). Requirements whose environment marker does not hold here are skipped.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def floor(req: Requirement) -> str | None:
    """The lowest version ``req`` admits as written (``>=``, ``~=`` or ``==``), or None when it states none."""
    lows = [s.version for s in req.specifier if s.operator in (">=", "~=", "==")]
    if len(lows) > 1:
        raise ValueError(f"{req}: more than one lower bound")
    return lows[0] if lows else None


def constraints(pyproject: Path = PYPROJECT, extras: tuple[str, ...] = (), build: bool = False) -> list[str]:
    """``name==floor`` lines for the runtime dependencies, the given extras and (``build``) the build system.

    Raises
    ------
    ValueError
        A runtime dependency has no floor, or an extra is not defined.
    """
    data = tomllib.loads(pyproject.read_text())
    project = data["project"]
    groups: list[tuple[str, list[str], bool]] = [("dependencies", project.get("dependencies", []), True)]
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise ValueError(f"no extra {extra!r} in {pyproject}")
        groups.append((f"extra {extra!r}", optional[extra], False))
    if build:
        groups.append(("build-system", data["build-system"]["requires"], True))
    pins: dict[str, str] = {}
    for where, texts, floor_required in groups:
        for text in texts:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            low = floor(req)
            if low is None:
                if floor_required:
                    raise ValueError(f"{where}: {text!r} states no floor (>=): CI could not test its oldest version")
                continue
            pins.setdefault(canonicalize_name(req.name), low)
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extra", action="append", default=[], help="also pin this extra's requirements")
    parser.add_argument("--build", action="store_true", help="also pin the build system's requirements")
    parser.add_argument("--pyproject", type=Path, default=PYPROJECT)
    args = parser.parse_args(argv)
    try:
        lines = constraints(args.pyproject, tuple(args.extra), args.build)
    except ValueError as e:
        print(f"floors.py: {e}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
