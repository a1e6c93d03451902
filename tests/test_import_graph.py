"""The import graph of sgl_ext and srt: imports run downward.

Every import counts: module level, inside functions and under `TYPE_CHECKING`. An edge from a
module to one of its own parent packages is left out (importing a submodule runs its package
first, which is not a cycle of the code's design).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sgl_ext", "srt")
# Cycles still to break, each as its sorted members; the test fails when one is gone too, so
# the list only shrinks. engine <-> tp_workers: the Engine spawns the rank workers, which build
# an Engine of their own (to be split in srt/entrypoints).
PENDING: set[tuple[str, ...]] = set()


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imported(name: str, path: Path, tree: ast.AST) -> list[str]:
    """Every dotted name an import statement of the module names (absolute)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return names


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the packages it imports (any import statement anywhere)."""
    mods = modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for target in _imported(m, path, ast.parse(path.read_text(), str(path))):
            while target and target not in mods:  # a name inside a module -> the module
                target = target.rpartition(".")[0]
            if target and target != m and not m.startswith(target + "."):
                graph[m].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[tuple[str, ...]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.add(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_sees_function_level_and_type_checking_imports(tmp_path):
    """The finder itself: a cycle closed inside a function or under TYPE_CHECKING counts."""
    pkg = tmp_path / "srt"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "sgl_ext").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from srt.sub import a\n")  # parent edge: ignored
    (pkg / "sub" / "a.py").write_text("import srt.sub\ndef f():\n    from srt.sub.b import g\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n"
    )
    (pkg / "c.py").write_text("from srt.sub import b\n")
    assert cycles(import_graph(tmp_path)) == {("srt.sub.a", "srt.sub.b")}
    (pkg / "sub" / "b.py").write_text("")
    assert cycles(import_graph(tmp_path)) == set()


def test_no_import_cycles():
    """No cycle in sgl_ext or srt beyond the pending ones (imports run downward)."""
    found = cycles(import_graph())
    assert found - PENDING == set(), f"import cycles: {sorted(found - PENDING)}"
    assert PENDING - found == set(), f"broken now, drop from PENDING: {sorted(PENDING - found)}"


def private_sgl_ext_uses(path: Path) -> list[str]:
    """Where a module reaches into sgl_ext's private parts: a module `sgl_ext._*` or
    `sgl_ext.triton*`, or a name starting with `_` imported from or read off an sgl_ext module.
    Each as 'line: what'."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        uses: list[str] = []
        if isinstance(node, ast.Import):
            uses = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            uses = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            uses = [f"{node.value.id}.{node.attr}"]
        for name in uses:
            parts = name.split(".")
            if parts[0] == "sgl_ext" and any(p.startswith("_") or p == "triton" for p in parts):
                found.append(f"{node.lineno}: {name}")
    return found


def test_private_sgl_ext_finder(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text(
        "import sgl_ext\nfrom sgl_ext import settings\nfrom sgl_ext.launch import pdl_enter\n"
        "from sgl_ext._common import X\nimport sgl_ext.triton.launcher as L\n"
        "from sgl_ext.rope import _check_kv\nsgl_ext._ops\nfrom srt._x import y\n"
    )
    assert private_sgl_ext_uses(mod) == [
        "4: sgl_ext._common",
        "4: sgl_ext._common.X",
        "5: sgl_ext.triton.launcher",
        "6: sgl_ext.rope._check_kv",
        "7: sgl_ext._ops",
    ]


def test_srt_uses_only_public_sgl_ext():
    """srt reaches sgl_ext through its public modules (`sgl_ext`, `sgl_ext.launch`, the op
    modules, `sgl_ext.settings`), never `sgl_ext._*` or `sgl_ext.triton.*`."""
    found = {
        str(path.relative_to(ROOT)): uses
        for path in sorted((ROOT / "srt").rglob("*.py"))
        if (uses := private_sgl_ext_uses(path))
    }
    assert found == {}
