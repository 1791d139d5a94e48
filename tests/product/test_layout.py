"""Tests and benchmarks never import each other: what both use lives in harness/.

Every .py file under tests/ and bench/ is parsed (not imported) and each import it
makes is checked: ``import x``, ``from x import y``, and ``importlib.import_module("x")``
or ``__import__("x")`` with a literal name. A file under tests/ may not import
``bench`` (or ``bench.*``); a file under bench/ may not import ``tests`` (or ``tests.*``).
"""

import ast
import os

from harness.hvdrun import REPO

FORBIDDEN = {"tests": "bench", "bench": "tests"}  # the folder -> the package it may not import


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


def violations(root=REPO):
    """"path:line imports module" for each import across the tests/bench boundary."""
    out = []
    for folder, banned in FORBIDDEN.items():
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, folder)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(f for f in filenames if f.endswith(".py")):
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    source = f.read()
                for line, module in imported_modules(source, path):
                    if module == banned or module.startswith(banned + "."):
                        out.append(f"{os.path.relpath(path, root)}:{line} imports {module} "
                                   f"({folder}/ may not import {banned}: shared code goes "
                                   f"in harness/)")
    return out


def test_tests_and_benchmarks_do_not_import_each_other():
    found = violations()
    assert not found, "\n".join(found)


def test_every_form_of_import_is_seen(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "bench" / "wan").mkdir(parents=True)
    (tmp_path / "tests" / "test_x.py").write_text(
        "import os\nimport bench.wan.x as w\nfrom bench import y\n"
        "from benchmarks import fine\nimport importlib\n"
        "def f():\n    importlib.import_module('bench.z')\n    __import__('bench')\n"
        "    importlib.import_module(name)\n")
    (tmp_path / "bench" / "wan" / "w.py").write_text(
        "from tests.workers import torch_dgc\nfrom . import sibling\nimport testsuite\n"
        "from importlib import import_module\nimport_module('tests.helpers')\n")
    assert sorted(violations(str(tmp_path))) == sorted([
        f"{os.path.join('bench', 'wan', 'w.py')}:1 imports tests.workers "
        "(bench/ may not import tests: shared code goes in harness/)",
        f"{os.path.join('bench', 'wan', 'w.py')}:5 imports tests.helpers "
        "(bench/ may not import tests: shared code goes in harness/)",
        f"{os.path.join('tests', 'test_x.py')}:2 imports bench.wan.x "
        "(tests/ may not import bench: shared code goes in harness/)",
        f"{os.path.join('tests', 'test_x.py')}:3 imports bench "
        "(tests/ may not import bench: shared code goes in harness/)",
        f"{os.path.join('tests', 'test_x.py')}:7 imports bench.z "
        "(tests/ may not import bench: shared code goes in harness/)",
        f"{os.path.join('tests', 'test_x.py')}:8 imports bench "
        "(tests/ may not import bench: shared code goes in harness/)",
    ])


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


def test_hvd_dgc_has_no_import_cycle():
    """No module of hvd_dgc reaches itself through its imports, counting imports inside
    functions and through importlib."""
    graph = import_graph()
    assert len(graph) > 60 and "hvd_dgc.torch._fused_memory" in graph
    assert "hvd_dgc.torch.elastic" in graph["hvd_dgc.torch"]  # importlib is seen
    assert import_cycles(graph) == []


def test_a_cycle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
