"""The import graph of the real modules obeys the rules in docs/architecture.md.

Every ``.py`` file under the component folders and ``trainwatch/`` is parsed (``ast``), and
every import of a ``trainwatch.*`` module, at module level or inside a function, is an edge
between the importing and the imported component. The allowed directions come from the
table in docs/architecture.md, so the document and the check cannot drift apart.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "trainwatch"
# Rooms of the shared core: subpackages with rules of their own (docs/architecture.md).
SHARED = ("contract", "host", "config", "rundir", "process", "serving")
# Every component: a subpackage of trainwatch/ that is not part of the shared core.
COMPONENTS = tuple(sorted(p.name for p in PACKAGE.iterdir()
                          if (p / "__init__.py").is_file() and p.name not in SHARED))
ARCHITECTURE = REPO / "docs" / "architecture.md"


def component_of(module: str) -> str | None:
    """The component a ``trainwatch.*`` module belongs to; None for other modules."""
    parts = module.split(".")
    if parts[0] != "trainwatch":
        return None
    if len(parts) > 1 and parts[1] in COMPONENTS + SHARED:
        return parts[1]
    return "core"


def source_files() -> dict[str, Path]:
    """module name -> file, for every module of the package (import path = file path)."""
    return {".".join(path.relative_to(REPO).with_suffix("").parts): path
            for path in PACKAGE.rglob("*.py")}


def test_the_package_is_real_folders():
    """No symlink anywhere in the package: import-graph tools, editors and packagers read
    the files where the import path says they are."""
    links = [str(p.relative_to(REPO)) for p in PACKAGE.rglob("*") if p.is_symlink()]
    assert links == []
    assert {"trainer", "agent", "alerts", "dashboards", "runbooks"} <= set(COMPONENTS)


def imports_of(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports (absolute and relative, anywhere in the file)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # ``from trainwatch import agent`` imports a component, not just the package.
            found |= {f"{target}.{alias.name}" for alias in node.names
                      if component_of(f"{target}.{alias.name}") in COMPONENTS + SHARED}
    return found


def component_graph() -> dict[tuple[str, str], set[str]]:
    """(from component, to component) -> the files where such an import happens."""
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for module, path in source_files().items():
        source = component_of(module)
        for target_module in imports_of(path, module):
            target = component_of(target_module)
            if source and target and target != source:
                edges[(source, target)].add(str(path.relative_to(REPO)))
    return edges


def allowed_imports(text: str) -> dict[str, set[str]]:
    """The table between the import-rules markers of docs/architecture.md."""
    block = text.split("<!-- import-rules: begin -->")[1].split("<!-- import-rules: end -->")[0]
    rules = {}
    for line in block.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rules[cells[0]] = {c.strip() for c in cells[1].split(",") if c.strip()}
    return rules


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one node (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(set(graph) | {n for targets in graph.values() for n in targets}):
        if node not in index:
            visit(node)
    return sorted(found)


@pytest.fixture(scope="module")
def edges():
    return component_graph()


@pytest.fixture(scope="module")
def rules():
    return allowed_imports(ARCHITECTURE.read_text())


def test_the_rules_name_every_component_and_have_no_cycle(rules):
    assert set(rules) == set(COMPONENTS) | set(SHARED) | {"core"}
    assert all(targets <= set(rules) for targets in rules.values())
    assert cycles(rules) == []


def test_components_import_only_what_the_architecture_allows(edges, rules):
    forbidden = {f"{a} -> {b}": sorted(files) for (a, b), files in edges.items()
                 if b not in rules[a]}
    assert forbidden == {}, "imports docs/architecture.md does not allow"


def test_no_cycle_between_components(edges):
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"agent": {"alerts"}, "alerts": {"agent", "trainer"}, "trainer": set()}) == [
        ["agent", "alerts"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_graph_sees_imports_inside_functions(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from trainwatch.agent.config import load_config\n"
                    "from trainwatch import alerts\nfrom . import sibling\n")
    found = imports_of(path, "trainwatch.report.m")
    assert {"trainwatch.agent.config", "trainwatch.alerts", "trainwatch.report.sibling"} <= found


def test_modules_are_imported_by_their_one_path():
    """``trainwatch.agent.x``, never a bare ``agent.x`` (import path = file path)."""
    bare = {}
    for module, path in source_files().items():
        for target in imports_of(path, module):
            if target.split(".")[0] in COMPONENTS + SHARED:
                bare.setdefault(str(path.relative_to(REPO)), []).append(target)
    assert bare == {}


def test_the_contract_is_torch_free():
    """The contract and the checkpoint reader (its DCP recognition included) never import
    torch: the agent, diagnose, the controller and the summary read with them."""
    code = ("import sys, pkgutil, importlib, trainwatch.contract as c\n"
            "import trainwatch.checkpoint_format as f\n"
            "for p in (c, f):\n"
            "    for m in pkgutil.iter_modules(p.__path__): importlib.import_module(f'{p.__name__}.{m.name}')\n"
            "import trainwatch.agent.daemon, trainwatch.diagnose.cli, trainwatch.report.cli\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True)
    assert out.stdout.strip() == "False"


def _code_constants(path: Path) -> list[tuple[int, object]]:
    """String and number constants of a module's code (docstrings left out)."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and id(node) not in docstrings]


