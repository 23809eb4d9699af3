"""runners/Dockerfile, read statically (no Docker here): its base image is Beam's SDK container for the
Python and the Beam release installed with madp, and it installs this package with the workers' extras
(not the training's), so that the image cannot drift from the driver it serves."""

from __future__ import annotations

import ast
import os
import re
import sys

import apache_beam
from conftest import ROOT

DOCKERFILE = os.path.join(ROOT, "runners", "Dockerfile")


def _instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions, (keyword, arguments), continuation lines joined and comments left out."""
    text = re.sub(r"\\\n", " ", open(DOCKERFILE, encoding="utf-8").read())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def _extras() -> dict[str, list[str]]:
    """setup.py's extras_require, read from its source."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no extras_require")


def test_the_base_image_is_beams_sdk_for_the_installed_python_and_beam():
    (base,) = [arguments for keyword, arguments in _instructions() if keyword == "FROM"]
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert base == f"apache/beam_python{python}_sdk:{apache_beam.__version__}"


def test_it_installs_this_package_with_the_workers_extras_only():
    instructions = _instructions()
    (copied,) = [arguments.split() for keyword, arguments in instructions if keyword == "COPY"]
    assert copied[0] == "."  # the repository (the build context)
    (install,) = [arguments for keyword, arguments in instructions if keyword == "RUN" and "pip install" in arguments]
    match = re.search(rf'"?{re.escape(copied[1])}\[([a-z,]+)\]"?', install)
    assert match, install
    extras = match.group(1).split(",")
    assert set(extras) <= set(_extras()) and "train" not in extras
    assert all(requirement.startswith("apache-beam[") for extra in extras for requirement in _extras()[extra])


def test_the_build_context_leaves_out_the_environment_and_the_history():
    ignored = open(os.path.join(ROOT, ".dockerignore"), encoding="utf-8").read().split()
    assert {".git", ".venv"} <= set(ignored)
