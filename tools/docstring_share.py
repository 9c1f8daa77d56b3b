"""The share of docstring lines among a package's non-blank lines.

    python tools/docstring_share.py [PACKAGE_DIR] [--top N]

A docstring is the first statement of a module, class or function when it
is a string; its non-blank lines count.  Prints the share overall and the
modules with the most docstring lines.
"""

from __future__ import annotations

import argparse
import ast
import pathlib


def docstring_lines(source: str) -> tuple[int, int]:
    """(non-blank docstring lines, non-blank lines) of one module's source."""
    lines = source.splitlines()
    total = sum(1 for line in lines if line.strip())
    doc = 0
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            first, last = body[0].lineno, body[0].end_lineno or body[0].lineno
            doc += sum(1 for line in lines[first - 1 : last] if line.strip())
    return doc, total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("package", nargs="?", default=str(pathlib.Path(__file__).resolve().parent.parent / "fp_dcp"))
    p.add_argument("--top", type=int, default=10, help="list the N modules with the most docstring lines")
    args = p.parse_args(argv)
    root = pathlib.Path(args.package)
    per = []
    for path in sorted(root.rglob("*.py")):
        doc, total = docstring_lines(path.read_text())
        per.append((doc, total, path.relative_to(root.parent)))
    doc = sum(d for d, _, _ in per)
    total = sum(t for _, t, _ in per)
    print(f"{root}: {doc} docstring lines of {total} non-blank lines: {100 * doc / max(1, total):.1f} %")
    for d, t, path in sorted(per, key=lambda x: -x[0])[: args.top]:
        print(f"  {d:5d} / {t:5d}  {100 * d / max(1, t):5.1f} %  {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
