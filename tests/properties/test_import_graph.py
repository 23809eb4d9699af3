"""The layers of the code: every import (at module level or inside a function) points to the same
layer or one below, and no module imports itself back through others. Read from the sources, so a
lazy import counts as much as one at the top."""

from __future__ import annotations

import ast
import os
import sys

from conftest import ROOT

# Bottom to top, one folder (or package) per layer; a module belongs to the first layer naming it or
# a package holding it ("madp" names only the package itself). The package's __init__ exports the step
# functions of madp.stages (it imports them on first use, inside its __getattr__, which the graph reads
# like any import), so it sits in their layer: a module below may not import `madp` itself.
LAYERS = (
    (
        "core (madp/core): errors, records, storage, the output lock, hashing, kernels, file formats, verifiers",
        ("madp.core",),
    ),
    ("accounting (madp.accounting: accounting/)", ("madp.accounting",)),
    (
        "engines and training (madp/engines, madp.beam: beam_pipelines/, madp/spark, madp.training: tf_training/)",
        ("madp.engines", "madp.beam", "madp.spark", "madp.training"),
    ),
    (
        "tools (madp/tools): data/ (generators, import), planning/ (recommend-k, feasibility, audit options), report",
        ("madp.tools",),
    ),
    (
        "stages (madp/stages): a function per step, the Python API; the madp package, which exports them",
        ("madp", "madp.stages"),
    ),
    ("commands (madp/commands)", ("madp.commands",)),
    ("jobs (madp/jobs)", ("madp.jobs",)),
    ("command line", ("madp.cli",)),
)


def modules() -> dict[str, str]:
    """Every module of the package, by dotted name, to its file (madp.accounting, madp.beam and
    madp.training through madp's links to their folders)."""
    found = {}
    for directory, _, files in os.walk(os.path.join(ROOT, "madp"), followlinks=True):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                dotted = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def imports(path: str, known: dict[str, str]) -> set[str]:
    """The project modules a file imports (`from a import b` is a.b where that is a module, else a)."""
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module)
    return {name for name in found if name in known}


def layer_of(module: str) -> int:
    """A member names a module, or a package and all it holds ("madp" only the package itself)."""
    for index, (_, members) in enumerate(LAYERS):
        if any(module == m or (m != "madp" and module.startswith(m + ".")) for m in members):
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def graph() -> dict[str, set[str]]:
    known = modules()
    return {module: imports(path, known) - {module} for module, path in known.items()}


def test_every_import_points_down_or_sideways():
    upward = [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for module, targets in sorted(graph().items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    edges = graph()
    state: dict[str, str] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        path.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, path)
        path.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [])
    assert not cycles, "\n".join(cycles)


def test_the_verifiers_share_no_code_with_the_producers():
    """The verifiers' modules import only each other among madp's, and besides the standard library only
    pyarrow and protobuf (to read Parquet and tf.train.Example rows) and google_crc32c (TFRecord checksums)."""
    known, edges = modules(), graph()
    verifiers = {module for module in known if module == "madp.core.verify" or module.startswith("madp.core.verify.")}
    assert len(verifiers) > 1
    for module in sorted(verifiers):
        assert edges[module] <= verifiers, module
        tree = ast.parse(open(known[module], encoding="utf-8").read())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        outside = {name.split(".")[0] for name in imported} - set(sys.stdlib_module_names) - {"__future__"}
        assert outside <= {"madp", "pyarrow", "google", "google_crc32c"}, (module, outside)


def test_the_graph_is_read_from_real_imports():
    edges = graph()
    assert "madp.commands.registry" in edges["madp.cli"] and "madp.accounting.calibrate" in edges["madp.training.plan"]
    assert "madp.beam.monte_carlo" in edges["madp.commands.accounting"]  # a lazy import inside a function
    assert "madp.stages" in edges["madp"]  # the package's exports, imported in its __getattr__


def test_training_imports_no_engine():
    """madp.training runs on the batch files alone: it reads them, the batch report and the selection files
    from the core's formats, never from an engine (sideways in the layers, but Beam or a batching's
    internals are nothing a training needs)."""
    edges = graph()
    engines = ("madp.engines", "madp.beam", "madp.spark")
    found = [
        f"{module} imports {target}"
        for module, targets in sorted(edges.items())
        if module == "madp.training" or module.startswith("madp.training.")
        for target in sorted(targets)
        if any(target == e or target.startswith(e + ".") for e in engines)
    ]
    assert not found, "\n".join(found)


def test_each_madp_module_lives_in_the_folder_of_its_layer():
    loose = [
        module
        for module, path in modules().items()
        if module.count(".") == 1 and module.startswith("madp.") and module != "madp.cli" and "__init__" not in path
    ]
    assert not loose, f"put {loose} in madp/core, engines, tools, commands or jobs"
