"""What our Beam pipelines share: their options, running one with clear input errors, its counters,
and the small helpers of joining partitions with messages.

An `InputError` a worker raises (bad input: the user's to fix) travels as data: the step that meets it
writes its message under the run's store directory (`keeping_input_errors`) before it stops the run,
and the driver raises it again from there (`run`). The runner's own exception, whose text differs
from runner to runner, is never parsed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import uuid
from typing import Any

import apache_beam as beam
import pyarrow as pa
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import (
    DirectOptions,
    PipelineOptions,
    StandardOptions,
    WorkerOptions,
)

from beam_pipelines.store import PartitionStore, Slice
from madp.core import records as rec
from madp.core import storage
from madp.core.errors import InputError
from madp.core.records import RecordChunk
from madp.core.selection import handle_rejects

INPUT_ERRORS = "input-errors"  # under a run's store directory: the messages of InputErrors its steps met
NAMESPACE = "madp"  # of every Beam counter of our pipelines

# The element types where our transforms meet (a user's pipeline included), checked by Beam when the
# graph is built (pipeline type checking, on unless --no_pipeline_type_check) and giving the
# shuffles deterministic coders for their keys and handles.
Sent = tuple[int, Slice]  # a slice sent to a partition
Chunk = tuple[int, RecordChunk]  # a file's valid records: (file index, chunk)
SelectionTable = tuple[Any, pa.Table]  # a selection shard: (shard index or path, table of id and copies)
Stored = tuple[int, str]  # a partition's arrays, stored whole: (partition, path)


class MadpPipelineOptions(PipelineOptions):
    """madp's options of its Beam pipelines, parsed by Beam with the runner's: on the command line
    beside any Beam option, or in the options of a pipeline that embeds our transforms."""

    @classmethod
    def _add_argparse_args(cls, parser) -> None:
        parser.add_argument(
            "--partitions",
            type=int,
            default=4,
            help="madp: record and user partitions, the columnar units of work (use ~2-4 per worker core)",
        )
        parser.add_argument(
            "--rounds-per-pipeline",
            "--rounds_per_pipeline",
            dest="rounds_per_pipeline",
            type=int,
            default=6,
            help="madp bound: rounds of the bounding unrolled in one pipeline run",
        )


def madp_options(options: PipelineOptions) -> MadpPipelineOptions:
    """Our options among `options`, checked."""
    ours = options.view_as(MadpPipelineOptions)
    if ours.partitions < 1 or ours.rounds_per_pipeline < 1:
        raise InputError("--partitions and --rounds-per-pipeline must be at least 1")
    return ours


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


@contextlib.contextmanager
def keeping_input_errors(store_directory: str):
    """Around a step's work: an InputError raised in it is written under `store_directory`, then raised."""
    try:
        yield
    except InputError as error:
        storage.write_text(storage.join(store_directory, INPUT_ERRORS, f"{uuid.uuid4().hex}.txt"), str(error))
        raise


def keeps_input_errors(process):
    """For a DoFn's `process` whose DoFn has a `store`: InputErrors are kept under its directory."""

    @functools.wraps(process)
    def kept(self, *args, **kwargs):
        with keeping_input_errors(self.store.directory):
            yield from process(self, *args, **kwargs)

    return kept


def run(pipeline: beam.Pipeline, namespace: str, store_directory: str) -> dict[str, int]:
    """Run to the end; the counters of `namespace` (committed values where the runner has them).

    When the run fails after a step kept an InputError under `store_directory`, that error is raised
    (the first by its message, when several steps met one), with no runner traceback text.
    """
    try:
        result = pipeline.run()
        result.wait_until_finish()
    except Exception as error:
        kept = storage.join(store_directory, INPUT_ERRORS)
        if storage.kind(kept) == "directory":
            messages = sorted(storage.read_text(path) for path in storage.list_files(kept))
            if messages:
                raise InputError(messages[0]) from error
        raise
    counters = result.metrics().query(MetricsFilter().with_namespace(namespace))["counters"]
    return {c.key.metric.name: int(c.committed if c.committed is not None else c.attempted) for c in counters}


def stat(name: str, value: int) -> beam.pvalue.TaggedOutput:
    """A count for the run's summary (a "stats" output), also a Beam counter (which retries may inflate)."""
    if not name.startswith("max_"):
        count(name, value)
    return beam.pvalue.TaggedOutput("stats", (name, int(value)))


def count(name: str, value: int) -> None:
    """A Beam counter only (the report's figures come from the outputs, not from counters)."""
    Metrics.counter(NAMESPACE, name).inc(int(value))


def _unless_rejected(element, rejects: rec.Rejects, output: str, store_directory: str):
    with keeping_input_errors(store_directory):
        handle_rejects(rejects, "error", output)  # raises, listing the rows, when there are any
    return element


class StopOnInvalidRows(beam.PTransform):
    """`--on-invalid error` inside a pipeline: the elements go on once every rejected row is known
    (the `rejects` PCollections, merged, are a side input), or the run stops with their list, kept
    as data for the driver. Gate small elements (handles, one value), so that no data waits.
    `output` names where `--on-invalid skip` would put the rows, in the message."""

    def __init__(self, rejects: tuple[beam.PCollection, ...], output: str, store_directory: str):
        super().__init__()
        self.rejects, self.output, self.store_directory = rejects, output, store_directory

    def expand(self, elements):
        every_reject = (
            self.rejects | "EveryReject" >> beam.Flatten() | "MergeRejects" >> beam.CombineGlobally(merge_rejects)
        )
        return elements | "UnlessRejected" >> beam.Map(
            _unless_rejected, beam.pvalue.AsSingleton(every_reject), self.output, self.store_directory
        )


def by_kind(values) -> dict:
    """Grouped values tagged (kind, value), as kind -> [values]."""
    grouped: dict = {}
    for kind, value in values:
        grouped.setdefault(kind, []).append(value)
    return grouped


def merged_records(store: PartitionStore, handles, rejects: rec.Rejects) -> rec.RecordChunk:
    """A record partition's slices as one chunk in key order; its duplicated ids go to `rejects`."""
    chunks = sorted(store.gather(handles), key=lambda c: int(c.keys[0]))
    return rec.reject_duplicates(rec.merge_chunks(chunks), rejects)


def merge_rejects(batches) -> rec.Rejects:
    merged = rec.Rejects()
    for batch in batches:
        merged.extend(batch)
    return merged
