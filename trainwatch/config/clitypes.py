"""Command-line value types shared by the commands: a bad value is a usage error (exit 2
naming the option) before anything starts, never a traceback or a silent nonsense run."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import click

if TYPE_CHECKING:
    from trainwatch.rundir.run_dir import RunDir

F = TypeVar("F", bound=Callable[..., Any])

# Ranks on one machine: far beyond any node's accelerators or cores, far below what
# would make torchrun try to start a process per unit of an absurd number.
MAX_NPROC_PER_NODE = 1024
NPROC_PER_NODE = click.IntRange(1, MAX_NPROC_PER_NODE)
# torchrun's own restarts of every rank after one fails (`trainwatch train`, `trainwatch run`,
# the receiver's job): one, for a transient fault (a killed or OOM-killed rank); a fault that
# comes back is for the supervisor's restart-loop guard or a person, not hidden behind more
# restarts in place.
MAX_RESTARTS = 1


class FiniteRange(click.FloatRange):
    """A FloatRange that also refuses nan and inf (which compare false with any bound,
    so a plain FloatRange lets nan through)."""

    name = "finite float range"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


class FolderPath(click.Path):
    """A folder's path that is not empty: click reads "" as the current directory, so
    ``--run-dir ""`` (an unset shell variable) ran the job in whatever folder the command
    started in."""

    def __init__(self) -> None:
        super().__init__(file_okay=False)

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail("is empty; give a folder ('.' for the current one).", param, ctx)
        return super().convert(value, param, ctx)


# A run directory (and the agent's --discover folder), as every command takes one.
RUN_DIR_PATH = FolderPath()


def seconds(min: float = 0, max: float | None = None) -> FiniteRange:
    """A duration in seconds, finite, within [min, max]."""
    return FiniteRange(min, max)


def run_dir_option(help: str, *, argument: bool = False, required: bool = False,
                   own_argument: bool = False, show_default: str | None = None
                   ) -> Callable[[F], F]:
    """``--run-dir``, declared once for every command: the command gets ``run``, the
    RunDir built here (None when optional and not given).

    ``argument``: a ``[RUN_DIR]`` argument too (either form; two different ones exit 2).
    ``own_argument``: the command's own parsing puts RUN_DIR in ``run_dir_arg``
    (``trainwatch run``, whose arguments end with the user's command). ``required``: exit
    2 when none is given (pick_run_dir's message when RUN_DIR is taken, click's if not).
    """
    takes_argument = argument or own_argument

    def decorate(command: F) -> F:
        @functools.wraps(command)
        def wrapper(*args: Any, run_dir_opt: str | None = None, run_dir_arg: str | None = None,
                    **kwargs: Any) -> Any:
            from trainwatch.rundir.run_dir import RunDir, pick_run_dir

            run: RunDir | None = None
            if run_dir_arg is not None or run_dir_opt is not None or (required and
                                                                      takes_argument):
                run = RunDir(pick_run_dir(run_dir_arg, run_dir_opt))
            return command(*args, run=run, **kwargs)

        decorated = click.option("--run-dir", "run_dir_opt", type=RUN_DIR_PATH,
                                 metavar="RUN_DIR", required=required and not takes_argument,
                                 show_default=show_default, help=help)(wrapper)
        if argument:
            decorated = click.argument("run_dir_arg", required=False, metavar="[RUN_DIR]",
                                       type=RUN_DIR_PATH)(decorated)
        return decorated  # type: ignore[return-value]

    return decorate
