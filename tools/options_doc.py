#!/usr/bin/env python3
"""Write docs/options.md from the code, so the page cannot drift from it.

    python tools/options_doc.py > docs/options.md   # print the page
    python tools/options_doc.py --write             # the same, written in place
    python tools/options_doc.py --check             # exit 1 if docs/options.md differs

What it reads, all from hvd_dgc/config.py (framework-free: neither torch nor
TensorFlow is imported):
- ``DGCConfig``'s fields (``dataclasses.fields``): names and defaults;
- the "Attributes:" section of ``DGCConfig``'s docstring: one ``name: text``
  entry per option, continuation lines indented deeper;
- ``_TORCH_ONLY``: what TensorFlow and Keras refuse, and what to pass instead.
  The condition under which each entry refuses is a lambda; its source is read
  with ``ast`` to print it (the entries themselves come from the imported tuple).

tests/product/test_docs.py checks that docs/options.md equals this script's output.
"""

import argparse
import ast
import dataclasses
import inspect
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from hvd_dgc import config as config_module  # noqa: E402
from hvd_dgc.config import _TORCH_ONLY, DGCConfig  # noqa: E402

PAGE = os.path.join(REPO, "docs", "options.md")
COMMAND = "python tools/options_doc.py --write"

_ENTRY = re.compile(r"^(\s+)([A-Za-z_]\w*):(?:\s+(.*))?$")


def _markdown(text):
    """reStructuredText's ``code`` as Markdown's `code`."""
    return text.replace("``", "`")


def attributes(doc):
    """``{name: description}`` from the "Attributes:" section of a Google-style
    docstring: an entry is ``name: text`` one indentation step in, continuation lines
    are indented deeper; the section ends at the first non-blank line indented no
    deeper than the "Attributes:" line. A line the rule does not fit is an error, so a
    docstring edited out of shape fails loudly instead of losing text."""
    lines = inspect.cleandoc(doc or "").splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == "Attributes:"]
    if not starts:
        raise ValueError("the docstring has no 'Attributes:' section")
    header = lines[starts[0]]
    header_indent = len(header) - len(header.lstrip())
    entries, name, entry_indent = {}, None, None
    for line in lines[starts[0] + 1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= header_indent:
            break
        match = _ENTRY.match(line)
        if entry_indent is None and match:
            entry_indent = indent
        if match and indent == entry_indent:
            name = match.group(2)
            if name in entries:
                raise ValueError(f"'Attributes:' describes {name!r} twice")
            entries[name] = [match.group(3) or ""]
        elif name is not None and indent > entry_indent:
            entries[name].append(line.strip())
        else:
            raise ValueError(f"cannot read this line of 'Attributes:': {line.strip()!r}")
    return {key: " ".join(part for part in parts if part) for key, parts in entries.items()}


class _Rename(ast.NodeTransformer):
    def __init__(self, old, new):
        self.old, self.new = old, new

    def visit_Name(self, node):
        return ast.copy_location(ast.Name(self.new, node.ctx), node) if node.id == self.old \
            else node


def refusal_conditions():
    """``[(option, condition as Python text)]``, one per entry of ``_TORCH_ONLY``, in
    its order, read from hvd_dgc/config.py's source; None where the source cannot be
    matched to the imported tuple entry by entry."""
    tree = ast.parse(inspect.getsource(config_module))
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "_TORCH_ONLY" for t in targets):
            break
    else:
        return None
    out = []
    for element in getattr(node.value, "elts", []):
        parts = getattr(element, "elts", [])
        if len(parts) < 2 or not isinstance(parts[0], ast.Constant) or not isinstance(
                parts[1], ast.Lambda) or len(parts[1].args.args) != 1:
            return None
        arg = parts[1].args.args[0].arg
        body = _Rename(arg, "config").visit(parts[1].body)
        out.append((parts[0].value, ast.unparse(body)))
    if [name for name, _ in out] != [entry[0] for entry in _TORCH_ONLY]:
        return None
    return out


def frameworks():
    """``{option: [(condition or None, what to pass instead)]}`` for the options
    TensorFlow and Keras refuse for some values."""
    conditions = refusal_conditions()
    out = {}
    for i, (name, _used, instead) in enumerate(_TORCH_ONLY):
        out.setdefault(name, []).append((conditions[i][1] if conditions else None, instead))
    return out


def _refusal(condition, instead):
    where = f"where `{condition}`" if condition else "for some values"
    return f"refused {where}: pass {instead}"


def _default(field):
    if field.default is not dataclasses.MISSING:
        return f"`{field.default!r}`"
    if field.default_factory is not dataclasses.MISSING:
        return f"`{field.default_factory()!r}`"
    return "required"


