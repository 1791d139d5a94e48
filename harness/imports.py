"""hvd_dgc's import graph, read from the sources (nothing is imported): every import
of one of the package's modules by another, at the top of a module or inside a function,
and ``importlib.import_module`` / ``__import__`` with a literal name.

tests/product/test_layout.py holds the package to no cycle and no arrow back up (the
framework-free core importing a framework, or one framework the other);
tools/code_shape.py prints the same counts.
"""

import ast
import os

from harness.hvdrun import REPO

FRAMEWORKS = ("torch", "tensorflow")


def _dynamic_name(call):
    """The literal module name of ``importlib.import_module("x")`` / ``__import__("x")``."""
    func = call.func
    if isinstance(func, ast.Name):
        name = func.id
    elif isinstance(func, ast.Attribute):
        name = func.attr
    else:
        return None
    if name not in ("import_module", "__import__") or not call.args:
        return None
    first = call.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    return None


def imported_modules(source, filename="<source>"):
    """(line, module) for every module ``source`` imports (absolute names only: a
    relative ``from . import x`` stays inside its own package)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call):
            name = _dynamic_name(node)
            if name is not None:
                found.append((node.lineno, name))
    return found


def _package_modules(root=REPO):
    """module name -> its file, for hvd_dgc's Python modules and the extension modules
    setup.py builds (named there, so a clone that has not built them still knows them)."""
    modules = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, "hvd_dgc")):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in filenames:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                modules[module.removesuffix(".__init__")] = path
    with open(os.path.join(root, "setup.py"), encoding="utf-8") as f:
        for node in ast.walk(ast.parse(f.read())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "CppExtension"
                    and isinstance(node.args[0], ast.Constant)):
                modules[node.args[0].value] = None  # compiled: it imports nothing of ours
    return modules


def import_graph(root=REPO):
    """module -> the hvd_dgc modules it imports, anywhere in it (inside functions, and
    ``importlib.import_module`` with a literal name). ``from package import name``
    counts as importing ``package.name`` where that is a module, else ``package``."""
    modules = _package_modules(root)
    graph = {}
    for module, path in modules.items():
        edges = set()
        if path is not None:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        parts = package.split(".")
                        parts = parts[:len(parts) - (node.level - 1)]
                        base = ".".join(parts + ([node.module] if node.module else []))
                    names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                             for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.Call):
                    names = [_dynamic_name(node)]
                else:
                    continue
                edges |= {n for n in names if n in modules and n != module}
        graph[module] = edges
    return graph


def import_cycles(graph):
    """The import graph's cycles: each strongly connected part of more than one module."""
    order, low, stack, on_stack, parts = {}, {}, [], set(), []

    def visit(v):
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                parts.append(sorted(part))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return parts


def programs(graph, root=REPO):
    """The command-line programs (``python -m hvd_dgc.info``, ``hvd_dgc.predict``) that
    no module imports: the layer on top, which may use either framework."""
    imported = {b for targets in graph.values() for b in targets}
    found = set()
    for module in graph:
        path = os.path.join(root, *module.split(".")) + ".py"
        if module not in imported and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                if '__name__ == "__main__"' in f.read():
                    found.add(module)
    return found


def _side(module):
    """'torch' or 'tensorflow' for a module of that half, None for the core."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FRAMEWORKS else None


def arrows_up(graph, top=()):
    """(importer, imported) for each import that points back up: the core into a
    framework, or one framework into the other; ``top``'s programs excepted."""
    return sorted((a, b) for a, targets in graph.items() for b in targets
                  if a not in top and _side(b) is not None and _side(a) != _side(b))
