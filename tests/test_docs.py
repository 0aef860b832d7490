"""The documentation site (docs/): it builds in strict mode, its internal links resolve, its tutorial snippets run,
and the product text (README, docs, pyproject.toml's comments, the library's docstrings) carries no development
history."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from conftest import PROJECT_ROOT, tiny_run_config

DOCS = PROJECT_ROOT / "docs"


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> Path:
    """The site built with ``sphinx -W --keep-going`` (every warning an error) into a temp folder."""
    pytest.importorskip("sphinx")
    out = tmp_path_factory.mktemp("docs") / "html"
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=PROJECT_ROOT,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out


def test_docs_build_in_strict_mode(built_site):
    for page in (
        "index",
        "tutorials/quickstart",
        "how-to/forget-a-user",
        "explanation/architecture",
        "reference/run-config",
        "reference/api",
    ):
        assert (built_site / f"{page}.html").is_file(), page


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("href", "src") and value:
                self.links.append(value)
            if name == "id" and value:
                self.ids.add(value)


def broken_links(site: Path) -> list[str]:
    """Every relative link (and ``#anchor``) of the built pages that names a missing file or id."""
    pages = {}
    for page in site.rglob("*.html"):
        parser = _Links()
        parser.feed(page.read_text(encoding="utf-8"))
        pages[page.resolve()] = parser
    broken = []
    for page, parser in pages.items():
        if "_modules" in page.parts:  # viewcode's source pages
            continue
        for link in parser.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith("mailto:"):
                continue  # external links are not checked
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{page.relative_to(site.resolve())}: {link}")
            elif parts.fragment and target.suffix == ".html" and parts.fragment not in pages[target].ids:
                broken.append(f"{page.relative_to(site.resolve())}: {link} (no id {parts.fragment!r})")
    return broken


def test_docs_internal_links_resolve(built_site):
    assert broken_links(built_site) == []


def test_the_link_check_finds_a_broken_link(built_site, tmp_path):
    page = tmp_path / "index.html"
    page.write_text('<a href="missing.html">x</a><a href="#nowhere">y</a><a href="https://flower.ai">z</a>')
    assert broken_links(tmp_path) == ["index.html: missing.html", "index.html: #nowhere (no id 'nowhere')"]


def _snippet(page: str, marker: str) -> str:
    text = (DOCS / page).read_text(encoding="utf-8")
    return next(block for block in re.findall(r"```python\n(.*?)```", text, flags=re.S) if marker in block)


def test_the_first_client_tutorial_runs_as_written(tmp_path, monkeypatch):
    """docs/tutorials/first-client.md's client, saved as plugins/my_client.py would be, trains and reports its
    metric in metrics.csv."""
    from fedrec_flwr.serial import run_serial

    (tmp_path / "my_client_tutorial.py").write_text(_snippet("tutorials/first-client.md", "class RowCountClient"))
    monkeypatch.syspath_prepend(str(tmp_path))
    logging.getLogger("flwr").setLevel(logging.WARNING)
    folder = run_serial(tiny_run_config(tmp_path, num_server_rounds=1, client="my_client_tutorial:RowCountClient"))
    header, row = (folder / "metrics.csv").read_text().splitlines()[:2]
    rows_trained = float(row.split(",")[header.split(",").index("rows-trained")])
    assert rows_trained > 0


ORDINAL = "this|last|next|earlier|previous|first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth"
WORK = (
    rf"\b(({ORDINAL})[- ](session|pass)(es)?)\b"  # "the sixth session", "a second pass", "fifth-pass"
    r"|\bissue[- ]?#?[0-9]+"  # "issue 14", "issue-6", "issue #6"
)
HISTORY = re.compile(
    WORK + r"|\bitems? [0-9]+(-[0-9]+)?\b",  # an issue's numbered items: "item 19", "items 9-13"
    re.IGNORECASE,
)
TEST_HISTORY = re.compile(WORK + r"|\bcommit [0-9a-f]{7,40}\b", re.IGNORECASE)  # "commit a7e4b2d"
"""What the tests' text must not name. Not HISTORY's numbered items: in a test "item 44" or "items 0-5" are item ids
of a tiny federation. Commit hashes, which the measurement logs quote as provenance, have no place in a test."""
PRODUCT = (
    "README.md",
    "docs",
    "pyproject.toml",
    "fedrec_flwr",
    "strategies",
    "clients",
    "experiments",
    "scripts",
    "plugins",
)
TESTS = ("tests",)
CHECKER = Path("tests") / "test_docs.py"
"""Left out of the tests' check: it holds the patterns and the checker's own test data, which must spell out the
mentions they catch. Skipping the one file keeps that data readable, instead of marking or disguising each line."""


def history_mentions(
    root: Path, folders: tuple[str, ...] = PRODUCT, pattern: re.Pattern = HISTORY, skip: tuple[Path, ...] = ()
) -> list[str]:
    """``path:line: text`` of every line under ``folders`` (the product text by default) that names a piece of
    development work, as ``pattern`` recognises it; ``skip`` lists files (relative to ``root``) not read."""
    found = []
    for name in folders:
        base = root / name
        files = (
            [base]
            if base.is_file()
            else sorted(
                p
                for p in base.rglob("*")
                if p.is_file()
                and p.suffix in (".py", ".md", ".toml", ".txt", ".rst", ".sh")
                and "_build" not in p.parts
            )
        )
        for path in files:
            if path.relative_to(root) in skip:
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                if pattern.search(line):
                    found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_the_product_text_carries_no_development_history():
    """README, docs, pyproject.toml, the library and the tests say what the code does, not in which piece of work it
    changed (that is CHANGELOG.md's); the README and the tests quote no commit hash."""
    assert history_mentions(PROJECT_ROOT) == []
    assert history_mentions(PROJECT_ROOT, TESTS, TEST_HISTORY, skip=(CHECKER,)) == []
    readme = (PROJECT_ROOT / "README.md").read_text(encoding="utf-8")
    assert re.findall(r"\bcommit [0-9a-f]{7,40}\b", readme, flags=re.I) == []
    assert "## [" in (PROJECT_ROOT / "CHANGELOG.md").read_text(encoding="utf-8")  # Keep a Changelog versions


def test_the_history_check_finds_a_mention(tmp_path):
    (tmp_path / "fedrec_flwr").mkdir()
    (tmp_path / "fedrec_flwr" / "x.py").write_text('"""Chosen in the fifth pass (issue 14)."""\n')
    assert history_mentions(tmp_path) == ['fedrec_flwr/x.py:1: """Chosen in the fifth pass (issue 14)."""']
    (tmp_path / "experiments" / "results").mkdir(parents=True)
    (tmp_path / "experiments" / "results" / "m.md").write_text("the issue-6 arm\nitem 19 of the list\n")
    (tmp_path / "fedrec_flwr" / "y.py").write_text("os.setsid()  # a session of its own\n")
    assert history_mentions(tmp_path) == [
        'fedrec_flwr/x.py:1: """Chosen in the fifth pass (issue 14)."""',
        "experiments/results/m.md:1: the issue-6 arm",
        "experiments/results/m.md:2: item 19 of the list",
    ]


def test_the_tests_history_check_allows_item_ids_and_skips_the_checker(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text('"""Fake users rate item 44 (issue 18, commit a7e4b2d)."""\n')
    (tmp_path / "tests" / "test_docs.py").write_text('"""the sixth session"""\n')
    assert history_mentions(tmp_path, TESTS, TEST_HISTORY, skip=(CHECKER,)) == [
        'tests/test_x.py:1: """Fake users rate item 44 (issue 18, commit a7e4b2d)."""'
    ]
    (tmp_path / "tests" / "test_x.py").write_text('"""Fake users rate item 44 first; items 0-2 are fillers."""\n')
    assert history_mentions(tmp_path, TESTS, TEST_HISTORY, skip=(CHECKER,)) == []


def test_readme_and_experiment_pages_stay_short():
    assert len((PROJECT_ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 250
    for page in sorted((PROJECT_ROOT / "experiments").glob("*/README.md")):
        assert len(page.read_text(encoding="utf-8").splitlines()) <= 200, page


def readme_broken_links(root: Path) -> list[str]:
    """Relative links of README.md and the experiment pages that name no file of the checkout."""
    broken = []
    for page in [root / "README.md", *sorted((root / "experiments").glob("*/README.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(root)}: {target}")
    return broken


def test_readme_and_experiment_page_links_resolve(tmp_path):
    assert readme_broken_links(PROJECT_ROOT) == []
    (tmp_path / "experiments").mkdir()
    (tmp_path / "README.md").write_text("[a](docs/missing.md) [b](https://flower.ai) [c](README.md#top)\n")
    assert readme_broken_links(tmp_path) == ["README.md: docs/missing.md"]
