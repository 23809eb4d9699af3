"""What every step function does with its arguments: its options, given as keyword arguments, into the
step's options dataclass; its runner and Beam options; the output it writes, held while it writes it."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

from madp.core import storage
from madp.core.errors import InputError
from madp.core.options import value_type

LOCAL = "local"  # the runner of the in-memory engines, in this process; any other name is a Beam runner's

Options = TypeVar("Options")


def options_of(step: str, options_class: type[Options], options: Mapping[str, Any]) -> Options:
    """`options_class(**options)`, where a keyword that is none of its fields is a TypeError naming it, the
    closest field, and every field `step` takes (an options dataclass's own TypeError names only the first
    unknown keyword, and not what was meant)."""
    known = [field.name for field in dataclasses.fields(options_class) if field.init]  # type: ignore[arg-type]
    unknown = sorted(set(options) - set(known))
    if unknown:
        meant = [
            f"{name} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(name, known, 1)) else name
            for name in unknown
        ]
        raise TypeError(f"{step}() got unknown options: {', '.join(meant)}; its options are {', '.join(known)}")
    return options_class(**_as_parsed(options_class, options))


def _as_parsed(options_class: type, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options as the command line's parser gives them: an int for a float option is a float (`epsilon=8`
    is 8.0, so that the files a step writes say what the command's say) and a list for a tuple one a tuple."""
    hints = typing.get_type_hints(options_class)
    parsed = dict(options)
    for name, value in options.items():
        kind = value_type(hints[name])
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            parsed[name] = float(value)
        elif kind is tuple and isinstance(value, list):
            parsed[name] = tuple(value)
    return parsed


def refuse_beam_options_locally(runner: str, beam_options: Sequence[str]) -> None:
    """--runner local runs in this process: a Beam option (madp's --partitions among them) is a mistake
    to report, not to drop."""
    if runner == LOCAL and beam_options:
        raise InputError(f"--runner local takes no Beam options (got {' '.join(beam_options)})")


def beam_arguments(runner: str, beam_options: Sequence[str]) -> list[str]:
    """The argv-style options of a Beam pipeline on `runner` (not `LOCAL`)."""
    return ["--runner", runner, *beam_options]


@contextlib.contextmanager
def writing(output: str, inputs: Sequence[str | None], step: str) -> Iterator[None]:
    """Hold `output` (its lock) while `step` writes it, as the command line does, once it is known to
    overlap none of the `inputs` (those not None), which a step replacing its output could delete."""
    storage.refuse_overlap(output, [path for path in inputs if path is not None])
    with storage.exclusive(output, step):
        yield
