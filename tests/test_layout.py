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
