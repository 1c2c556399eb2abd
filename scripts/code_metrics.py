"""How the code is shaped: files over 300 lines, functions over 40, import cycles between modules.

    python scripts/code_metrics.py [--json]

Counts the three packages (app, tasks, gpu_worker); `duplicates --most 40` (the tool library's command)
gives the repeated blocks. An import cycle is a strongly connected set of modules in the graph of every
`import` (at module level and inside functions: an import inside a function that closes a cycle is still
a cycle, only a hidden one). Nothing here imports the code it measures.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "tasks", "gpu_worker")
MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 40


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """Project modules `path` imports (`from a.b import c` counts a.b.c when that is a module, else a.b)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` imports the module; pkg itself only for names that are not modules
            subs = [f"{base}.{alias.name}" for alias in node.names]
            targets = [s for s in subs if s in known] or [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
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
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def long_functions(path: Path) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                out.append((f"{path.relative_to(REPO)}:{node.lineno} {node.name}", length))
    return out


def measure() -> dict[str, object]:
    modules = sources()
    known = set(modules)
    graph = {name: imports_of(path, name, known) for name, path in modules.items()}
    files = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in modules.values()}
    functions = [f for p in modules.values() for f in long_functions(p)]
    return {
        "modules": len(modules),
        "files_over_300": {k: v for k, v in sorted(files.items(), key=lambda kv: -kv[1])
                           if v > MAX_FILE_LINES},
        "functions_over_40": dict(sorted(functions, key=lambda kv: -kv[1])),
        "import_cycles": cycles(graph),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    args = parser.parse_args()
    report = measure()
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['modules']} modules in {', '.join(PACKAGES)}")
    for key in ("files_over_300", "functions_over_40"):
        entries = report[key]
        assert isinstance(entries, dict)
        print(f"{key}: {len(entries)}")
        for where, n in entries.items():
            print(f"  {n:>4}  {where}")
    cyc = report["import_cycles"]
    assert isinstance(cyc, list)
    print(f"import_cycles: {len(cyc)}")
    for component in cyc:
        print("  " + " <-> ".join(component))


if __name__ == "__main__":
    main()
