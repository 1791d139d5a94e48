"""The project's layers: tests and benchmarks never import each other (what both use
lives in harness/), and hvd_dgc's import graph (harness/imports.py) has no cycle and no
arrow back up.

Every .py file under tests/ and bench/ is parsed (not imported) and each import it
makes is checked: ``import x``, ``from x import y``, and ``importlib.import_module("x")``
or ``__import__("x")`` with a literal name. A file under tests/ may not import
``bench`` (or ``bench.*``); a file under bench/ may not import ``tests`` (or ``tests.*``).
"""

import os

from harness.hvdrun import REPO
from harness.imports import arrows_up, import_cycles, import_graph, imported_modules, programs

FORBIDDEN = {"tests": "bench", "bench": "tests"}  # the folder -> the package it may not import


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


def test_hvd_dgc_has_no_import_cycle():
    """No module of hvd_dgc reaches itself through its imports, counting imports inside
    functions and through importlib."""
    graph = import_graph()
    assert len(graph) > 60 and "hvd_dgc.torch._fused_memory" in graph
    assert "hvd_dgc.torch.elastic" in graph["hvd_dgc.torch"]  # importlib is seen
    assert import_cycles(graph) == []


def test_hvd_dgc_has_no_arrow_back_up():
    """The framework-free core imports neither framework and neither framework the
    other; only the command-line programs on top (which report or plan for both) do."""
    graph = import_graph()
    top = programs(graph)
    assert top == {"hvd_dgc.info", "hvd_dgc.predict"}
    assert arrows_up(graph, top) == []
    assert ("hvd_dgc.predict", "hvd_dgc.torch.link") in arrows_up(graph)  # they are seen


def test_an_arrow_back_up_is_found():
    graph = {"hvd_dgc.plan": {"hvd_dgc.torch.paths", "hvd_dgc.costmodel"},
             "hvd_dgc.costmodel": set(), "hvd_dgc.torch.paths": {"hvd_dgc.plan"},
             "hvd_dgc.tensorflow.paths": {"hvd_dgc.torch.paths", "hvd_dgc.tensorflow"},
             "hvd_dgc.tensorflow": set()}
    assert arrows_up(graph) == [("hvd_dgc.plan", "hvd_dgc.torch.paths"),
                                ("hvd_dgc.tensorflow.paths", "hvd_dgc.torch.paths")]
    assert arrows_up(graph, top={"hvd_dgc.plan"}) == [
        ("hvd_dgc.tensorflow.paths", "hvd_dgc.torch.paths")]


def test_a_cycle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
