"""What every step function does with its arguments: its options, given as keyword arguments, into the
step's options dataclass; its runner and runner options; the output it writes, held while it writes it."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import numbers
import os
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

from madp.core import output_lock, storage
from madp.core.errors import InputError, OptionError
from madp.core.options import value_type
from madp.spark.session import RUNNER

LOCAL = "local"  # the runner of the in-memory engines, in this process
PYSPARK = RUNNER  # madp's Spark engine (`madp.spark`); any other runner name is a Beam runner's
RUNNER_KEYWORDS = ("runner", "runner_options")  # the keywords of a step function that runs on a runner

Options = TypeVar("Options")


def options_of(
    step: str, options_class: type[Options], options: Mapping[str, Any], keywords: Sequence[str] = ()
) -> Options:
    """`options_class(**options)`, where a keyword that is none of its fields is a TypeError naming it, the
    closest field or other keyword of the step function (`keywords`, such as `runner_options`), and every
    field `step` takes (an options dataclass's own TypeError names only the first unknown keyword, and not
    what was meant)."""
    known = [field.name for field in dataclasses.fields(options_class) if field.init]  # type: ignore[arg-type]
    unknown = sorted(set(options) - set(known))
    if unknown:
        meant = [
            f"{name} (did you mean {close[0]}?)"
            if (close := difflib.get_close_matches(name, [*known, *keywords], 1))
            else name
            for name in unknown
        ]
        raise TypeError(f"{step}() got unknown options: {', '.join(meant)}; its options are {', '.join(known)}")
    return options_class(**_as_parsed(options_class, options))


# What a Python value of each option type must be, as the command line's parser would give it.
_TAKES = {
    int: ((numbers.Integral,), "an integer"),  # numpy's integers too
    float: ((numbers.Real,), "a number"),
    str: ((str,), "a string"),
    bool: ((bool,), "True or False"),
    tuple: ((list, tuple), "a list"),
}


def _as_parsed(options_class: type, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options as the command line's parser gives them, or an `OptionError` naming the first it would
    refuse: an int option takes an integer (not a bool, nor a float: `max_contributions=2.5` reached the
    reports, and a float row limit crashed after the earlier batches were cleared), a float option a number
    (`epsilon=8` is 8.0, so that the files a step writes say what the command's say), a tuple option a list or
    tuple (a string would be taken character by character), and None only where the option may be None."""
    hints = typing.get_type_hints(options_class)
    parsed = dict(options)
    for name, value in options.items():
        kind = value_type(hints[name])
        if kind not in _TAKES:  # not a plain value (e.g. a mapping): the dataclass checks it
            continue
        accepted, said = _TAKES[kind]
        if value is None:
            if type(None) not in typing.get_args(hints[name]):
                raise OptionError(f"{{{name}}} must be {said}, got None")
            continue
        if not isinstance(value, accepted) or (isinstance(value, bool) and kind is not bool):
            raise OptionError(f"{{{name}}} must be {said}, got {{0!r}}", value)
        if kind in (int, float):  # a numpy number as the Python one JSON writes
            parsed[name] = kind(value)
        elif isinstance(value, list):  # a tuple option's list
            parsed[name] = tuple(value)
    return parsed


def refuse_runner_options_locally(runner: str, runner_options: Sequence[str]) -> None:
    """--runner local runs in this process: a runner option (madp's --partitions among them) is a mistake
    to report, not to drop."""
    if runner == LOCAL and runner_options:
        raise InputError(f"--runner local takes no runner options (got {' '.join(runner_options)})")


def input_paths(records: Any) -> list[str]:
    """The paths a step's records are read from, which its output must not overlap: the path given, or
    the files a Spark DataFrame of records reads (none where it was built otherwise)."""
    from madp.spark.dataframe import as_dataframe, input_files

    frame = as_dataframe(records)
    return [records] if frame is None else input_files(frame)


def records_path(records: Any, runner: str) -> str:
    """The path of a step's records on `runner`, not "pyspark": a DataFrame is read on "pyspark" only."""
    from madp.spark.dataframe import as_dataframe

    if as_dataframe(records) is not None:
        raise InputError(f"a DataFrame of records is read with runner={PYSPARK!r}, not runner={runner!r}")
    return str(records)


def cluster_path(path: Any) -> Any:
    """A path as every Spark executor reads it: a local path made absolute (an executor of a cluster runs
    in a folder of its own, where a relative path names another file), a URL or a DataFrame as given."""
    return os.path.abspath(path) if isinstance(path, str) and "://" not in path else path


def beam_arguments(runner: str, runner_options: Sequence[str]) -> list[str]:
    """The argv-style options of a Beam pipeline on `runner` (a Beam runner's name), its `runner_options`."""
    return ["--runner", runner, *runner_options]


@contextlib.contextmanager
def writing(output: str, inputs: Sequence[str | None], step: str) -> Iterator[None]:
    """Hold `output` (its lock) while `step` writes it, as the command line does, once it is known to
    overlap none of the `inputs` (those not None), which a step replacing its output could delete."""
    storage.refuse_overlap(output, [path for path in inputs if path is not None])
    with output_lock.exclusive(output, step):
        yield
