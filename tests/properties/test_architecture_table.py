"""ARCHITECTURE.md's "Where things live" table against the layers of test_import_graph.LAYERS: every module
of the package is named in a row of its own layer, and every module a row names exists. A package's
`__init__.py` (its docstring and exports) need not be named.

A row names files in backticks: a path (`madp/core/bounding.py`, `beam_pipelines/bound.py`) or a folder
(`madp/core/verify/`) sets the folder that a bare name after it in the same row (`bound_build.py`) lies in."""

from __future__ import annotations

import os
import re

from conftest import ROOT
from test_import_graph import LAYERS, layer_of, modules

TABLE_HEADING = "## Where things live"
# Each row's first cell, to the layer it describes (the start of its LAYERS label, before " (").
ROW_LAYERS = {
    "kernels (numpy, no I/O)": "core",
    "records and files": "core",
    "verifiers": "core",
    "accounting": "accounting",
    "engines": "engines and training",
    "training": "engines and training",
    "tools": "tools",
    "stages": "stages",
    "commands": "commands",
    "jobs": "jobs",
    "command line": "command line",
}
# The repository's folders that are packages under other names (madp's links to them).
FOLDER_PACKAGES = {"accounting": "madp.accounting", "beam_pipelines": "madp.beam", "tf_training": "madp.training"}


def table_rows() -> dict[str, str]:
    """The table's rows, in order: the first cell to the second (the modules)."""
    with open(os.path.join(ROOT, "ARCHITECTURE.md"), encoding="utf-8") as handle:
        text = handle.read()
    section = text[text.index(TABLE_HEADING) :].split("\n\n")[1]  # the table, the section's first paragraph
    rows = {}
    for line in section.splitlines()[2:]:  # after the header and its rule
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        assert len(cells) == 3, f"a row of three cells (layer, modules, job): {line[:80]}"
        rows[cells[0]] = cells[1]
    return rows


def named_files(cell: str) -> list[str]:
    """The repository paths of the .py files a row's modules cell names, in order."""
    folder, found = "", []
    for name in re.findall(r"`([^`\s]+)`", cell):
        if name.endswith("/"):
            folder = name
        elif name.endswith(".py"):
            if "/" in name:
                folder = os.path.dirname(name) + "/"
                found.append(name)
            else:
                assert folder, f"`{name}` follows no folder in its row"
                found.append(folder + name)
    return found


def module_of(path: str) -> str:
    """The dotted module name of a repository path (madp/core/verify/bound.py: madp.core.verify.bound)."""
    top, _, rest = path.partition("/")
    dotted = FOLDER_PACKAGES.get(top, top) + "." + rest[: -len(".py")].replace("/", ".")
    return dotted.removesuffix(".__init__")


def layer_named(name: str) -> int:
    (index,) = [i for i, (label, _) in enumerate(LAYERS) if label == name or label.startswith(name + " (")]
    return index


def test_each_row_describes_a_layer_bottom_to_top():
    rows = list(table_rows())
    assert sorted(rows) == sorted(ROW_LAYERS), "map each row of the table to its layer in ROW_LAYERS"
    layers = [layer_named(ROW_LAYERS[row]) for row in rows]
    assert layers == sorted(layers), f"the rows run bottom to top, as the layers do: {rows}"


def test_every_module_a_row_names_exists_and_is_of_the_rows_layer():
    known = modules()
    wrong = []
    for row, cell in table_rows().items():
        for path in named_files(cell):
            module = module_of(path)
            if not os.path.isfile(os.path.join(ROOT, path)) or module not in known:
                wrong.append(f"{row}: {path} is no module")
            elif layer_of(module) != layer_named(ROW_LAYERS[row]):
                wrong.append(f"{row}: {path} is of the layer {LAYERS[layer_of(module)][0]!r}")
    assert not wrong, "\n".join(wrong)


def test_every_module_is_named_in_the_table():
    named = {module_of(path) for cell in table_rows().values() for path in named_files(cell)}
    packages = {module for module, path in modules().items() if path.endswith("__init__.py")}
    missing = sorted(set(modules()) - packages - named)
    assert not missing, f"ARCHITECTURE.md's {TABLE_HEADING!r} table names no row for {missing}"


def test_a_row_is_read_by_its_paths_and_folders():
    cell = "`madp/core/verify/` (`records.py`: rows; `BoundReport`), `beam_pipelines/bound.py`, `bound_build.py`"
    paths = named_files(cell)
    assert paths == ["madp/core/verify/records.py", "beam_pipelines/bound.py", "beam_pipelines/bound_build.py"]
    assert [module_of(p) for p in paths] == ["madp.core.verify.records", "madp.beam.bound", "madp.beam.bound_build"]
    assert module_of("madp/__init__.py") == "madp"
