"""An agent config file validated in a short-lived child process, so the daemon never
loads pydantic.

Validating a file imports pydantic and builds the config models (~9 MiB, with the rest
of what validation leaves behind ~18 MiB): in the daemon that memory stayed for its
whole life, for a file read once at start and on SIGHUP. ``trainwatch agent --config``
validates it here instead: a child (``python -m trainwatch.agent.config_child FILE``)
reads and validates the file with ``agent/config.py``'s ``file_settings`` and hands
the settings back pickled (YAML values a collector option may hold, dates included,
come back as they were); a bad file comes back as the very ConfigError (problem, file,
key, line), so the command exits 2 naming them as it does in process.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import trainwatch
from trainwatch.errors import ConfigError

CHILD_TIMEOUT_SECONDS = 60.0  # a file is at most 16 MiB (MAX_CONFIG_BYTES); far above


def settings_in_child(path: str | Path) -> dict[str, Any]:
    """``file_settings(path)`` from a child process (``load_config``'s ``read``)."""
    package_root = str(Path(trainwatch.__file__).resolve().parent.parent)
    env = dict(os.environ)  # the child imports this very trainwatch
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH"))
                                        if p)
    try:
        child = subprocess.run([sys.executable, "-m", __name__, os.fspath(path)], env=env,
                               stdin=subprocess.DEVNULL, capture_output=True,
                               timeout=CHILD_TIMEOUT_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"could not validate it in a child process: {exc}",
                          file=str(path)) from None
    try:
        kind, *found = pickle.loads(child.stdout)
    except Exception:  # the child died before answering: say what it said last
        said = child.stderr.decode(errors="replace").strip().splitlines()
        raise ConfigError("could not validate it in a child process (exit "
                          f"{child.returncode}): {said[-1] if said else 'no output'}",
                          file=str(path)) from None
    if kind == "error":
        problem, file, key, line = found
        raise ConfigError(problem, file=file, key=key, line=line)
    return found[0]


def main(path: str) -> int:
    from trainwatch.agent.config import file_settings

    try:
        answer: tuple[Any, ...] = ("settings", file_settings(path))
    except ConfigError as exc:
        answer = ("error", exc.problem, exc.file, exc.key, exc.line)
    sys.stdout.buffer.write(pickle.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
