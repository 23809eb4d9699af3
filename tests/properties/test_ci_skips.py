"""Under CI=true a skipped test, or a module skipped as it is collected, fails the run and is named with
its reason, also when xdist's workers ran it; a test that needs a GPU may skip. Without CI=true skips pass
and `-rs` prints why."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import TESTS

SUITE = {
    "pytest.ini": "[pytest]\n",
    "conftest.py": "from ci_skips import register\n\n\ndef pytest_configure(config):\n    register(config)\n",
    "test_several.py": """
import pytest

def test_that_runs():
    pass

def test_without_its_browser():
    pytest.skip("no browser here")

@pytest.mark.skipif(True, reason="needs a GPU: none here")
def test_on_a_gpu():
    pass

@pytest.mark.xfail(reason="a known failure", strict=True)
def test_known_to_fail():
    assert False
""",
    "test_without_its_module.py": 'import pytest\n\npytest.importorskip("a_module_nobody_installed")\n',
}


@pytest.fixture
def suite(tmp_path):
    for name, text in SUITE.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def run_pytest(suite, ci: bool, *arguments: str) -> subprocess.CompletedProcess:
    environment = {name: value for name, value in os.environ.items() if name != "CI"}
    environment["PYTHONPATH"] = TESTS  # where ci_skips is
    if ci:
        environment["CI"] = "true"
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *arguments]
    return subprocess.run(command, cwd=suite, env=environment, capture_output=True, text=True, timeout=120)


def refused_lines(output: str) -> list[str]:
    """The lines of the section that names the skips CI does not allow."""
    _, found, section = output.partition("skipped under CI=true")
    return [line for line in section.splitlines()[1:] if line.startswith("test_")] if found else []


def test_without_ci_a_skip_passes_and_says_why(suite):
    done = run_pytest(suite, False)
    assert done.returncode == 0, done.stdout
    assert "no browser here" in done.stdout and "a_module_nobody_installed" in done.stdout
    assert refused_lines(done.stdout) == []


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist workers"])
def test_under_ci_a_skip_fails_the_run_by_name_but_a_gpus(suite, workers):
    done = run_pytest(suite, True, *workers)
    assert done.returncode == 1, done.stdout
    assert sorted(refused_lines(done.stdout)) == [
        "test_several.py::test_without_its_browser: no browser here",
        "test_without_its_module.py: could not import 'a_module_nobody_installed': No module named "
        "'a_module_nobody_installed'",
    ]
    assert "1 passed, 3 skipped, 1 xfailed" in done.stdout


def test_under_ci_a_gpu_skip_alone_passes(suite):
    done = run_pytest(suite, True, "test_several.py", "-k", "not browser")
    assert done.returncode == 0, done.stdout
    assert "needs a GPU: none here" in done.stdout and refused_lines(done.stdout) == []
