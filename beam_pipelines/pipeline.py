"""What our Beam pipelines share: their options, running one with clear input errors, its counters,
and the small helpers of joining partitions with messages.

An `InputError` a worker raises (bad input: the user's to fix) reaches the driver as data: the step
that meets it writes its message under the run's errors directory through Beam's `FileSystems`
(`keeping_input_errors`) before it stops the run, and the driver raises it again from there (`run`).
The runner's own exception, whose text differs from runner to runner, is never parsed for input
errors; it is looked at for one failure only, a full file system, which no step can write down
(`storage.disk_full`: the errno where the error carries one, else the system's message for it).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import apache_beam as beam
import pyarrow as pa
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import (
    DebugOptions,
    PipelineOptions,
    StandardOptions,
    WorkerOptions,
)
from apache_beam.runners.direct.direct_runner import SwitchingDirectRunner

from madp.beam import files
from madp.core import kept_errors, storage
from madp.core import records as rec
from madp.core.errors import InputError
from madp.core.options import add_options
from madp.core.partitioning import PartitionOptions
from madp.core.records import RecordChunk
from madp.core.selection import handle_rejects

NAMESPACE = "madp"  # of every Beam counter of our pipelines

# The element types where our transforms meet (a user's pipeline included), checked by Beam when the
# graph is built (pipeline type checking, on unless --no_pipeline_type_check) and giving the
# shuffles deterministic coders for their keys and handles.
Chunk = tuple[int, RecordChunk]  # valid records: (file index, or record partition, chunk)
SelectionTable = tuple[Any, pa.Table]  # a selection shard: (shard index or path, table of id and copies)


class MadpPipelineOptions(PipelineOptions):
    """madp's options of its Beam pipelines, parsed by Beam with the runner's: on the command line
    beside any Beam option, or in the options of a pipeline that embeds our transforms."""

    @classmethod
    def _add_argparse_args(cls, parser) -> None:
        add_options(parser, PartitionOptions)
        parser.add_argument(
            "--rounds-per-pipeline",
            "--rounds_per_pipeline",
            dest="rounds_per_pipeline",
            type=int,
            default=10,
            help="madp bound: iterations of the bounding (rounds, pass starts) unrolled in one pipeline run",
        )


def madp_options(options: PipelineOptions) -> MadpPipelineOptions:
    """Our options among `options`, checked (`PartitionOptions`' checks)."""
    ours = options.view_as(MadpPipelineOptions)
    if (ours.partitions is not None and ours.partitions < 1) or ours.rounds_per_pipeline < 1:
        raise InputError("--partitions and --rounds-per-pipeline must be at least 1")
    checked = PartitionOptions(ours.partitions, ours.input_split_bytes, ours.local_finish_incidences)
    ours.partitions = checked.partitions_for(None)  # a Beam graph is built before its input is read
    return ours


def _unknown_beam_args(beam_args: list[str]) -> list[str]:
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
    unknown = _unknown_beam_args(beam_args)
    if unknown:
        raise InputError(
            f"unrecognized option(s) {' '.join(unknown)}: neither an option of this command "
            f"nor a Beam pipeline option (check the spelling: madp options use dashes)"
        )
    options = PipelineOptions(beam_args)
    explicit = options.get_all_options(drop_default=True)
    for experiment in options.view_as(DebugOptions).experiments or []:
        name, _, value = experiment.partition("=")
        if name == "data_buffer_time_limit_ms" and value.strip() not in ("", "0"):
            raise InputError(
                f"--experiments {experiment}: Beam's timed flush of the SDK workers' data plane clears what a "
                f"step writes while it sends, and so loses elements (docs/how-to/run-on-a-cluster.md, "
                f"DirectRunner); leave the experiment out, as madp's batch pipelines need no timed flush"
            )
    if options.view_as(StandardOptions).runner == "PrismRunner":
        # Beam keeps one Prism job server per process, made with the options of the first job that asked
        # for it (a Beam DirectRunner job asks first, without --prism_location): each madp job starts its own
        debug = options.view_as(DebugOptions)
        if not debug.lookup_experiment("disable_prism_server_singleton"):
            debug.add_experiment("disable_prism_server_singleton")
    if options.view_as(StandardOptions).runner in (None, "DirectRunner"):
        options.view_as(StandardOptions).runner = "DirectRunner"
        if "default_sdk_harness_log_level" not in explicit:
            options.view_as(WorkerOptions).default_sdk_harness_log_level = "WARNING"
    return options


def keeping_input_errors(errors_dir: str | None):
    """Around a step's work: an InputError raised in it is written under `errors_dir` through Beam's
    FileSystems (`kept_errors.keeping_input_errors`), then raised."""
    return kept_errors.keeping_input_errors(errors_dir, files.write_bytes, files.FileSystems.join)


def keeps_input_errors(process):
    """For a DoFn's `process` whose DoFn has an `errors_dir`: InputErrors are kept there."""

    @functools.wraps(process)
    def kept(self, *args, **kwargs):
        with keeping_input_errors(self.errors_dir):
            yield from process(self, *args, **kwargs)

    return kept


def flush_data_by_size() -> None:
    """Make the DirectRunner's data plane (Beam's FnApiRunner, in this process) flush by size only.

    Beam 2.77 gives each data stream between the DirectRunner and its workers (in `multi_threading`
    and `multi_processing` mode: both directions; the in-memory mode has none) a thread that sends
    the stream's buffer every second, then clears it; writers append without its lock, so whatever
    a step wrote while that send waited (the send blocks once 100 MB are queued) is cleared unsent,
    with no error (`data_plane.TimeBasedBufferingClosableOutputStream.flush`). Elements of a
    megabyte or more were lost in about one run in three with `multi_threading`, one or two
    workers. Flushing by size only, as Beam's SDK workers do by default, sends every byte; a batch
    pipeline does not need the timed flush, which exists for streaming latency. `run` calls this;
    call it before running a pipeline of your own on the DirectRunner outside `in_memory` mode."""
    from apache_beam.runners.portability.fn_api_runner import worker_handlers

    worker_handlers.DATA_BUFFER_TIME_LIMIT_MS = 0


class DirectRunner(SwitchingDirectRunner):
    """Beam's DirectRunner as madp runs and tests it: Beam's FnApiRunner, in this process and the
    workers of `--direct_num_workers` and `--direct_running_mode`, given the pipeline options as
    Beam's DirectRunner gives them.

    Beam 2.77's DirectRunner first hands a pipeline it deems supported to its Prism runner, a Go
    binary it downloads from GitHub at the first run: where the machine reaches GitHub, the job runs
    on Prism, which madp does not test and which ignores the direct options; elsewhere each run
    waits for the download to fail (behind a firewall that drops the connection, until it times
    out) and leaves a temporary folder behind, then falls back to the FnApiRunner. madp's are batch
    pipelines the FnApiRunner runs, so this runner goes to it directly. `run` and the Monte Carlo
    runs put it in place of Beam's (`without_prism`); name `--runner PrismRunner` for Prism. For
    batch pipelines the FnApiRunner runs (no TestStream, real-time timers or combiners with deferred
    side inputs, which Beam's sends to its bundle-based runner)."""

    def is_fnapi_compatible(self) -> bool:
        """As Beam's DirectRunner in batch: the pipeline goes to the FnApiRunner as built, without a
        round trip through the runner API (Beam skips it for its DirectRunner by class name)."""
        return True

    def run_pipeline(self, pipeline, options):
        from apache_beam.portability.api import beam_provision_api_pb2
        from apache_beam.runners.portability.fn_api_runner import fn_runner
        from apache_beam.runners.portability.portable_runner import JobServiceHandle

        encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options())
        provision = fn_runner.ExtendedProvisionInfo(beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded))
        return fn_runner.FnApiRunner(provision_info=provision).run_pipeline(pipeline, options)


