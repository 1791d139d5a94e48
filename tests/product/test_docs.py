"""The documentation cannot drift from the code or point nowhere: docs/options.md is what
tools/options_doc.py writes from hvd_dgc/config.py, every option has its section, every
relative link of README.md, docs/*.md and CHANGELOG.md reaches a file, and README.md stays
a front page: short (lines, words, line length), the two set-up commands CI runs
(.ci/run), one speed table of a few short rows each linking its results under
bench/results/, a picture that exists, and the multi-host horovodrun command. README.md
and docs/*.md say what is true now: no dates, numbered stops, issue numbers or "was X,
now Y" (CHANGELOG.md is the dated history: it may hold dates and "was/now", not stops or
issue numbers; bench/results/ holds the run records and is not checked). Needs only
hvd_dgc.config, which is framework-free (no torch, TensorFlow or Horovod)."""

import dataclasses
import difflib
import glob
import importlib.util
import os
import re

import pytest

from hvd_dgc.config import DGCConfig

from harness.hvdrun import REPO
OPTIONS_PAGE = os.path.join(REPO, "docs", "options.md")
README = os.path.join(REPO, "README.md")
CHANGELOG = os.path.join(REPO, "CHANGELOG.md")
README_MAX_LINES = 150
# Words: every whitespace-separated token of the whole file, code blocks included (the
# stricter count: a front page is read whole).
README_MAX_WORDS = 1500
README_MAX_LINE_CHARS = 300
SPEED_SECTION = "Will it speed me up?"
SPEED_TABLE_MAX_ROWS = 8
SPEED_CELL_MAX_WORDS = 25
RESULTS_DIR = "bench/results/"
SETUP_COMMANDS = ("bash tools/install.sh", "bash tools/test.sh")
# horovodrun -np 8 -H host1:4,host2:4 --config-file horovodrun_configs/cheap_1gbe.yaml ...
MULTI_HOST = re.compile(r"horovodrun\s+-np\s+\d+\s+-H\s+[\w.-]+:\d+(?:,[\w.-]+:\d+)+\s+"
                        r"--config-file\s+(horovodrun_configs/[\w.-]+\.yaml)\s+python\s+\S+")
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


def _docs():
    return sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


def _pages():
    """README.md, docs/*.md and CHANGELOG.md where it exists: every page whose links are
    checked."""
    return [README] + _docs() + ([CHANGELOG] if os.path.exists(CHANGELOG) else [])


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


def _without_code(text):
    """``text`` with its fenced code blocks and code spans blanked, line numbers kept."""
    text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return _CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def _section(text, heading):
    """The lines under the level-2 heading ``heading``, up to the next level-2 heading."""
    match = re.search(rf"^## {re.escape(heading)}[ \t]*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    return match.group(1) if match else None


def _cells(line):
    line = line.strip()
    if line.startswith("|"):
        line = line[1:]
    if line.endswith("|") and not line.endswith("\\|"):
        line = line[:-1]
    return [c.strip() for c in re.split(r"(?<!\\)\|", line)]


def first_table(text):
    """``(header, rows)`` of the first Markdown pipe table in ``text``, cells stripped;
    ``None`` where there is none."""
    lines = text.splitlines()
    for i in range(len(lines) - 1):
        if (lines[i].lstrip().startswith("|")
                and re.fullmatch(r"\s*\|?(\s*:?-+:?\s*\|)+\s*:?-*:?\s*", lines[i + 1])):
            rows = []
            for line in lines[i + 2:]:
                if not line.lstrip().startswith("|"):
                    break
                rows.append(_cells(line))
            return _cells(lines[i]), rows
    return None


_REF_USE = re.compile(r"\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\[([^\]]*)\]")
_INLINE_USE = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]*)>?[^)]*\)")


def reference_definitions(text):
    """``{label (lower case): target}`` of a Markdown text's reference definitions."""
    return {m.group(1).strip().lower(): m.group(2)
            for m in re.finditer(r"^ {0,3}\[([^\]]+)\]:\s*<?(\S+?)>?(?:\s.*)?$", text, re.M)}


def cell_links(cell, definitions):
    """The targets a table cell links to: inline links and reference links (``[text][ref]``,
    ``[ref][]``) resolved through ``definitions``."""
    targets = [m.group(2) for m in _INLINE_USE.finditer(cell)]
    for m in _REF_USE.finditer(cell):
        label = (m.group(2) or m.group(1)).strip().lower()
        if label in definitions:
            targets.append(definitions[label])
    return targets


