"""A test file's end-to-end scenarios run at once, each test asserting on its own.

For files whose real runs mostly wait (paced steps, a grace period, a detection window, an
alert's `for`): one after another they hold an xdist worker while its core idles; side by
side, one run trains while the others wait. A module fixture starts the scenarios of the
tests selected to run, each in a thread of its own and a fresh folder, at most ``at_once``
together; each test takes its own scenario's result (``Running.result``), which raises
whatever the scenario raised (its own assertion and message). The fixture's teardown waits
for every scenario, so nothing a scenario started outlives the module. Scenarios must not
touch process-wide state (the environment, the working directory, signal handlers): they
share the worker's process.

    @pytest.fixture(scope="module")
    def runs(request, tmp_path_factory):
        with side_by_side(request, tmp_path_factory, {"test_a": _a, "test_b": _b}) as running:
            yield running

    def test_a(runs, request):
        runs.result(request)
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest


class Running:
    """The scenarios started, by test name."""

    def __init__(self, futures: dict[str, Future]):
        self.futures = futures

    def result(self, request: pytest.FixtureRequest) -> Any:
        """The scenario of the test asking: its return value, or what it raised."""
        return self.futures[request.node.name].result()


@contextlib.contextmanager
def side_by_side(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                 scenarios: dict[str, Callable[[Path], Any]],
                 at_once: int | None = None) -> Iterator[Running]:
    """Run the ``scenarios`` (test name -> function of a fresh folder) whose tests are
    selected, in threads, at most ``at_once`` at a time (all by default), in the order
    given: the longest first."""
    selected = {item.name for item in request.session.items
                if getattr(item, "module", None) is request.module}
    chosen = {name: run for name, run in scenarios.items() if name in selected}
    pool = ThreadPoolExecutor(at_once or max(1, len(chosen)), thread_name_prefix="scenario")
    try:
        yield Running({name: pool.submit(run, tmp_path_factory.mktemp(_folder(name)))
                       for name, run in chosen.items()})
    finally:
        pool.shutdown(wait=True)


def scenario(body: Callable[..., Any],
             opens: dict[str, Callable[[Path], AbstractContextManager]] | None = None,
             **given: Any) -> Callable[[Path], Any]:
    """``body`` as a scenario, called in its fresh folder with what its parameters name:
    ``tmp_path`` (the folder), a name in ``opens`` (what a function fixture gave before: a
    context opened on the folder before the body, in the parameters' order, and closed
    after it), or a value in ``given`` (what a parameter gave)."""
    contexts = opens or {}

    def run(tmp_path: Path) -> Any:
        with contextlib.ExitStack() as stack:
            args = dict(given)
            for name in inspect.signature(body).parameters:
                if name == "tmp_path":
                    args[name] = tmp_path
                elif name in contexts:
                    args[name] = stack.enter_context(contexts[name](tmp_path))
            return body(**args)
    return run


def _folder(test: str) -> str:
    """A short folder name for a test's scenario (sockets inside must stay under 108 bytes)."""
    return re.sub(r"[^\w-]", "-", test.removeprefix("test_"))[:30]
