"""The documentation site builds as `make docs` builds it (warnings as errors, every reference resolved),
and its search works offline: the index the build writes finds a command."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from madp.cli import parser
from madp.jobs.reference import API_PACKAGES

pytestmark = pytest.mark.docs


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built into a temporary directory, as the Makefile's docs target builds it."""
    output = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html", "docs", str(output)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-5000:]  # -W: a warning fails it
    return output


@pytest.mark.slow
def test_the_site_builds_without_a_warning(site):
    assert os.path.isfile(site / "index.html")


@pytest.mark.slow
def test_the_search_index_finds_a_command_offline(site):
    output = site
    with open(output / "searchindex.js", encoding="utf-8") as handle:
        text = handle.read()
    index = json.loads(text[text.index("(") + 1 : text.rindex(")")])  # Search.setIndex({...})
    pages = set()
    for terms in (index["terms"], index["titleterms"]):  # the search looks up a word in both
        found = terms.get("recommend", [])  # the pages a (stemmed) word is on: a page's number, or a list
        pages |= {index["docnames"][page] for page in (found if isinstance(found, list) else [found])}
    assert "reference/options" in pages  # the heading of `madp recommend-k`
    assert os.path.isfile(output / "search.html")


@pytest.mark.slow
def test_every_exported_name_and_command_is_on_the_built_site(site):
    output = site
    api = (output / "reference" / "api.html").read_text(encoding="utf-8")
    for package, _ in API_PACKAGES:
        for name in importlib.import_module(package).__all__:
            assert f'id="{package}.{name}"' in api, f"{package}.{name} has no entry in the API reference"
    options = (output / "reference" / "options.html").read_text(encoding="utf-8")
    for command in parser().commands:
        assert f'id="madp-{command}"' in options, f"madp {command} has no section in the options reference"