def without_prism(pipeline: beam.Pipeline) -> None:
    """Put madp's `DirectRunner` in place of Beam's DirectRunner (no first try on Prism) for a batch
    pipeline; a streaming one, and any other runner, stay."""
    if type(pipeline.runner) is SwitchingDirectRunner and not pipeline.options.view_as(StandardOptions).streaming:
        pipeline.runner = DirectRunner()


def run(pipeline: beam.Pipeline, namespace: str, errors_dir: str, output: str | None = None) -> dict[str, int]:
    """Run to the end; the counters of `namespace` (committed values where the runner has them).

    When the run fails after a step kept an InputError under `errors_dir`, that error is raised (the
    first by its message, when several steps met one), with no runner traceback text. A failure on a
    full file system (or a spent quota), where nothing can be kept, is a `DiskFull` naming `output`,
    the directory the pipeline writes (default `errors_dir`); any other failure is raised as the runner
    raised it.
    """
    flush_data_by_size()
    without_prism(pipeline)
    try:
        result = pipeline.run()
        result.wait_until_finish()
    except Exception as error:
        if _interrupted(error):  # Ctrl-C in a step run in this process, which the runner re-raises as its own error
            raise KeyboardInterrupt from error
        kept = kept_errors.kept_input_error(files.read_bytes(path).decode() for path in files.files_under(errors_dir))
        if kept is not None:
            raise kept from error
        # A worker's write failed, and so would writing its error down: the runner's error is all there
        # is (relayed as text by the DirectRunner), read for the file system's errno or its message only.
        full = storage.disk_full(output or errors_dir, error)
        if full is not None:
            raise full from error
        raise
    try:
        counters = result.metrics().query(MetricsFilter().with_namespace(namespace))["counters"]
    except NotImplementedError:  # a runner that keeps no metrics
        return {}
    return {c.key.metric.name: int(c.committed if c.committed is not None else c.attempted) for c in counters}


