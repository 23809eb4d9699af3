"""The generated reference pages (docs/reference/, `madp.jobs.reference.pages`): each as the declarations
render it now, every command, option, config section, error and exported name on them."""

from __future__ import annotations

import ast
import dataclasses
import glob
import importlib
import os

import pytest
from conftest import ROOT

from madp.cli import parser
from madp.core.errors import InputError
from madp.jobs.reference import (
    API_PACKAGES,
    API_REFERENCE,
    CONFIG_REFERENCE,
    ERROR_MODULES,
    ERRORS_REFERENCE,
    REFERENCE,
    REGENERATE,
    SECTION_DECLARATIONS,
    pages,
)
from madp.jobs.run_config import SECTIONS, RunConfig

pytestmark = pytest.mark.docs


@pytest.fixture(scope="module")
def generated():
    return pages(parser())


def written(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        return handle.read()


@pytest.mark.parametrize("path", list(pages(parser())))
def test_a_generated_page_is_up_to_date(generated, path):
    assert written(path) == generated[path], f"{path} is stale: run `{REGENERATE}` from the repository's root"


def test_every_command_and_each_of_its_options_is_in_the_options_reference(generated):
    page = generated[REFERENCE]
    for name, command in parser().commands.items():
        assert f"\n## madp {name}\n" in page
        section = page[page.index(f"\n## madp {name}\n") :]
        for action in command._actions:
            for flag in action.option_strings:
                assert f"`{flag}`" in section.split("\n## ")[1], f"madp {name} {flag}"


def test_every_exported_name_is_in_the_api_reference(generated):
    page = generated[API_REFERENCE]
    for package, _ in API_PACKAGES:
        section = page[page.index(f"\n## {package}\n") :].split("\n## ")[1]
        for name in importlib.import_module(package).__all__:
            assert f":: {name}\n" in section, f"{package}.{name}"


def test_every_config_key_is_in_the_config_reference(generated):
    page = generated[CONFIG_REFERENCE]
    assert [field.name for field in dataclasses.fields(RunConfig)] == list(SECTIONS)
    for name in SECTIONS:
        assert f"`{name}`" in page
    assert {name for name in SECTIONS if name in SECTION_DECLARATIONS} == {
        "generate",
        "bound",
        "batch",
        "calibrate",
        "train",
        "audit",
    }
    for key in ("runner", "runner_options", "holdout", "baseline", "max_contributions", "epsilon", "canaries"):
        assert f"| `{key}` |" in page, key


def test_every_error_class_madp_defines_is_in_the_errors_reference(generated):
    """An error class defined in any madp module (read from the sources) lies in one of ERROR_MODULES."""
    page = generated[ERRORS_REFERENCE]
    known = {"InputError", "ValueError"}
    defined: dict[str, str] = {}
    files = glob.glob(os.path.join(ROOT, "madp", "**", "*.py"), recursive=True)
    for path in files:
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.ClassDef):
                defined[node.name] = os.path.relpath(path, ROOT)
                for base in node.bases:
                    if isinstance(base, ast.Name) and base.id in known | {"InputError"}:
                        known.add(node.name)
    errors = {name for name in known if name in defined and name != "InputError"} | {InputError.__name__}
    for name in errors:
        assert f".{name}\n" in page, f"{name} ({defined.get(name)}): add its module to ERROR_MODULES"
    assert ERROR_MODULES
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 130 |"):
        assert code in page
