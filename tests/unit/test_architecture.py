"""The layer order of the ``flexorch`` package, read from the real import graph (every ``import`` statement of every
module, including those inside functions and under ``TYPE_CHECKING``), so that no arrow runs up a layer, no two
sub-packages import each other and no two files do, directly or around a loop (an import hidden inside a function
still makes a cycle). The same graph is what ``docs/make_structure.py`` draws."""

from __future__ import annotations

import ast
import pathlib
import re
import sys

import pytest

from tests.paths import PACKAGE

ROOT = PACKAGE

# Sub-package -> the other sub-packages it may import, top layer first. Ray and torch are listed as "<ray>",
# "<torch>" and "<torch.distributed>"; a sub-package missing here may import none of them.
ALLOWED: dict[str, set[str]] = {
    "__main__": {"cli"},
    "testing": {"workers", "dashboards", "solver", "config", "<torch>"},  # test-only tools; nothing imports it
    "cli": {"control", "dashboards", "records", "data", "config", "solver", "work", "<ray>"},
    "control": {"workers", "records", "data", "config", "work", "solver", "<ray>", "<torch>", "<torch.distributed>"},
    "dashboards": {"records", "solver"},
    "records": {"solver", "work", "config", "<ray>"},
    "workers": {"data", "work", "config", "solver", "<ray>", "<torch>", "<torch.distributed>"},  # data: reads blocks
    "data": {"work", "config", "solver", "<ray>"},
    "config": {"solver"},
    "work": {"solver"},
    "solver": set(),
}
EXTERNAL = ("ray", "torch")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sub_package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _target(name: str) -> str | None:
    if name.startswith("flexorch."):
        return name.split(".")[1]
    if name == "torch.distributed" or name.startswith("torch.distributed."):
        return "<torch.distributed>"
    if name.split(".")[0] in EXTERNAL:
        return f"<{name.split('.')[0]}>"
    return None


def _imports(path: pathlib.Path, *, top_level_only: bool = False) -> list[tuple[str, int]]:
    """(imported module, line) for every import in ``path``; relative imports resolved against its package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    module = _module_name(path) if path.is_relative_to(ROOT) else path.stem
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out.append((base, node.lineno))
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return out


def import_graph() -> dict[str, dict[str, list[str]]]:
    """Sub-package -> {imported sub-package or <external>: ["file:line", ...]}."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        src = _sub_package(_module_name(path))
        for name, line in _imports(path):
            dst = _target(name)
            if dst is not None and dst != src:
                graph.setdefault(src, {}).setdefault(dst, []).append(f"{path.relative_to(ROOT.parent)}:{line}")
    return graph


def test_every_sub_package_is_in_the_layer_table():
    subs = {_sub_package(_module_name(p)) for p in ROOT.rglob("*.py")} - {"__init__"}
    assert subs <= set(ALLOWED), f"add {sorted(subs - set(ALLOWED))} to ALLOWED with the edges it may have"


