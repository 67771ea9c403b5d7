"""The house counts of issue 12, measured the same way before and after.

Run: ``.venv/bin/python .ci/house_counts.py`` (after ``make typecheck-tree``). Prints strict
mypy errors, ``Any`` annotations, ``type: ignore``, ``noqa``, import cycles, functions over
60 lines and the share of public methods with a docstring, over common/, jobmanager/ and
taskmanager/ (the generated common/_proto excluded).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("common", "jobmanager", "taskmanager", "cli")
TREE = ROOT / "build" / "typecheck"


def sources() -> list[Path]:
    return sorted(p for f in FOLDERS for p in (ROOT / f).rglob("*.py") if "_proto" not in p.parts)


def mypy_errors() -> int:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--strict",
            *[a for f in FOLDERS for a in ("-p", f"keyedstate.{f}")],
        ],
        cwd=TREE,
        capture_output=True,
        text=True,
        env={"MYPYPATH": str(TREE), "PATH": "/usr/bin:/bin"},
    ).stdout
    return sum(1 for line in out.splitlines() if ": error:" in line and "/_proto/" not in line)


def word_count(pattern: str) -> int:
    rx = re.compile(pattern)
    total = 0
    for path in sources():
        for line in path.read_text().splitlines():
            if line.lstrip().startswith(("from ", "import ")):
                continue
            total += len(rx.findall(line))
    return total


def import_cycles() -> list[list[str]]:
    import grimp

    sys.path.insert(0, str(TREE))
    graph = grimp.build_graph("keyedstate", include_external_packages=False)
    mods = [m for m in graph.modules if "._proto" not in m]
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if "._proto" in w:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for m in mods:
        if m not in index:
            visit(m)
    return found


def long_functions(limit: int = 60) -> list[str]:
    out = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > limit:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length})")
    return out


def docstring_share() -> tuple[int, int]:
    documented = total = 0
    for path in sources():
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef) or cls.name.startswith("_"):
                continue
            for fn in cls.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and not fn.name.startswith("_"):
                    total += 1
                    documented += ast.get_docstring(fn) is not None
    return documented, total


def main() -> int:
    cycles = import_cycles()
    longs = long_functions()
    documented, total = docstring_share()
    print(f"strict type errors      {mypy_errors()}")
    anys, ignores, noqas = word_count(r"\bAny\b"), word_count(r"type:\s*ignore"), word_count(r"noqa")
    print(f"Any                     {anys}")
    print(f"type: ignore            {ignores}")
    print(f"noqa                    {noqas}")
    print(f"import cycles           {len(cycles)} ({sum(len(c) for c in cycles)} modules)")
    for c in cycles:
        print("    " + " <-> ".join(m.removeprefix("keyedstate.") for m in c))
    print(f"functions over 60 lines {len(longs)}")
    for f in longs:
        print("    " + f)
    print(f"public-method docstrings {documented}/{total} = {documented / max(total, 1):.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
