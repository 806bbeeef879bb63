"""mkdocs hook: the reference pages, generated from the code every time the site is built, so they never go stale.

A page asks for a generated block with an HTML comment on a line of its own, ``<!-- generated: NAME -->``; the
hook replaces it (an unknown NAME fails the build). Text between ``<!-- github -->`` and ``<!-- /github -->`` lines
is for readers of the Markdown source on GitHub (where nothing is generated) and is left out of the site. The
blocks:

- ``config``: every table of a run file (``flexorch/config/load.py`` says which dataclass is which table) and the
  top-level run keys: each field's name, type, default and docstring (flexorch documents a dataclass field with a
  string literal right after it, read here with ``ast`` from the source);
- ``cli``: ``flexorch --help`` and every subcommand's help, from the real argparse parser
  (``flexorch.cli.main.build_parser``);
- ``structure``, ``imports``: line and module counts per sub-package and the imports between them, computed by
  ``docs/make_structure.py`` (imported, not copied); ``structure.svg`` is drawn again by it at build time;
- ``tests``: the test modules under ``tests/``, their test functions, marks and docstrings.

Stdlib and flexorch's own imports only (importing ``flexorch.config`` and ``flexorch.cli.main`` starts neither Ray
nor torch).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import inspect
import keyword
import os
import re
import textwrap
from pathlib import Path

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
MARKER = re.compile(r"^<!-- generated: ([a-z_]+) -->$", re.M)
GITHUB_ONLY = re.compile(r"^<!-- github -->$.*?^<!-- /github -->$\n?", re.M | re.S)


def _make_structure():
    spec = importlib.util.spec_from_file_location("flexorch_docs_make_structure", DOCS / "make_structure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------------- config


def _field_sources(cls) -> dict[str, tuple[str, str]]:
    """``{field: (annotation, docstring)}`` of a dataclass, read from its source with ``ast``."""
    tree = ast.parse(Path(inspect.getsourcefile(cls)).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    out: dict[str, tuple[str, str]] = {}
    body = node.body
    for i, stmt in enumerate(body):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            doc = ""
            nxt = body[i + 1] if i + 1 < len(body) else None
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                doc = inspect.cleandoc(nxt.value.value)
            out[stmt.target.id] = (ast.unparse(stmt.annotation), doc)
    return out


def _toml(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, tuple | list):
        return "`[" + ", ".join(_toml(v).strip("`") for v in value) + "]`"
    return f"`{value!r}`"


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return _toml(f.default)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "the table's defaults" if dataclasses.is_dataclass(value) else _toml(value)
    return "required"


_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`", re.S)


def _role(m: re.Match) -> str:
    name = re.sub(r"\s+", "", m.group(2))
    return f"`{name.split('.')[-1] if m.group(1) else name}`"


def _markdown(doc: str) -> str:
    """A docstring as Markdown: Sphinx roles and ``double`` backticks to code spans, ``<`` outside code escaped."""
    doc = _ROLE.sub(_role, doc)
    doc = doc.replace("``", "`")
    parts = doc.split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = parts[i].replace("<", "&lt;")
    return "`".join(parts)


def _fields_block(cls, skip=(), missing_doc: str = "") -> list[str]:
    sources = _field_sources(cls)
    lines: list[str] = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        annotation, doc = sources.get(f.name, (str(f.type), ""))
        key = f.name[:-1] if keyword.iskeyword(f.name[:-1]) else f.name  # the field async_ is the key async
        lines += [f"**`{key}`** · `{annotation}` · default: {_default(f)}", ""]
        text = _markdown(doc) if doc else missing_doc
        if text:
            lines += [text, ""]
    return lines


def _class_doc(cls) -> str:
    return _markdown(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0])


def config_reference() -> str:
    from flexorch.config import load, model, run, tasks
    from flexorch.config.data import DataSource

    tables = {"model": model.ModelConfig, **load.TABLES}
    lines = [
        "A run file (`flexorch train --config FILE`) has top-level run keys and the tables below; every key is "
        "optional unless marked required. Generated from the dataclasses in `flexorch/config/` (the table of each is "
        "`flexorch/config/load.py`'s), so it is the code's own list. An unknown key is an error listing the known "
        "ones.",
        "",
        "## Run keys",
        "",
        f"`{run.TrainConfig.__module__}.TrainConfig`: {_class_doc(run.TrainConfig)}",
        "",
        *_fields_block(run.TrainConfig, skip={"model", "tasks", *load.TABLES}),
    ]
    for name, cls in tables.items():
        lines += [f"## `[{name}]`", "", f"`{cls.__module__}.{cls.__name__}`: {_class_doc(cls)}", ""]
        if name == "model":
            presets = ", ".join(f'`"{p}"`' for p in model.MODEL_PRESETS)
            default = re.search(r'table\.pop\("preset", "([^"]+)"\)', inspect.getsource(load._model)).group(1)
            lines += [
                f'**`preset`** · `str` · default: `"{default}"`',
                "",
                f'The shape to start from ({presets}); any field below overrides it. With `hf = "DIR"` the shape '
                "comes from the directory's `config.json`, and only these keys may stand beside it: "
                + ", ".join(f"`{k}`" for k in sorted(model.RUN_KEYS | load.MODEL_TRAINING_KEYS))
                + ".",
                "",
            ]
        lines += _fields_block(cls)
        if name == "data":
            lines += [
                "## `[[data.sources]]`",
                "",
                f"`{DataSource.__module__}.DataSource`: {_class_doc(DataSource)}",
                "",
                *_fields_block(DataSource, missing_doc="Unset: the `[data]` table's."),
            ]
    shared = ", ".join(f"`{k}`" for k in sorted(tasks.SHARED_DATA_KEYS))
    lines += [
        "## `[[tasks]]`",
        "",
        f"`{tasks.__name__}.TaskSettings`: {_class_doc(tasks.TaskSettings)} A task's own keys are below; every other "
        f"key of a `[[tasks]]` table is a [`[data]`](#data) key for the task's data (the run's `[data]` gives the "
        f"defaults), except {shared}, which every task shares with the run.",
        "",
        *_fields_block(tasks.TaskSettings, skip={"data"}),
        "## Moved keys",
        "",
        "Keys of earlier versions, now in a table; written at the top level they are an error naming the new place:",
        "",
        "| old key | now |",
        "|---|---|",
        *(f"| `{old}` | `[{t}] {k}` |" for old, (t, k) in load.MOVED_KEYS.items()),
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- CLI


def cli_reference() -> str:
    from flexorch.cli.main import build_parser

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "110"  # argparse wraps at the terminal's width: a fixed one, the same on every build
    try:
        parser = build_parser()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        helps = {a.dest: a.help for a in sub._choices_actions}
        lines = [
            "Generated from the installed parser (`flexorch.cli.main.build_parser()`): each command's `--help`, word "
            "for word. Flags override the run file's keys ([configuration reference](config.md)).",
            "",
            "## `flexorch`",
            "",
            "```text",
            parser.format_help().rstrip(),
            "```",
            "",
        ]
        for name, p in sub.choices.items():
            lines += [f"## `flexorch {name}`", "", f"{helps.get(name) or ''}".strip(), "", "```text"]
            lines += [p.format_help().rstrip(), "```", ""]
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- structure


def structure_table() -> str:
    ms = _make_structure()
    counts = ms.line_counts()
    files = sum(f for f, _ in counts.values())
    lines = sum(n for _, n in counts.values())
    return "\n".join(
        [
            f"{files} modules, {lines:,} lines of Python under `flexorch/` at this build "
            "(`python docs/make_structure.py` prints the same table):",
            "",
            ms.table(counts),
            f"| all | {files} | {lines:,} |",
            "",
        ]
    )


def imports_table() -> str:
    ms = _make_structure()
    graph = ms.edges()
    rows = ["| sub-package | imports (at this build) |", "|---|---|"]
    for row in ms.LAYERS:
        for name in row:
            targets = sorted(d for s, d in graph if s == name)
            rows.append(f"| `{name}` | {', '.join(f'`{t}`' for t in targets) or 'nothing outside itself'} |")
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------------------------- tests


def _marks(decorators: list[ast.expr]) -> set[str]:
    text = " ".join(ast.unparse(d) for d in decorators)
    return {m for m in ("slow", "gpu") if f"mark.{m}" in text}


def tests_table() -> str:
    rows = [
        "| module (under `tests/`) | test functions | marked slow | marked gpu | what it tests |",
        "|---|---:|---:|---:|---|",
    ]
    total = 0
    for path in sorted((REPO / "tests").glob("*/test_*.py")):  # by level: unit/, integration/, cluster/, gpu/
        tree = ast.parse(path.read_text())
        module_marks: set[str] = set()
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in stmt.targets):
                module_marks |= _marks([stmt.value])
        n = slow = gpu = 0
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
                marks = module_marks | _marks(node.decorator_list)
                n += 1
                slow += "slow" in marks
                gpu += "gpu" in marks
        total += n
        doc = ast.get_docstring(tree) or ""
        first = " ".join(doc.split("\n\n")[0].split())  # the first paragraph, up to its first sentence
        first = re.split(r"(?<=\.)\s", first, maxsplit=1)[0]
        name, what = path.relative_to(REPO / "tests"), _markdown(first).replace("|", "/")
        rows.append(f"| `{name}` | {n} | {slow or ''} | {gpu or ''} | {what} |")
    head = f"{len(rows) - 2} test modules, {total} test functions (parametrized ones collect as several tests):\n\n"
    return head + "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------------------------- hooks

GENERATORS = {
    "config": config_reference,
    "cli": cli_reference,
    "structure": structure_table,
    "imports": imports_table,
    "tests": tests_table,
}


def on_files(files, config):
    """``structure.svg`` drawn from the import graph at this build, in place of the checked-in copy."""
    from mkdocs.structure.files import File

    ms = _make_structure()
    old = files.get_file_from_path("structure.svg")
    if old is not None:
        files.remove(old)
    files.append(File.generated(config, "structure.svg", content=ms.svg(ms.line_counts(), ms.edges())))
    return files


def on_page_markdown(markdown, page, config, files):
    def block(m: re.Match) -> str:
        name = m.group(1)
        if name not in GENERATORS:
            raise ValueError(f"{page.file.src_uri}: unknown generated block {name!r}; known: {sorted(GENERATORS)}")
        return textwrap.dedent(GENERATORS[name]()).strip("\n")

    return MARKER.sub(block, GITHUB_ONLY.sub("", markdown))
