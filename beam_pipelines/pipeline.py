"""What our Beam pipelines share: their options, running one with clear input errors, its counters,
and the small helpers of joining partitions with messages."""

from __future__ import annotations

import argparse
import re

import apache_beam as beam
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import (
    DirectOptions,
    PipelineOptions,
    StandardOptions,
    TypeOptions,
    WorkerOptions,
)

from madp.core import records as rec
from madp.core.errors import InputError


def unknown_beam_args(beam_args: list[str]) -> list[str]:
    """The flags among `beam_args` that no Beam pipeline option defines (Beam would drop them silently)."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    seen, classes = set(), [PipelineOptions]
    while classes:
        cls = classes.pop()
        if cls not in seen:
            seen.add(cls)
            classes.extend(cls.__subclasses__())
            if "_add_argparse_args" in vars(cls):
                try:
                    cls._add_argparse_args(parser)  # type: ignore[arg-type]  # Beam's wrapper of this parser
                except argparse.ArgumentError:
                    pass  # an option two classes define: the first one suffices here
    _, unknown = parser.parse_known_args(beam_args)
    return [arg for arg in unknown if arg.startswith("-")]


def pipeline_options(beam_args: list[str]) -> PipelineOptions:
    """The user's Beam options, with our defaults where the user set none; a flag that is neither a
    madp option nor a Beam option (a typo such as --min_sep) is an error, not silently dropped."""
    unknown = unknown_beam_args(beam_args)
    if unknown:
        raise InputError(
            f"unrecognized option(s) {' '.join(unknown)}: neither an option of this command "
            f"nor a Beam pipeline option (check the spelling: madp options use dashes)"
        )
    options = PipelineOptions(beam_args)
    explicit = options.get_all_options(drop_default=True)
    if "pipeline_type_check" not in explicit:
        # Hundreds of transforms: introspecting each one's type hints costs seconds per run.
        options.view_as(TypeOptions).pipeline_type_check = False
    if options.view_as(StandardOptions).runner in (None, "DirectRunner"):
        options.view_as(StandardOptions).runner = "DirectRunner"
        direct = options.view_as(DirectOptions)
        if "direct_running_mode" not in explicit:
            direct.direct_running_mode = "multi_processing"
        if "direct_num_workers" not in explicit:
            direct.direct_num_workers = 2
        if "default_sdk_harness_log_level" not in explicit:
            options.view_as(WorkerOptions).default_sdk_harness_log_level = "WARNING"
    return options


def run(pipeline: beam.Pipeline, namespace: str) -> dict[str, int]:
    """Run to the end; the counters of `namespace` (committed values where the runner has them).

    The runner wraps what a worker raises in its own exception: an `InputError` (bad input, a
    user's to fix) is raised again as itself, with its message and no runner traceback text.
    """
    try:
        result = pipeline.run()
        result.wait_until_finish()
    except Exception as error:
        found = re.search(r"InputError: (.+?)(?: \[while running|\n|$)", str(error))
        if found:
            raise InputError(found.group(1)) from error
        raise
    counters = result.metrics().query(MetricsFilter().with_namespace(namespace))["counters"]
    return {c.key.metric.name: int(c.committed if c.committed is not None else c.attempted) for c in counters}


def by_kind(values) -> dict:
    """Grouped values tagged (kind, value), as kind -> [values]."""
    grouped: dict = {}
    for kind, value in values:
        grouped.setdefault(kind, []).append(value)
    return grouped


def merge_rejects(batches) -> rec.Rejects:
    merged = rec.Rejects()
    for batch in batches:
        merged.extend(batch)
    return merged
