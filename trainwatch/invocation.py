"""How to print a trainwatch command the user can paste: the program as they ran it.

The commands a run prints next must work as printed in the user's next shell, where a
virtual environment a script used may not be active: ``trainwatch`` only when that name
on PATH is this very program, else the path it was run by (``.venv/bin/trainwatch``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

NAME = "trainwatch"


def _shown(path: Path) -> str:
    """A path as short as it can be and still work from the current directory."""
    try:
        relative = path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return shlex.quote(str(path.resolve()))
    return shlex.quote(str(relative) if relative.parent != Path(".") else f"./{relative}")


def _same(a: str | None, b: Path) -> bool:
    try:
        return a is not None and os.path.samefile(a, b)
    except OSError:
        return False


def program(argv0: str | None = None) -> str:
    """``trainwatch``, ``.venv/bin/trainwatch`` or ``PYTHON -m trainwatch``: what runs
    this program again from the current directory."""
    script = Path(argv0 if argv0 is not None else sys.argv[0])
    if script.name == NAME:
        return NAME if _same(shutil.which(NAME), script) else _shown(script)
    python = Path(sys.executable)
    shown = python.name if _same(shutil.which(python.name), python) else _shown(python)
    return f"{shown} -m {NAME}"
