"""The shape of hvd_dgc's code, measured: where it is hard to change.

    python tools/code_shape.py            # the package hvd_dgc/
    python tools/code_shape.py --top 10

Prints the largest classes and functions (lines, methods, attributes set in
``__init__``), and the branches on a path kind outside the path classes: comparisons
(``==``, ``!=``, ``in``, ``is``) and dict lookups keyed by one of the path names
(dense, sparse/allgather, region, hierarchical, exchange, sparse_grad, local) or by a
compressor kind (``is_sparse``/``is_exchange`` calls). A new path should be one more
class, not more such branches.

Then the import graph (harness/imports.py): its modules, imports, cycles and arrows back
up, the command-line programs on top excepted.
"""

import argparse
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from harness.imports import arrows_up, import_cycles, import_graph, programs  # noqa: E402

PATH_WORDS = {"dense", "sparse", "allgather", "region", "hierarchical", "exchange",
              "sparse_grad", "local", "gather"}
PATH_NAMES = {w.upper() for w in PATH_WORDS} | {"_DENSE", "_SPARSE", "_REGION",
                                                 "_HIERARCHICAL", "_EXCHANGE", "LOCAL",
                                                 "SPARSE_GRAD", "GATHER"}
KIND_CALLS = {"is_sparse", "is_exchange"}


def _is_path_term(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value in PATH_WORDS
    if isinstance(node, ast.Name):
        return node.id in PATH_NAMES
    if isinstance(node, ast.Attribute):  # PathKind.DENSE, paths.SPARSE
        return node.attr in PATH_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_path_term(e) for e in node.elts)
    return False


def _in_path_class(stack):
    return any(name.endswith("Path") or name.endswith("Paths") for name in stack)


class Shape(ast.NodeVisitor):
    def __init__(self, path):
        self.path = path
        self.stack = []
        self.classes, self.functions, self.branches = [], [], []

    def visit_ClassDef(self, node):
        methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        attrs = set()
        for m in methods:
            if m.name == "__init__":
                for sub in ast.walk(m):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) \
                            and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        attrs.add(sub.attr)
        self.classes.append((node.end_lineno - node.lineno + 1, len(methods), len(attrs),
                             f"{self.path}:{node.lineno} {node.name}"))
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    def visit_FunctionDef(self, node):
        where = ".".join(self.stack + [node.name])
        self.functions.append((node.end_lineno - node.lineno + 1,
                               f"{self.path}:{node.lineno} {where}"))
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def _branch(self, node, what):
        if not _in_path_class(self.stack):
            self.branches.append(f"{self.path}:{node.lineno} {what}")

    def visit_Compare(self, node):
        if any(_is_path_term(n) for n in [node.left] + node.comparators):
            self._branch(node, "compares a path kind")
        self.generic_visit(node)

    def visit_Subscript(self, node):
        if _is_path_term(node.slice):
            self._branch(node, "looks up by a path kind")
        self.generic_visit(node)

    def visit_Call(self, node):
        name = node.func.id if isinstance(node.func, ast.Name) else \
            node.func.attr if isinstance(node.func, ast.Attribute) else None
        if name in KIND_CALLS:
            self._branch(node, f"asks {name}")
        self.generic_visit(node)


def measure(package):
    shapes = []
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
        for name in sorted(files):
            if name.endswith(".py"):
                full = os.path.join(folder, name)
                rel = os.path.relpath(full, ROOT)
                with open(full) as f:
                    tree = ast.parse(f.read(), rel)
                shape = Shape(rel)
                shape.visit(tree)
                shapes.append(shape)
    return shapes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--package", default="hvd_dgc")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--branches", action="store_true", help="list every branch")
    args = parser.parse_args()
    shapes = measure(args.package)
    classes = sorted((c for s in shapes for c in s.classes), reverse=True)
    functions = sorted((f for s in shapes for f in s.functions), reverse=True)
    branches = [b for s in shapes for b in s.branches]
    print(f"largest classes (lines, methods, attributes set in __init__):")
    for lines, methods, attrs, where in classes[:args.top]:
        print(f"  {lines:5d} lines {methods:3d} methods {attrs:3d} attributes  {where}")
    print(f"largest functions (lines):")
    for lines, where in functions[:args.top]:
        print(f"  {lines:5d} lines  {where}")
    by_file = {}
    for b in branches:
        by_file.setdefault(b.split(":")[0], 0)
        by_file[b.split(":")[0]] += 1
    print(f"branches on a path or compressor kind outside path classes: {len(branches)}")
    for path, count in sorted(by_file.items(), key=lambda kv: -kv[1]):
        print(f"  {count:4d}  {path}")
    if args.branches:
        for b in branches:
            print("   ", b)
    sides = [_module_names(os.path.join(ROOT, args.package, side))
             for side in ("torch", "tensorflow")]
    shared, every = sides[0] & sides[1], sides[0] | sides[1]
    print(f"module names shared by {args.package}/torch and {args.package}/tensorflow: "
          f"{len(shared)} of {len(every)} ({100 * len(shared) / len(every):.0f}%)")
    print(f"  torch only: {' '.join(sorted(sides[0] - shared))}")
    print(f"  tensorflow only: {' '.join(sorted(sides[1] - shared))}")
    graph = import_graph(ROOT)
    top = programs(graph, ROOT)
    loops, up = import_cycles(graph), arrows_up(graph, top)
    print(f"import graph: {len(graph)} modules, {sum(map(len, graph.values()))} imports "
          f"(inside functions and through importlib too); cycles: {len(loops)}; arrows "
          f"back up: {len(up)} (on top: {' '.join(sorted(top))})")
    for group in loops:
        print(f"  cycle: {' '.join(group)}")
    for a, b in up:
        print(f"  up: {a} -> {b}")
    return 0


def _module_names(folder):
    """A folder's module names: its .py files and its packages."""
    return {name[:-3] if name.endswith(".py") else name for name in os.listdir(folder)
            if name.endswith(".py") or os.path.isfile(os.path.join(folder, name,
                                                                   "__init__.py"))}


if __name__ == "__main__":
    sys.exit(main())