def _interrupted(error: BaseException) -> bool:
    """Whether a KeyboardInterrupt caused `error` (Beam re-raises one met in a step as a RuntimeError)."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def stat(name: str, value: int) -> beam.pvalue.TaggedOutput:
    """A count for the run's summary (a "stats" output), also a Beam counter (which retries may inflate)."""
    if not name.startswith("max_"):
        count(name, value)
    return beam.pvalue.TaggedOutput("stats", (name, int(value)))


def count(name: str, value: int) -> None:
    """A Beam counter only (the report's figures come from the outputs, not from counters)."""
    Metrics.counter(NAMESPACE, name).inc(int(value))


def _unless_rejected(element, rejects: rec.Rejects, output: str, errors_dir: str | None):
    with keeping_input_errors(errors_dir):
        handle_rejects(rejects, "error", output)  # raises, listing the rows, when there are any
    return element


class StopOnInvalidRows(beam.PTransform):
    """`--on-invalid error` inside a pipeline: the elements go on once every rejected row is known
    (the `rejects` PCollections, merged, are a side input), or the run stops with their list, kept
    as data for the driver. Gate small elements (handles, one value), so that no data waits.
    `output` names where `--on-invalid skip` would put the rows, in the message."""

    def __init__(self, rejects: tuple[beam.PCollection, ...], output: str, errors_dir: str | None):
        super().__init__()
        self.rejects, self.output, self.errors_dir = rejects, output, errors_dir

    def expand(self, elements):
        every_reject = (
            self.rejects | "EveryReject" >> beam.Flatten() | "MergeRejects" >> beam.CombineGlobally(rec.merge_rejects)
        )
        return elements | "UnlessRejected" >> beam.Map(
            _unless_rejected, beam.pvalue.AsSingleton(every_reject), self.output, self.errors_dir
        )