def cell_words(cell):
    """The words a reader reads in a table cell: link targets dropped, link texts kept."""
    text = _INLINE_USE.sub(lambda m: m.group(1), cell)
    text = _REF_USE.sub(lambda m: m.group(1), text)
    return text.split()


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


def test_readme_is_short_in_words_and_lines():
    text = _read(README)
    words = len(text.split())
    assert words <= README_MAX_WORDS, (
        f"README.md has {words} words, code blocks included (at most {README_MAX_WORDS}): "
        f"move detail to docs/ and link it")
    long_lines = [(n, len(line)) for n, line in enumerate(text.splitlines(), 1)
                  if len(line) > README_MAX_LINE_CHARS]
    assert not long_lines, (
        f"README.md lines over {README_MAX_LINE_CHARS} characters (line, length): "
        f"{long_lines}")


def test_readme_speed_table_is_short_and_links_its_results():
    text = _read(README)
    section = _section(text, SPEED_SECTION)
    assert section is not None, f"README.md has no section '## {SPEED_SECTION}'"
    assert "+ = worse than Horovod" in section, (
        "the speed section must say its sign convention once: '+ = worse than Horovod'")
    table = first_table(section)
    assert table is not None, f"README.md's '{SPEED_SECTION}' section has no table"
    header, rows = table
    assert 1 <= len(rows) <= SPEED_TABLE_MAX_ROWS, (
        f"the speed table has {len(rows)} rows (1 to {SPEED_TABLE_MAX_ROWS}): one per link "
        f"and model family")
    definitions = reference_definitions(text)
    for row in rows:
        assert len(row) == len(header), f"row {row[0]!r}: {len(row)} cells, header {len(header)}"
        for cell in row:
            words = len(cell_words(cell))
            assert words <= SPEED_CELL_MAX_WORDS, (
                f"speed table cell of {words} words (at most {SPEED_CELL_MAX_WORDS}) in row "
                f"{row[0]!r}: {cell!r}")
        targets = [t for cell in row for t in cell_links(cell, definitions)]
        results = [t for t in targets if os.path.normpath(t).startswith(
            os.path.normpath(RESULTS_DIR) + os.sep)]
        assert results, (f"speed table row {row[0]!r} links no results page under "
                         f"{RESULTS_DIR} (links: {targets})")
        for target in results:
            path = os.path.join(REPO, target.split("#", 1)[0])
            assert os.path.isfile(path), f"row {row[0]!r} links {target}, which does not exist"


def test_readme_shows_a_picture_that_exists():
    text = _without_code(_read(README))
    images = re.findall(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)", text)
    images += [reference_definitions(text).get((m.group(2) or m.group(1)).lower(), "")
               for m in re.finditer(r"!\[([^\]]*)\]\[([^\]]*)\]", text)]
    local = [i for i in images if i and not _SCHEME.match(i)]
    assert local, "README.md shows no picture (![...](path) of a file in the repository)"
    for image in local:
        path = os.path.join(REPO, image)
        assert os.path.isfile(path) and os.path.getsize(path) > 0, (
            f"README.md shows {image}, which does not exist or is empty")


def test_readme_has_the_multi_host_horovodrun_command():
    text = _read(README)
    blocks = "\n".join(m.group(0) for m in _FENCE.finditer(text))
    commands = MULTI_HOST.findall(blocks)
    assert commands, ("README.md's code blocks lack a multi-host command of the form "
                      "'horovodrun -np 8 -H host1:4,host2:4 --config-file "
                      "horovodrun_configs/X.yaml python train.py'")
    for config in commands:
        assert os.path.isfile(os.path.join(REPO, config)), f"README.md names {config}: no such file"


# What a page that says what is true now does not hold. Dates are looked for everywhere
# (code blocks too); the others outside code blocks and code spans (a flag or a path may
# hold such words).
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# "stop 49", not "stops 3 steps later".
NUMBERED_STOP = re.compile(
    r"\bstops? \d+\b(?!\s*(?:steps?|ms|s|seconds?|minutes?|epochs?|times|%)(?:\W|$))", re.I)
ISSUE_NUMBER = re.compile(r"\bissues? #?\d+\b|(?<![\w&/])#\d+\b", re.I)
# "was X, now Y" (in either order), "0.70x, now 1.19x" and the diary's "(was X)".
WAS_NOW = re.compile(r"\(was\b|\bwas\b[^.;:()\n]{0,60},\s*now\b|\bnow\b[^.;:()\n]{0,60}\(was\b"
                     r"|\d(?:[\d.]*\d)?x?,\s*now\s+[\d.]", re.I)


