"""The import graph of ckptq, built with ``ast`` from the sources: no cycles, no upward imports.

Every import counts, lazy ones inside functions included. ``from pkg import name`` imports the
submodule ``pkg.name`` where there is one, else ``pkg`` itself; ``import a.b`` imports ``a.b`` (its
parent packages count only where they are imported themselves); ``importlib.import_module`` with a
literal name counts too. The layer of each module is :data:`LAYERS`, which mirrors the "Layers"
list of ``docs/design.md`` (checked below): a module imports only from its own layer or the layers
above it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ckptq"

#: layer -> the modules in it, as in docs/design.md's "Layers" list. ``name.*`` is a package with
#: everything inside it. A module that no entry covers fails :func:`test_every_module_has_a_layer`.
LAYERS: dict[int, tuple[str, ...]] = {
    1: ("ckptq._version", "ckptq._gc", "ckptq.errors", "ckptq.chunks", "ckptq.numerics"),
    2: ("ckptq.ops.*",),
    3: ("ckptq.formats.*", "ckptq.placement", "ckptq.metrics", "ckptq.checksums"),
    4: ("ckptq.contract", "ckptq.adapters.*"),
    5: ("ckptq.io.*",),
    6: ("ckptq.checkpoint", "ckptq.inspect", "ckptq.verify", "ckptq.parse", "ckptq.distributed"),
    7: ("ckptq.planners.*", "ckptq.reshard.*", "ckptq.export"),
    8: ("ckptq.cli.*", "ckptq", "ckptq.__main__"),
}

#: the modules that may import the package facade ``ckptq`` (``ckptq/__init__.py``)
FACADE_USERS = ("ckptq", "ckptq.__main__", "ckptq.cli.*")
#: geometry: imports neither the formats nor the parsing of user strings, even indirectly
GEOMETRY = ("ckptq.chunks", "ckptq.placement")
GEOMETRY_MAY_NOT_REACH = ("ckptq.formats.*", "ckptq.parse")
#: other libraries' quantized tensors: named only under ckptq/adapters (which never imports them)
FOREIGN_LIBRARIES = ("transformer_engine", "transformer_engine_torch", "torchao", "compressed_tensors", "modelopt")
ADAPTERS = ("ckptq.adapters.*",)


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (source path, is a package)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_pkg)
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The ckptq module an imported dotted name refers to: itself, or its longest module prefix
    (``ckptq.formats.base.QuantizedTensor`` -> ``ckptq.formats.base``); None outside ckptq."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _absolute(module: str, is_pkg: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(module: str) -> tuple[set[str], set[str]]:
    """``(ckptq modules, top-level names of other packages)`` that ``module`` imports anywhere."""
    path, is_pkg = MODULES[module]
    ours, others = set(), set()

    def add(name: str) -> None:
        if name == "ckptq" or name.startswith("ckptq."):
            resolved = _resolve(name)
            if resolved is not None and resolved != module:
                ours.add(resolved)
        else:
            others.add(name.split(".")[0])

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, is_pkg, node.level, node.module) if node.level else node.module
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                add(sub if sub in MODULES else target)
        elif (
            isinstance(node, ast.Call)
            and (getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) == "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            name = node.args[0].value
            if name.startswith("."):  # import_module(".io", __name__): relative to this package
                level = len(name) - len(name.lstrip("."))
                name = _absolute(module, is_pkg, level, name.lstrip(".") or None)
            add(name)
    return ours, others


GRAPH: dict[str, set[str]] = {}
OTHERS: dict[str, set[str]] = {}
for _m in MODULES:
    GRAPH[_m], OTHERS[_m] = _imports(_m)


def _matches(module: str, patterns) -> bool:
    return any(module == p.removesuffix(".*") or (p.endswith(".*") and module.startswith(p[:-1])) for p in patterns)


def _layer(module: str) -> int | None:
    # the most specific entry wins (a module listed by name inside a package listed with .*)
    best = None
    for layer, patterns in LAYERS.items():
        for p in patterns:
            if _matches(module, [p]) and (best is None or len(p.removesuffix(".*")) > best[0]):
                best = (len(p.removesuffix(".*")), layer)
    return None if best is None else best[1]


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
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

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def _path(src: str, dst: str, within: set[str]) -> list[str]:
    """A shortest import path src -> ... -> dst through ``within`` (for the failure message)."""
    prev, frontier = {src: None}, [src]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(GRAPH[v] & within):
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    out, v = [], dst
    while v is not None:
        out.append(v)
        v = prev.get(v)
    return out[::-1]


def test_the_graph_sees_the_package():
    assert {"ckptq", "ckptq.chunks", "ckptq.formats.base", "ckptq.adapters.te", "ckptq.cli"} <= set(MODULES)
    assert "ckptq.formats.base" in GRAPH["ckptq.formats.fp8"]  # a relative import
    assert "ckptq.ops" in GRAPH["ckptq.formats.base"]  # from .. import ops: the submodule
    assert "ckptq.io" in GRAPH["ckptq"]  # importlib.import_module(".io", __name__) in the facade


def test_no_import_cycles():
    cycles = _cycles()
    shown = []
    for comp in cycles:
        a = comp[0]
        b = next(iter(sorted(GRAPH[a] & set(comp))))
        shown.append(" -> ".join(_path(a, b, set(comp)) + _path(b, a, set(comp))[1:]))
    assert not cycles, "import cycles (lazy imports included):\n  " + "\n  ".join(shown)


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if _layer(m) is None)
    assert not missing, f"modules without a layer: add them to LAYERS here and to docs/design.md: {missing}"


def test_no_upward_imports():
    bad = [
        f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
        for m in sorted(GRAPH)
        for t in sorted(GRAPH[m])
        if _layer(m) is not None and _layer(t) is not None and _layer(t) > _layer(m)
    ]
    assert not bad, "upward imports (see docs/design.md, Layers):\n  " + "\n  ".join(bad)


def test_library_modules_do_not_import_the_facade():
    bad = sorted(m for m in GRAPH if "ckptq" in GRAPH[m] and not _matches(m, FACADE_USERS))
    assert not bad, f"library modules importing the package facade ckptq/__init__.py: {bad}"


@pytest.mark.parametrize("module", GEOMETRY)
def test_geometry_imports_neither_formats_nor_parsing(module):
    reach, frontier = set(), [module]
    while frontier:
        v = frontier.pop()
        for w in GRAPH[v] - reach:
            reach.add(w)
            frontier.append(w)
    bad = sorted(m for m in reach if _matches(m, GEOMETRY_MAY_NOT_REACH))
    assert not bad, f"{module} reaches {[' -> '.join(_path(module, b, set(MODULES))) for b in bad]}"


def test_only_adapters_name_foreign_libraries():
    bad = {
        m: sorted(OTHERS[m] & set(FOREIGN_LIBRARIES))
        for m in sorted(OTHERS)
        if OTHERS[m] & set(FOREIGN_LIBRARIES) and not _matches(m, ADAPTERS)
    }
    assert not bad, f"modules outside ckptq/adapters importing another library's quantized tensors: {bad}"


def _design_layers() -> dict[int, str]:
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    items, current = {}, None
    for line in section.splitlines():
        m = re.match(r"(\d+)\. (.*)", line)
        if m:
            current = int(m.group(1))
            items[current] = m.group(2)
        elif current is not None and line.startswith("   "):
            items[current] += " " + line.strip()
    return items


def test_layers_mirror_the_design_document():
    items = _design_layers()
    assert sorted(items) == sorted(LAYERS), f"docs/design.md lists layers {sorted(items)}, this test {sorted(LAYERS)}"
    missing = []
    for layer, patterns in LAYERS.items():
        for p in patterns:
            name = p.removesuffix(".*")
            name = "ckptq" if name == "ckptq" else name.removeprefix("ckptq.")
            if f"`{name}`" not in items[layer]:
                missing.append(f"`{name}` in item {layer}")
    assert not missing, f"docs/design.md's Layers list does not name: {missing}"
