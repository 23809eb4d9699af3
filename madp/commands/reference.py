"""The options reference, docs/reference/options.md: every declared option of `madp bound`, `madp batch`
and `madp train` (flag, default, help) with its `madp run` section key, rendered from the declarations.
`python -m madp.commands.reference` writes it again; a test fails while it is stale."""

from __future__ import annotations

import dataclasses
import os

from madp.core.options import CALIBRATE, Declared, declared
from madp.core.records import ColumnOptions
from madp.core.selection import BoundOptions
from madp.engines.batching import BatchOptions
from madp.training.options import TrainOptions

REFERENCE = os.path.join("docs", "reference", "options.md")  # from the repository's root
DECLARATIONS = (("bound", BoundOptions), ("batch", BatchOptions), ("train", TrainOptions))
REGENERATE = "python -m madp.commands.reference"


def options_reference() -> str:
    """The reference as Markdown."""
    columns = ", ".join(f"`{each.flags[0]}`" for each in declared(ColumnOptions))
    lines = [
        "# Options",
        "",
        f"Generated from the options' declarations by `{REGENERATE}`: edit those, not this page.",
        "",
        "A `madp run` section's key is an option's name with underscores (`max_contributions: 3` is",
        "`--max-contributions 3`, `true` a switch). The bound and batch sections also take `runner` and",
        "`beam_options`, the train section `baseline`; a generate section takes `madp generate`'s options",
        "and `holdout`. `madp verify-bound`, `madp verify-batches` and `madp recommend-k` take the record",
        f"columns' options of `madp bound`: {columns}.",
    ]
    for command, declaration in DECLARATIONS:
        lines += ["", f"## madp {command}", "", "| option | `madp run` key | default | help |", "|---|---|---|---|"]
        lines += [_row(command, each) for each in declared(declaration)]
    return "\n".join(lines) + "\n"


def _row(command: str, each: Declared) -> str:
    section = CALIBRATE if each.option.section == CALIBRATE else command
    flags = ", ".join(f"`{flag}`" for flag in each.flags)
    return f"| {flags} | `{section}.{each.name}` | {_default(each)} | {_cell(each.option.help or '')} |"


def _default(each: Declared) -> str:
    if each.default is dataclasses.MISSING:
        return "required"
    if each.switch or each.default in (None, ()):
        return ""
    return f"`{each.default or repr(each.default)}`"  # '' shown as such


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


if __name__ == "__main__":
    os.makedirs(os.path.dirname(REFERENCE), exist_ok=True)
    with open(REFERENCE, "w", encoding="utf-8") as handle:
        handle.write(options_reference())