def pattern_hits(text, pattern, skip_code=True, limit=8):
    """``["line N: excerpt", ...]`` for the matches of ``pattern`` in ``text``."""
    scanned = _without_code(text) if skip_code else text
    lines = text.splitlines()
    hits = []
    for m in pattern.finditer(scanned):
        n = scanned.count("\n", 0, m.start())
        line = lines[n] if n < len(lines) else ""
        col = m.start() - (scanned.rfind("\n", 0, m.start()) + 1)
        hits.append(f"line {n + 1}: ...{line[max(0, col - 30):col + 50]}...")
    return hits[:limit] + ([f"and {len(hits) - limit} more"] if len(hits) > limit else [])


_NOW_PAGES = [README] + _docs()
_IDS = lambda p: os.path.relpath(p, REPO)  # noqa: E731


def _assert_none(page, pattern, what, skip_code=True):
    hits = pattern_hits(_read(page), pattern, skip_code)
    assert not hits, (f"{os.path.relpath(page, REPO)} holds {what}: say what is true now "
                      f"(history goes to CHANGELOG.md, run records to bench/results/): "
                      + "; ".join(hits))


@pytest.mark.parametrize("page", _NOW_PAGES, ids=_IDS)
def test_no_dates(page):
    _assert_none(page, DATE, "dates", skip_code=False)


@pytest.mark.parametrize("page", _pages(), ids=_IDS)
def test_no_numbered_stops(page):
    _assert_none(page, NUMBERED_STOP, "numbered stops ('stop N')")


@pytest.mark.parametrize("page", _pages(), ids=_IDS)
def test_no_issue_numbers(page):
    _assert_none(page, ISSUE_NUMBER, "issue numbers ('issue N', '#N')")


@pytest.mark.parametrize("page", _NOW_PAGES, ids=_IDS)
def test_no_was_now_history(page):
    _assert_none(page, WAS_NOW, "'was X, now Y' history")


def test_the_page_checks_find_what_they_look_for():
    """The patterns catch a diary's lines and pass a user's."""
    diary = ("On 2026-11-28 the suite took 37 min.\nAt stop 49 we fixed it (issue 32, #17).\n"
             "Keras 0.70x, now 1.19x; the step 1.06x (was 2.18x); it was 8.4, now 2.9.")
    assert len(pattern_hits(diary, DATE)) == 1
    assert len(pattern_hits(diary, NUMBERED_STOP)) == 1
    assert len(pattern_hits(diary, ISSUE_NUMBER)) == 2
    assert len(pattern_hits(diary, WAS_NOW)) == 3
    user = ("Stops 3 steps after the change? No: `--stop 5` is a flag. The warm-up was "
            "chosen so that a short run keeps 25%. Now the link is measured at wrap time. "
            "See [the section](#the-one-line-switch) and `#1f77b4`.")
    for pattern in (DATE, NUMBERED_STOP, ISSUE_NUMBER, WAS_NOW):
        assert not pattern_hits(user, pattern), (pattern.pattern, pattern_hits(user, pattern))


def test_the_table_reader_reads_cells_words_and_links():
    text = ("| a | b |\n| --- | --- |\n| one two | [speed][ns], [x](bench/results/y.md) |\n"
            "\n[ns]: bench/results/never_slower.md\n")
    header, rows = first_table(text)
    assert header == ["a", "b"] and rows == [["one two", "[speed][ns], [x](bench/results/y.md)"]]
    assert cell_words(rows[0][1]) == ["speed,", "x"]
    assert cell_links(rows[0][1], reference_definitions(text)) == [
        "bench/results/y.md", "bench/results/never_slower.md"]


@pytest.mark.parametrize("module", ["hvd_dgc.torch", "hvd_dgc.tensorflow",
                                    "hvd_dgc.tensorflow.keras"])
def test_the_option_helpers_the_docs_name_are_in_every_framework_module(module):
    """``cost_model=hvd.CostModel(...)``, ``density=hvd.DensitySchedule(...)`` and
    ``delay=hvd.AutoDelay(...)`` work after any of the one-line imports."""
    mod = importlib.import_module(module)
    for name in ("CostModel", "DensitySchedule", "AutoDelay"):
        assert hasattr(mod, name), f"{module} has no {name}"
