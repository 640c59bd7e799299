"""Errors that the CLI turns into meaningful exit codes.

Exit codes are part of the interface (README, every --help): 0 ok, 1 a problem was
found, 2 bad usage or input, 130 interrupted (Ctrl-C, as shells report 128 + SIGINT).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class TrainwatchError(Exception):
    """Base class; carries the exit code the CLI should use."""

    exit_code = EXIT_USAGE


class ConfigError(TrainwatchError):
    """Bad configuration or input: names the file, the key and the problem."""

    def __init__(self, problem: str, *, file: str | None = None, key: str | None = None,
                 line: int | None = None):
        self.file, self.key, self.line, self.problem = file, key, line, problem
        where = []
        if file:
            where.append(f"{file}:{line}" if line else str(file))
        if key:
            where.append(f"key '{key}'")
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {problem}" if prefix else problem)


class FormatError(TrainwatchError):
    """A file in the run directory is torn, alien, or of a version we do not know."""


def listen_error(exc: OSError, host: str, port: int, *, key: str,
                 file: str | None = None) -> ConfigError:
    """A server that cannot bind is bad input (exit 2), said plainly, not a traceback."""
    import errno

    if exc.errno == errno.EADDRINUSE:
        problem = (f"{host}:{port} is already in use (another trainwatch process?); stop it "
                   "or choose another port")
    else:
        problem = f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return ConfigError(problem, file=file, key=key)


def missing_extra(exc: ImportError, extra: str, *, key: str) -> ConfigError:
    """A feature whose library is an optional extra, asked for without it: exit 2 saying
    what to install (the base install stays small: no plotting, no Grafana client)."""
    return ConfigError(f"needs {getattr(exc, 'name', None) or exc}, which is not installed: "
                       f"pip install 'trainwatch[{extra}]'", key=key)


def output_error(exc: OSError, path: object, *, key: str) -> ConfigError:
    """An output path the user gave that cannot be written: exit 2 naming it."""
    return ConfigError(f"cannot write: {exc.strerror or exc}", file=str(exc.filename or path),
                       key=key)
