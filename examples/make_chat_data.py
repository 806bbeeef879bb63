"""Writes examples/data/chat_stdlib.jsonl, the small chat file examples/train_chat_hf.toml fine-tunes on.

Conversations about the Python standard library, written from its own sources and docstrings (real text, no
download), as a user would fine-tune a model on long-document question answering:

- short: "What is the module X for?" answered with the first paragraph of X's docstring;
- multi-turn: three modules asked about one after another in one conversation, with a system turn;
- long: the source of a function (up to ~6,000 characters) pasted by the user, then "What does NAME do?",
  answered with the function's docstring; these are longer than one worker's token budget, so the planner gives
  them sequence-parallel groups.

Deterministic for a given Python (modules and functions in sorted order). Run from the repository root:
    python examples/make_chat_data.py
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from pathlib import Path

OUT = Path(__file__).parent / "data" / "chat_stdlib.jsonl"
MODULES = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if not p.name.startswith("_"))


def first_paragraph(doc: str | None) -> str | None:
    if not doc:
        return None
    para = doc.strip().split("\n\n")[0]
    text = " ".join(line.strip() for line in para.splitlines())
    return text if 40 <= len(text) <= 600 else None


def main() -> None:
    rng = random.Random(0)
    modules, functions = [], []
    for path in MODULES:
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        about = first_paragraph(ast.get_docstring(tree))
        if about:
            modules.append((path.stem, about))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                answer = first_paragraph(ast.get_docstring(node))
                code = ast.get_source_segment(source, node) or ""
                if answer and 1500 <= len(code) <= 6000:
                    functions.append((path.stem, node.name, code, answer))
    rows = []
    for name, about in modules[:60]:
        rows.append({"messages": [
            {"role": "user", "content": f"What is the Python module `{name}` for?"},
            {"role": "assistant", "content": about},
        ]})  # fmt: skip
    for i in range(0, min(len(modules), 90) - 2, 3):
        turns = [{"role": "system", "content": "You answer questions about the Python standard library briefly."}]
        for name, about in modules[i : i + 3]:
            turns += [
                {"role": "user", "content": f"And `{name}`?" if len(turns) > 1 else f"What does `{name}` do?"},
                {"role": "assistant", "content": about},
            ]
        rows.append({"messages": turns})
    for module, name, code, answer in functions[:40]:
        question = f"Here is a function from `{module}`:\n\n```python\n{code}\n```\n\nWhat does `{name}` do?"
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    rng.shuffle(rows)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    long = sum(len(json.dumps(r)) > 2000 for r in rows)
    print(f"wrote {OUT}: {len(rows)} conversations ({long} over 2,000 characters), {OUT.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