def test_no_import_runs_up_a_layer():
    bad = [
        f"{src} -> {dst} ({', '.join(where[:3])})"
        for src, targets in import_graph().items()
        for dst, where in targets.items()
        if src != "__init__" and dst not in ALLOWED.get(src, set())
    ]
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_cycle_between_sub_packages():
    graph = {src: {d for d in targets if not d.startswith("<")} for src, targets in import_graph().items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def module_graph(root: pathlib.Path = ROOT) -> dict[str, dict[str, int]]:
    """Module -> {module of the package it imports: first line}, for every file under ``root`` (``from a import b``
    counts ``a.b`` when that is a module, else ``a``)."""
    paths = {_module_name(p) if root == ROOT else p.stem: p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for module, path in paths.items():
        edges: dict[str, int] = {}
        for name, line in _imports(path):
            if name in paths and name != module:
                edges.setdefault(name, line)
        graph[module] = edges
    return graph


def file_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_cycle_between_files():
    graph = module_graph()
    cycles = file_cycles(graph)
    said = [
        " <-> ".join(c)
        + ": "
        + ", ".join(f"{a} imports {b} at line {graph[a][b]}" for a in c for b in c if b in graph[a])
        for c in cycles
    ]
    assert not cycles, (
        "file-level import cycles (move the shared names where both sides can import them):\n" + "\n".join(said)
    )


def test_the_file_cycle_check_finds_a_cycle_hidden_in_a_function(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    import c\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a import x\n")
    (tmp_path / "d.py").write_text("import a\n")
    assert file_cycles(module_graph(tmp_path)) == [["a", "b", "c"]]


def test_config_imports_neither_ray_nor_torch_at_module_level():
    paths = [ROOT / "config.py"] if (ROOT / "config.py").exists() else sorted((ROOT / "config").rglob("*.py"))
    bad = [f"{p.name}:{line} {name}" for p in paths for name, line in _imports(p, top_level_only=True)]
    bad = [b for b in bad if b.split()[-1].split(".")[0] in EXTERNAL]
    assert not bad, bad


def test_the_graph_sees_imports_inside_functions(tmp_path):
    # the test above is only as good as the walker: an import inside a function must count
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    import flexorch.control.driver\n    from torch import distributed\n")
    names = [n for n, _ in _imports(mod)]
    assert "flexorch.control.driver" in names and "torch.distributed" in names


WHEN = re.compile(r"20[0-9]{2}-[0-9]{2}-[0-9]{2}|as before|before issue|\bissues? ?#?\d+\b", re.IGNORECASE)
"""History in the code: a date, "as before", an issue's number."""


def _lines_matching(pattern: re.Pattern, root: pathlib.Path = ROOT) -> list[str]:
    return [
        f"{p.relative_to(root.parent)}:{i}: {line.strip()[:80]}"
        for p in sorted(root.rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]


def test_the_code_says_what_and_why_never_when():
    # history (dates, "as before", the issue a change came from) goes into CHANGELOG.md
    bad = _lines_matching(WHEN)
    assert not bad, "dated or historical notes (move them to CHANGELOG.md):\n" + "\n".join(bad)


def test_the_history_check_sees_an_issue_number(tmp_path):
    pkg = tmp_path / "flexorch"
    pkg.mkdir()
    (pkg / "a.py").write_text("x = 1  # see Issue #22\ny = 2  # issues 48\nz = 3  # the issue is 4 workers\n")
    assert [line.split(":")[1] for line in _lines_matching(WHEN, pkg)] == ["1", "2"]


def _classes(root: pathlib.Path = ROOT) -> list[tuple[str, str, list[str]]]:
    """(where, class name, the names of its bases) for every class under ``root``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).split("[")[0].rsplit(".", 1)[-1] for b in node.bases]
                out.append((f"{path.relative_to(root.parent)}:{node.lineno}", node.name, bases))
    return out


NOT_MIXINS = {"Protocol", "ABC", "Enum", "IntEnum", "StrEnum", "Exception", "Generic"}
"""Bases a class may add beside one flexorch base: interfaces and kinds, not shared state."""
ERRORS = ("Error", "Exception", "Failure", "Warning")


def _mixed(root: pathlib.Path = ROOT) -> list[str]:
    """The classes under ``root`` with two or more bases defined under ``root`` (exceptions and NOT_MIXINS aside)."""
    classes = _classes(root)
    bases_of: dict[str, set[str]] = {}
    for _, name, bases in classes:
        bases_of.setdefault(name, set()).update(bases)

    def is_error(name: str, seen: frozenset = frozenset()) -> bool:
        if name.endswith(ERRORS):
            return True
        return name not in seen and any(is_error(b, seen | {name}) for b in bases_of.get(name, ()))

    bad = []
    for where, name, bases in classes:
        own = [b for b in bases if b in bases_of and b not in NOT_MIXINS and not is_error(b)]
        if len(own) >= 2:
            bad.append(f"{where} {name}({', '.join(bases)})")
    return bad


def test_no_class_is_built_from_mixins():
    # one class, one concept: state is shared by passing components, never by several flexorch base classes that
    # read and set each other's attributes (exceptions, protocols, abstract bases and enums aside)
    bad = _mixed()
    assert not bad, "classes built from two or more flexorch base classes (make them components):\n" + "\n".join(bad)


def test_the_mixin_check_sees_a_class_of_two_own_bases(tmp_path):
    pkg = tmp_path / "flexorch"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "class Setup:\n    pass\n\n\nclass Loop:\n    pass\n\n\nclass BadError(ValueError):\n    pass\n"
    )
    (pkg / "b.py").write_text(
        "import enum\nfrom a import BadError, Loop, Setup\n\n\nclass Driver(Setup, Loop):\n    pass\n\n\n"
        "class Kind(Setup, enum.Enum):\n    pass\n\n\nclass Lost(BadError, Setup):\n    pass\n"
    )
    assert [line.split(" ")[1] for line in _mixed(pkg)] == ["Driver(Setup,"]


def _probes(root: pathlib.Path = ROOT) -> list[str]:
    """Lines under ``root / "control"`` that call getattr/hasattr without a ``# optional:`` comment saying why."""
    probe = re.compile(r"\b(getattr|hasattr)\(")
    return [
        f"{p.relative_to(root.parent)}:{i}: {line.strip()[:80]}"
        for p in sorted((root / "control").rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if probe.search(line) and "# optional:" not in line
    ]


def test_control_never_probes_attributes():
    # the control plane calls the interfaces it is given (control.group.WorkerGroup and the rest); an attribute that
    # is truly optional (a third-party object's) is read on a line that says why: `# optional: ...`
    bad = _probes()
    assert not bad, "getattr/hasattr in flexorch/control (declare it on the interface):\n" + "\n".join(bad)


def test_the_probe_check_sees_a_getattr_without_a_reason(tmp_path):
    (tmp_path / "flexorch" / "control").mkdir(parents=True)
    (tmp_path / "flexorch" / "control" / "a.py").write_text(
        'x = getattr(g, "sharded", False)\ny = getattr(e, "error_msg", None)  # optional: a Ray error may lack it\n'
    )
    assert [line.split(":")[1] for line in _probes(tmp_path / "flexorch")] == ["1"]


MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def _over_limits() -> set[str]:
    over = set()
    for path in sorted(ROOT.rglob("*.py")):
        rel = str(path.relative_to(ROOT.parent))
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            over.add(rel)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    over.add(f"{rel}:{node.name}")
    return over


def test_modules_and_functions_stay_short():
    # a newcomer reads a module in one sitting and a function on one screen
    over = sorted(_over_limits())
    assert not over, f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function: {over}"


def test_the_size_check_sees_a_long_function(tmp_path, monkeypatch):
    pkg = tmp_path / "flexorch"
    pkg.mkdir()
    (pkg / "long.py").write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    assert _over_limits() == {"flexorch/long.py:f"}
