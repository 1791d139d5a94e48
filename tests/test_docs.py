"""The documentation cannot drift from the code or point nowhere: docs/options.md is what
tools/options_doc.py writes from hvd_dgc/config.py, every option has its section, every
relative link of README.md and docs/*.md reaches a file, and README.md stays a front page
that holds the two set-up commands CI runs (.ci/run). Needs only hvd_dgc.config, which
is framework-free (no torch, TensorFlow or Horovod)."""

import dataclasses
import difflib
import glob
import importlib.util
import os
import re

import pytest

from hvd_dgc.config import DGCConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONS_PAGE = os.path.join(REPO, "docs", "options.md")
README = os.path.join(REPO, "README.md")
README_MAX_LINES = 260
SETUP_COMMANDS = ("bash tools/install.sh", "bash tools/test.sh")
REGENERATE = "python tools/options_doc.py --write"


def _generator():
    spec = importlib.util.spec_from_file_location(
        "options_doc", os.path.join(REPO, "tools", "options_doc.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _pages():
    return [README] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


_FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.M)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def relative_links(text):
    """The link targets of a Markdown text that name a file of the repository: inline
    links and images and reference definitions, outside code blocks and code spans,
    less URLs with a scheme (https:, mailto:) and links within the page (#anchor).
    Anchors after '#' are dropped."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", text))
    targets = _INLINE_LINK.findall(text) + _REFERENCE.findall(text)
    out = []
    for target in targets:
        if not target or target.startswith("#") or _SCHEME.match(target):
            continue
        out.append(target.split("#", 1)[0].split("?", 1)[0])
    return out


def broken_links(path):
    """``[(target, why)]`` for the relative links of the file at ``path`` that reach no
    file or directory of the repository."""
    out = []
    for target in relative_links(_read(path)):
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), target))
        if os.path.relpath(resolved, REPO).startswith(os.pardir):
            out.append((target, "outside the repository"))
        elif not os.path.exists(resolved):
            out.append((target, "no such file"))
    return out


def test_options_page_is_what_the_generator_writes():
    page = _read(OPTIONS_PAGE)
    generated = _generator().render()
    if page != generated:
        diff = "".join(list(difflib.unified_diff(
            page.splitlines(True), generated.splitlines(True), "docs/options.md",
            "tools/options_doc.py"))[:40])
        pytest.fail(f"docs/options.md is not what tools/options_doc.py writes from "
                    f"hvd_dgc/config.py; regenerate it: {REGENERATE}\n{diff}")


def test_every_option_has_its_section():
    page = _read(OPTIONS_PAGE)
    missing = [f.name for f in dataclasses.fields(DGCConfig)
               if not re.search(rf"^## `{re.escape(f.name)}`$", page, re.M)]
    assert not missing, (f"docs/options.md has no section for DGCConfig field(s) {missing}; "
                         f"regenerate it: {REGENERATE}")


def test_generator_reads_every_docstring_entry():
    # An entry the parser dropped or mangled would vanish from the page silently.
    described = _generator().attributes(DGCConfig.__doc__)
    names = {f.name for f in dataclasses.fields(DGCConfig)}
    assert described and set(described) <= names, sorted(set(described) - names)
    assert all(text.strip() for text in described.values())


@pytest.mark.parametrize("page", _pages(), ids=lambda p: os.path.relpath(p, REPO))
def test_relative_links_reach_files(page):
    broken = broken_links(page)
    assert not broken, (f"{os.path.relpath(page, REPO)} links to what does not exist: "
                        + "; ".join(f"{target} ({why})" for target, why in broken))


def test_readme_is_a_front_page_with_the_setup_commands():
    text = _read(README)
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): it is the front "
        f"page; move detail to docs/ and link it")
    blocks = "\n".join(m.group(0) for m in _FENCE.finditer(text)).splitlines()
    for command in SETUP_COMMANDS:
        assert any(line.strip().startswith(command) for line in blocks), (
            f"README.md's code blocks lack the set-up command {command!r} (.ci/run runs it)")


@pytest.mark.parametrize("module", ["hvd_dgc.torch", "hvd_dgc.tensorflow",
                                    "hvd_dgc.tensorflow.keras"])
def test_the_option_helpers_the_docs_name_are_in_every_framework_module(module):
    """``cost_model=hvd.CostModel(...)``, ``density=hvd.DensitySchedule(...)`` and
    ``delay=hvd.AutoDelay(...)`` work after any of the one-line imports."""
    mod = importlib.import_module(module)
    for name in ("CostModel", "DensitySchedule", "AutoDelay"):
        assert hasattr(mod, name), f"{module} has no {name}"