def _module_paragraphs():
    """hvd_dgc/config.py's docstring, less its title line."""
    doc = inspect.cleandoc(config_module.__doc__ or "")
    paragraphs = [" ".join(p.split()) for p in doc.split("\n\n")]
    return [_markdown(p) for p in paragraphs[1:] if p]


def render():
    """The whole page, as text."""
    described = attributes(DGCConfig.__doc__)
    fields = dataclasses.fields(DGCConfig)
    names = [f.name for f in fields]
    unknown = sorted(set(described) - set(names))
    if unknown:
        raise ValueError(f"DGCConfig's docstring describes {unknown}, which are not fields")
    refused = frameworks()
    title = inspect.cleandoc(DGCConfig.__doc__).split("\n\n")[0]
    out = [
        "<!-- Generated by tools/options_doc.py from hvd_dgc/config.py. Do not edit: "
        f"run `{COMMAND}`. -->",
        "",
        "# Options",
        "",
        "hvd_dgc's own options: the keyword arguments that "
        "`hvd_dgc.torch.DistributedOptimizer`, `hvd_dgc.tensorflow.DistributedGradientTape` "
        "and `hvd_dgc.tensorflow.keras.DistributedOptimizer` take besides Horovod's. "
        "They are one frozen `hvd_dgc.config.DGCConfig`, so each option is checked once, "
        "with one message, whichever framework the script uses; an unknown option is "
        "refused with the closest name. Below: each option's default, the frameworks "
        "that run it, and its description. "
        "[Back to the README](../README.md).",
        "",
        "This page is generated from the code by `tools/options_doc.py`: the fields and "
        "defaults of `hvd_dgc.config.DGCConfig`, the \"Attributes:\" section of its "
        "docstring, and `hvd_dgc.config._TORCH_ONLY` (what TensorFlow and Keras refuse, "
        f"and what to pass instead). Do not edit it by hand: change the code, then run "
        f"`{COMMAND}` (or `python tools/options_doc.py > docs/options.md`). "
        "`tests/product/test_docs.py` fails while the page differs from what the script writes.",
        "",
    ]
    out += ["## How the options are taken (hvd_dgc/config.py)", ""]
    out += [p + "\n" for p in _module_paragraphs()]
    out += [_markdown(" ".join(title.split())), ""]
    out += [
        "## Summary",
        "",
        "| option | default | PyTorch | TensorFlow and Keras |",
        "| --- | --- | --- | --- |",
    ]
    for f in fields:
        tf_cell = "; ".join(_refusal(c, i) for c, i in refused.get(f.name, [])) or "yes"
        out.append(f"| [`{f.name}`](#{f.name}) | {_default(f)} | yes | {tf_cell} |")
    out.append("")
    for f in fields:
        out += [f"## `{f.name}`", "", f"Default: {_default(f)}.", ""]
        if f.name in refused:
            out.append("Runs in PyTorch with every value. TensorFlow and Keras: "
                       + "; ".join(_refusal(c, i) for c, i in refused[f.name])
                       + " (\"runs in hvd_dgc.torch only so far\").")
        else:
            out.append("Runs in PyTorch, TensorFlow and Keras.")
        out.append("")
        if f.name in described:
            text = _markdown(described[f.name])
            out.append(text[:1].upper() + text[1:])
        else:
            within = [n for n, text in described.items() if f"``{f.name}``" in text]
            out.append("No entry of its own in DGCConfig's docstring"
                       + (f"; described under {', '.join(f'[`{n}`](#{n})' for n in within)}."
                          if within else "."))
        out.append("")
    out += [
        "## Arguments that are not hvd_dgc options",
        "",
        "Horovod's own arguments (`named_parameters`, `compression`, "
        "`backward_passes_per_step`, `op`, `process_set`, ...) keep Horovod's meaning; "
        "what `compression=` becomes is in [the README](../README.md#the-one-line-switch). "
        "PyTorch's `dense_compression` and `grad_scaler` are in [pytorch.md](pytorch.md); "
        "`outer` (the outer loop) in [pytorch.md](pytorch.md) and "
        "[tensorflow.md](tensorflow.md); "
        "the Keras optimizer's and callbacks' arguments are in "
        "[tensorflow.md](tensorflow.md).",
    ]
    return "\n".join(out) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {os.path.relpath(PAGE, REPO)}")
    mode.add_argument("--check", action="store_true",
                      help="exit 1 if the page differs from what would be written")
    args = parser.parse_args(argv)
    page = render()
    if args.write:
        os.makedirs(os.path.dirname(PAGE), exist_ok=True)
        with open(PAGE, "w") as out:
            out.write(page)
        return 0
    if args.check:
        try:
            with open(PAGE) as existing:
                same = existing.read() == page
        except FileNotFoundError:
            same = False
        if not same:
            print(f"{os.path.relpath(PAGE, REPO)} is out of date: run {COMMAND}", file=sys.stderr)
        return 0 if same else 1
    sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