def test_each_shared_name_has_one_definition_site():
    """Control and state file names, log names, environment variable names and default
    ports appear in code only where the contract defines them (others import them)."""
    from trainwatch.contract import env, layout, ports

    names = {v for k, v in vars(layout).items() if k.isupper() and isinstance(v, str)
             and (v.endswith((".json", ".jsonl", ".log")) or k.startswith("CONTROL_HOLD")
                  or k.endswith("_GLOB"))}
    names |= {v for k, v in vars(env).items() if k.endswith("_ENV")}
    numbers = {ports.AGENT_PORT, ports.RECEIVER_PORT}
    assert {"skip-steps.json", "silences.json", "actions.json", "TRAINWATCH_RUN_DIR"} <= names

    def spells(value: str, name: str) -> bool:
        """The name as a value, a path's end or a $VARIABLE (prose may mention it)."""
        return value == name or f"/{name}" in value or f"${name}" in value

    found = []
    for module, path in source_files().items():
        if module.startswith("trainwatch.contract."):
            continue
        for line, value in _code_constants(path):
            if (isinstance(value, str) and any(spells(value, n) for n in names)) or (
                    isinstance(value, int) and value in numbers):
                found.append(f"{path.relative_to(REPO)}:{line}: {value!r}")
    assert found == []


def test_the_loopback_address_is_spelled_only_in_the_contract():
    """"127.0.0.1" (also inside an f-string or a --help text) is contract.ports.LOOPBACK."""
    found = [f"{path.relative_to(REPO)}:{line}: {value!r}"
             for module, path in source_files().items()
             if not module.startswith("trainwatch.contract.")
             for line, value in _code_constants(path)
             if isinstance(value, str) and "127.0.0.1" in value]
    assert found == []


def test_exit_codes_are_named_by_trainwatch_errors():
    """sys.exit / ctx.exit / SystemExit with a literal number: the codes are an interface
    (0/1/2, 130 when interrupted), so each is one constant of trainwatch/errors.py."""
    exits = ("sys.exit", "ctx.exit", "SystemExit", "os._exit")
    found = []
    for module, path in source_files().items():
        if module == "trainwatch.errors":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and ast.unparse(node.func) in exits and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, int)):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_tests_mirror_the_components():
    """A component's tests sit in ``tests/<component>/``; whole-product checks in
    ``tests/project/``, a core room's in ``tests/<room>/``, the root core's in ``tests/core/``, deployment in
    ``tests/deploy/``; the jobs tests start in ``tests/jobs/``. The root holds only shared
    helpers, so a newcomer finds a component's tests by its name."""
    tests = REPO / "tests"
    allowed = set(COMPONENTS) | set(SHARED) | {"core", "project", "deploy", "jobs", "fixtures",
                                               "promtool"}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders <= allowed, folders - allowed
    assert sorted(p.name for p in tests.glob("test_*.py")) == []
    assert sorted(p.name for p in (tests / "jobs").glob("test_*.py")) == []


def test_no_test_file_imports_another():
    """Shared test code lives in the helper modules, so each folder runs on its own."""
    found = []
    for path in (REPO / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("test_"):
                found.append(f"{path.relative_to(REPO)}: {node.module}")
            elif isinstance(node, ast.Import):
                found += [f"{path.relative_to(REPO)}: {a.name}" for a in node.names
                          if a.name.startswith("test_")]
    assert found == []
def _rank_name_builds(path: Path) -> list[tuple[int, str]]:
    """Per-rank names put together by hand: an f-string with ``rank-`` (or the journal's
    ``rank``) right before a formatted rank, or using the layout's prefixes; a ``rank-{``
    or ``rank-%`` template."""
    from trainwatch.contract.layout import RANK_PREFIX, RANK_SOURCE_PREFIX

    prefixes = {"RANK_PREFIX", "RANK_SOURCE_PREFIX", "PY_SPY_PREFIX", "DUMP_PREFIX"}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.JoinedStr):
            parts = node.values
            for before, after in zip(parts, parts[1:]):
                if not (isinstance(before, ast.Constant) and isinstance(before.value, str)
                        and isinstance(after, ast.FormattedValue)):
                    continue
                text, expr = before.value, ast.unparse(after.value)
                if text.endswith(RANK_PREFIX) or (
                        re.search(rf"(^|[\s/]){RANK_SOURCE_PREFIX}$", text)
                        and re.search(r"rank\W*$", expr)):
                    found.append((node.lineno, ast.unparse(node)))
            if any(isinstance(p, ast.FormattedValue) and ast.unparse(p.value) in prefixes
                   for p in parts):
                found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and re.search(rf"{RANK_PREFIX}[{{%]", node.value)):
            found.append((node.lineno, repr(node.value)))
    return found


def test_rank_file_names_come_from_the_layout():
    """rank-00003.json, rank-00003.beat, py-spy-rank-00003.txt, rank3 (a journal source):
    built only by trainwatch/contract/layout.py (rank_file_name, py_spy_file_name,
    rank_source), so a reader and a writer cannot disagree on a name."""
    found = [f"{path.relative_to(REPO)}:{line}: {text}"
             for module, path in source_files().items()
             if module != "trainwatch.contract.layout"
             for line, text in _rank_name_builds(path)]
    assert found == []


def test_the_rank_name_guard_sees_hand_built_names(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('a = f"rank-{rank:05d}.beat"\nb = f"py-spy-rank-{r:05d}.txt"\n'
                       'c = f"rank{self.rank}"\nd = f"{RANK_PREFIX}{rank:05d}.json"\n'
                       'e = "rank-{:05d}.json".format(rank)\n'
                       'ok = f"rank {rank} is dead"\nok2 = f"on rank{\'s\' if many else \'\'}"\n')
    assert [line for line, _ in _rank_name_builds(planted)] == [1, 2, 3, 4, 5]


# Modules that query the series (PromQL), not produce them: dashboards are generated from
# code; diagnose asks a Prometheus.
QUERY_MODULES = ("trainwatch.dashboards.", "trainwatch.diagnose.prometheus")
METRIC_NAME = re.compile(r"trainwatch_[a-z0-9_]+")


def _metric_spellers(files: dict[str, Path]) -> dict[str, set[str]]:
    """Declared metric name -> the modules whose strings (f-string parts and queries too)
    spell it, outside the contract and the query modules."""
    from trainwatch.contract.metrics import METRICS

    spellers: dict[str, set[str]] = defaultdict(set)
    for module, path in files.items():
        if module.startswith(("trainwatch.contract.", *QUERY_MODULES)):
            continue
        for _, value in _code_constants(path):
            if isinstance(value, str):
                for name in set(METRIC_NAME.findall(value)) & set(METRICS):
                    spellers[name].add(module)
    return spellers


def test_each_metric_name_is_spelled_by_one_producer():
    """A metric's name is defined in trainwatch/contract/metrics.py and spelled by at most
    one module besides (its one producer, which tests/agent/test_agent_contract.py ties to the
    contract for the agent); a second producer or a reader takes it from the contract (a
    constant or a field -> metric table), so two exporters cannot drift apart."""
    twice = {name: sorted(modules) for name, modules in _metric_spellers(source_files()).items()
             if len(modules) > 1}
    assert twice == {}


def test_the_metric_name_guard_sees_a_second_producer(tmp_path):
    (tmp_path / "one.py").write_text('add("trainwatch_rank_step", 1)\n')
    (tmp_path / "two.py").write_text('q = f"max(trainwatch_rank_step{{run=\\"{run}\\"}})"\n')
    spellers = _metric_spellers({"trainwatch.x.one": tmp_path / "one.py",
                                 "trainwatch.y.two": tmp_path / "two.py"})
    assert spellers == {"trainwatch_rank_step": {"trainwatch.x.one", "trainwatch.y.two"}}


def test_the_package_root_keeps_at_most_eight_modules():
    """A module shared by components goes into a room of the shared core (rundir/,
    config/, process/, serving/, host/, contract/), not the root (docs/architecture.md,
    "Where a shared module goes"): a root of dozens of modules is one unlayered node."""
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 8, root


MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 120


def _oversized(paths: list[Path]) -> dict[str, int]:
    """``file`` -> lines of each module over MAX_MODULE_LINES, ``file:Class.function`` -> lines
    (``def`` to its last line) of each function over MAX_FUNCTION_LINES."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, where: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and length > MAX_FUNCTION_LINES:
                    found[f"{where}:{name}"] = length
                visit(child, where, name + ".")
            else:
                visit(child, where, prefix)

    for path in paths:
        where = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found[where] = len(text.splitlines())
        visit(ast.parse(text, str(path)), where, "")
    return found


def test_no_module_over_700_lines_and_no_function_over_120():
    """Growth adds files, not lines: a module past 700 lines holds more than one concern, a
    function past 120 more than one step (house style)."""
    assert _oversized(sorted(PACKAGE.rglob("*.py"))) == {}


def test_the_size_guard_sees_long_modules_and_methods(tmp_path):
    def lines(n: int, indent: str) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(n))

    # a method of 121 lines in a module of 702 + 120; a function of exactly 120 lines
    (tmp_path / "long.py").write_text("class A:\n    def f(self):\n"
                                      + lines(MAX_FUNCTION_LINES, " " * 8)
                                      + lines(MAX_MODULE_LINES, ""))
    (tmp_path / "short.py").write_text("def g():\n" + lines(MAX_FUNCTION_LINES - 1, " " * 4))
    found = _oversized([tmp_path / "long.py", tmp_path / "short.py"])
    assert found == {"long.py": 2 + MAX_FUNCTION_LINES + MAX_MODULE_LINES,
                     "long.py:A.f": MAX_FUNCTION_LINES + 1}
