"""Records as (file index, RecordChunk) elements, the first steps of the bounding and the batching
alike: read and validated from input files, then handed to their record partitions (by id hash) as
(record partition, RecordChunk) elements.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from typing import Any

import apache_beam as beam
from apache_beam.io.filesystem import BeamIOError, CompressionTypes
from apache_beam.io.filesystems import FileSystems

from madp.beam.pipeline import Chunk, keeping_input_errors, keeps_input_errors, madp_options, stat
from madp.core import input_splits, record_reading
from madp.core import records as rec
from madp.core.errors import InputError
from madp.core.input_splits import FileAccess, InputSplit, count_split, plan_splits, read_planned_pieces
from madp.core.record_reading import shown_row


def _beam_open(path: str):
    return FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)


# Input files through Beam's FileSystems: the file systems the runner is set up with.
BEAM_FILES = FileAccess(_beam_open, (OSError, BeamIOError))


@beam.typehints.with_input_types(tuple[int, str])
@beam.typehints.with_output_types(InputSplit)
class _PlanSplits(beam.DoFn):
    """(file index, path) -> the file's splits (`input_splits`), from its size or Parquet row groups."""

    def __init__(self, split_bytes: int, errors_dir: str | None):
        self.split_bytes, self.errors_dir = split_bytes, errors_dir

    @keeps_input_errors
    def process(self, element):
        index, path = element
        yield from plan_splits(index, path, self.split_bytes, BEAM_FILES)


@beam.typehints.with_input_types(InputSplit)
@beam.typehints.with_output_types(tuple[tuple[int, int], int])
class _CountRows(beam.DoFn):
    """A range of a JSON Lines file read in ranges -> ((file index, start), its rows): the first pass,
    which numbers the rows of each range as in the whole file."""

    def __init__(self, errors_dir: str | None):
        self.errors_dir = errors_dir

    @keeps_input_errors
    def process(self, split):
        if split.counted:
            yield count_split(split, BEAM_FILES)


@beam.typehints.with_input_types(InputSplit, dict[tuple[int, int], int])
@beam.typehints.with_output_types(Chunk)
class _ReadSplit(beam.DoFn):
    """Read and validate one split: (file index, chunk of its valid records); its rejects, counts and
    facts (for the rules over whole files)."""

    def __init__(self, columns: rec.Columns, content: record_reading.Content, errors_dir: str | None):
        self.columns, self.content, self.errors_dir = columns, content, errors_dir
        self._counts: dict | None = None  # the side input `before` was summed from (held, so its id stays its own)
        self._before: dict[tuple[int, int], int] = {}

    @keeps_input_errors
    def process(self, split, counts):
        if counts is not self._counts:
            self._counts, self._before = counts, input_splits.first_rows(counts)
        first_row = input_splits.first_row(split, self._before)
        for result in read_planned_pieces(split, self.columns, self.content, first_row, BEAM_FILES):
            yield from _read_outputs(split.file_index, result)


def _read_outputs(index: int, result: rec.FileResult):
    """A read chunk's outputs: (index, chunk), its rejected rows (a "rejects" output), counts ("stats")
    and facts ("facts")."""
    yield from (stat(name, count) for name, count in result.stats().items())
    yield beam.pvalue.TaggedOutput("facts", result.facts)
    if len(result.rejects):
        yield beam.pvalue.TaggedOutput("rejects", result.rejects)
    yield index, result.chunk


class _Checked(beam.PTransform):
    """(chunks, rejects, facts) of every read -> (chunks, rejects), once the rules over whole files and
    the whole input hold (`record_reading.check_facts`), each chunk's content cast to the input's
    types. Until then nothing goes on, so a broken rule stops the run before any other step."""

    def __init__(self, columns: rec.Columns, content: record_reading.Content, errors_dir: str | None):
        super().__init__()
        self.columns, self.content, self.errors_dir = columns, content, errors_dir

    def expand(self, reads):
        chunks, rejects, facts = reads
        columns, content, errors_dir = self.columns, self.content, self.errors_dir

        def check(every_fact: list[rec.ReadFacts]):
            with keeping_input_errors(errors_dir):
                return record_reading.check_facts(every_fact, columns, content)

        schema = facts | "EveryFact" >> beam.combiners.ToList() | "CheckFacts" >> beam.Map(check)

        def conform(index: int, chunk: rec.RecordChunk, schema=None) -> Chunk:
            with keeping_input_errors(errors_dir):
                return index, record_reading.conform_content(chunk, schema)

        conformed = chunks | "AfterChecks" >> beam.MapTuple(conform, beam.pvalue.AsSingleton(schema))
        checked_rejects = rejects | "RejectsAfterChecks" >> beam.Map(
            lambda batch, _: batch, beam.pvalue.AsSingleton(schema)
        )
        return conformed, checked_rejects


@beam.typehints.with_input_types(Chunk)
@beam.typehints.with_output_types(Chunk)
class SplitByRecordPartition(beam.DoFn):
    """(file index, chunk) -> (record partition, the chunk's records in it), by id hash
    (`records.by_record_partition`)."""

    def __init__(self, partitions: int):
        self.partitions = partitions

    def process(self, element):
        _, chunk = element
        yield from rec.by_record_partition(chunk, self.partitions)


class ReadRecords(beam.PTransform):
    """Input files -> (file index, RecordChunk of its valid rows); the rejected rows and the counts.
    With `content`, the chunks carry those columns too (batching; `record_reading.OTHER_COLUMNS`: every
    column of the input but the record's, found by the reads themselves, so no step reads a file
    first). The I/O of `madp bound` and `madp
    batch`, through Beam's FileSystems: a file larger than `--input-split-bytes` (an option of the
    pipeline) is read in splits by as many workers, with the same rows, row numbers and results as
    whole (`madp.core.input_splits`). The records go on once the rules over whole files and the whole
    input hold (mixed id types, a record column in no row, content types).

    Args:
        files: the input files (.jsonl, .jsonl.gz, .parquet; local or any file system Beam reads).
        columns: where a row's id, users and weight are (`madp.core.records.Columns`).
        errors_dir: where an InputError a step meets is kept for the driver.
        content: the content columns to carry (`record_reading.OTHER_COLUMNS`: all but the record's; None:
            none, as bounding reads).

    Returns:
        Applied to a pipeline, (chunks, rejects, stats), that is (file index, RecordChunk) elements, the `Rejects`
        of invalid rows, and (name, count) elements.

    Raises:
        madp.core.errors.InputError: in the pipeline, an unreadable file or a rule of the whole input
            broken (invalid rows are rejects, which `BoundContributions` stops on under on_invalid "error").

    Example::

        chunks, rejects, _ = pipeline | ReadRecords(["gs://bucket/records.parquet"], Columns(id="msg"))
    """

    def __init__(
        self,
        files: list[str],
        columns: rec.Columns,
        errors_dir: str | None = None,
        content: record_reading.Content = None,
    ):
        super().__init__()
        self.files, self.columns, self.errors_dir, self.content = files, columns, errors_dir, content

    def expand(self, pbegin):
        split_bytes = madp_options(pbegin.pipeline.options).input_split_bytes
        # InputSplit: a JSON Lines byte range, Parquet row groups or a whole file
        splits = (
            pbegin
            | "ListFiles" >> beam.Create(list(enumerate(self.files)))
            | "SpreadFiles" >> beam.Reshuffle()
            | "PlanSplits" >> beam.ParDo(_PlanSplits(split_bytes, self.errors_dir))
            | "SpreadSplits" >> beam.Reshuffle()
        )
        # ((file index, start), rows) of each range of a file read in ranges
        counts = splits | "CountRows" >> beam.ParDo(_CountRows(self.errors_dir))
        read = splits | "ReadAndValidate" >> beam.ParDo(
            _ReadSplit(self.columns, self.content, self.errors_dir), beam.pvalue.AsDict(counts)
        ).with_outputs("rejects", "stats", "facts", main="chunks")
        chunks, rejects = (read.chunks, read.rejects, read.facts) | "Checked" >> _Checked(
            self.columns, self.content, self.errors_dir
        )
        return chunks, rejects, read.stats


ID, USERS, WEIGHT = "id", "users", "weight"  # the names extracted values take in the records and batch files


class RecordExtractors(typing.NamedTuple):
    """How to read a record out of one of your own rows, as PipelineDP's data extractors do: functions
    of a row that give its id (an int or a str), its users (a list of ints or strs), optionally its
    weight (`--order weight`) and, for batching, its content (a {column: value} dict of what the batch
    files carry: numbers, strings, lists of them; numpy values are taken as their lists). A row whose
    values are not valid is rejected with the reason a JSON Lines input row would have (docs/how-to/your-data.md,
    Invalid rows).

    Args:
        id_extractor: a row's id (an int or a str).
        users_extractor: a row's users (a list of ints or strs).
        weight_extractor: a row's weight, for order "weight" (None: none).
        content_extractor: a row's content, for batching (None: none).
        user_ids: how string user ids are read ("email", "as-is"; None: an id that may name one person
            twice is an error).

    Returns:
        The extractors, for `RecordsFromRows`, `BoundContributions` and `MinSepSample`.

    Raises:
        madp.core.errors.InputError: in the pipeline, an extractor that fails on a row (naming it and
            the row); a row whose values are invalid is a reject.

    Example (an email: its sender and recipients are its users)::

        RecordExtractors(
            id_extractor=lambda row: row["message_id"],
            users_extractor=lambda row: [row["sender"], *row["recipients"]],
            content_extractor=lambda row: {"text": row["body"]},
        )
    """

    id_extractor: Callable[[Any], int | str]
    users_extractor: Callable[[Any], list]
    weight_extractor: Callable[[Any], float] | None = None
    content_extractor: Callable[[Any], Mapping[str, Any]] | None = None
    user_ids: str | None = None  # how string user ids are read, as `--user-ids` says (docs/how-to/your-data.md)

    @property
    def columns(self) -> rec.Columns:
        """The names the extracted values take in the records (and the batch files), and how user ids are read."""
        return rec.Columns(weight=WEIGHT if self.weight_extractor else None, user_ids=self.user_ids)

    def record(self, row) -> dict:
        """The row's record as one row of a JSON Lines input file holds it; an extractor that fails is an
        error naming it and the row."""
        record = {ID: self._extract("id_extractor", row), USERS: self._extract("users_extractor", row)}
        if self.weight_extractor:
            record[WEIGHT] = self._extract("weight_extractor", row)
        content = self._extract("content_extractor", row) if self.content_extractor else {}
        if not isinstance(content, Mapping):
            raise InputError(
                f"content_extractor gave a {type(content).__name__}, not a dict, on the row {shown_row(row)}"
            )
        clash = sorted(set(content) & {ID, USERS, WEIGHT})
        if clash:
            raise InputError(
                f"content_extractor gave a column named {clash[0]!r}, a name the record's own values take, "
                f"on the row {shown_row(row)}"
            )
        return {**record, **content}

    def _extract(self, name: str, row) -> Any:
        try:
            return getattr(self, name)(row)
        except Exception as error:  # the user's function: any error it raises is theirs to see, with the row
            raise InputError(f"{name} failed on the row {shown_row(row)}: {error!r}") from error


def _as_line(row, extractors: RecordExtractors, chunks: int, errors_dir: str | None) -> tuple[int, bytes]:
    """A row as (chunk, its record as one JSON line) (`record_reading.record_line`)."""
    with keeping_input_errors(errors_dir):
        return record_reading.record_line(extractors.record(row), chunks, row)


@beam.typehints.with_output_types(Chunk)
class _ReadLines(beam.DoFn):
    """One chunk of rows, in the order of their JSON, read and validated as a JSON Lines file is."""

    def __init__(self, columns: rec.Columns, content: record_reading.Content, errors_dir: str | None):
        self.columns, self.content, self.errors_dir = columns, content, errors_dir

    @keeps_input_errors
    def process(self, element):
        index, lines = element
        yield from _read_outputs(index, record_reading.read_row_chunk(index, lines, self.columns, self.content))


class RecordsFromRows(beam.PTransform):
    """A PCollection of one's own rows (from BigQuery, TFRecords, another pipeline: any elements) and
    the `RecordExtractors` that read a record out of each -> the (chunk index, RecordChunk) elements
    that `BoundContributions` and `MinSepSample` take, the `Rejects` of rows that are not valid
    records, and counts: each row's record is read and validated exactly as a row of a JSON Lines
    input file (docs/how-to/your-data.md), with the content when `content_extractor` is given. Rows go to
    `chunks` chunks by a hash of their record, each chunk ordered by its records' JSON, so the chunks,
    and every result, are the same whatever the runner's bundling; chunk indices are 0..chunks-1
    (records from `ReadRecords` in the same pipeline would need other indices). Rejected rows name
    their chunk and their row in its order. `BoundContributions` and `MinSepSample` take rows and
    extractors themselves. Chunks for `BoundContributions` are read without content (no
    `content_extractor`, as the bounding reads files): under `on_invalid="skip"` a row whose content
    is invalid is rejected, and content must not decide which records are kept.

    Args:
        extractors: how to read a record out of a row (`RecordExtractors`).
        chunks: the chunks the rows go to, in [1, 2^20).
        errors_dir: where an InputError a step meets is kept for the driver.

    Returns:
        Applied to the rows, (chunks, rejects, stats), that is (chunk index, RecordChunk) elements, the
        `Rejects` of rows that are not valid records, and (name, count) elements.

    Raises:
        madp.core.errors.InputError: chunks out of range; in the pipeline, an extractor that fails.

    Example::

        rows = pipeline | beam.io.ReadFromBigQuery(table="project:dataset.emails")
        extractors = RecordExtractors(lambda row: row["message_id"], lambda row: [row["sender"], *row["recipients"]])
        chunks, rejects, _ = rows | RecordsFromRows(extractors)  # no content_extractor: for the bounding
        bound = chunks | BoundContributions(BoundOptions(max_contributions=4), partitions=64)
    """

    def __init__(self, extractors: RecordExtractors, chunks: int = 64, errors_dir: str | None = None):
        super().__init__()
        if not 1 <= chunks < 1 << 20:
            raise InputError("chunks must be between 1 and 2^20")
        self.extractors, self.chunks, self.errors_dir = extractors, chunks, errors_dir

    def expand(self, rows):
        columns = self.extractors.columns
        content = record_reading.OTHER_COLUMNS if self.extractors.content_extractor else None
        read = (
            rows
            | "AsLines" >> beam.Map(_as_line, self.extractors, self.chunks, self.errors_dir)
            | "GroupChunks" >> beam.GroupByKey()
            | "ReadAndValidate"
            >> beam.ParDo(_ReadLines(columns, content, self.errors_dir)).with_outputs(
                "rejects", "stats", "facts", main="chunks"
            )
        )
        chunks, rejects = (read.chunks, read.rejects, read.facts) | "Checked" >> _Checked(
            columns, content, self.errors_dir
        )
        return chunks, rejects, read.stats


@beam.typehints.with_input_types(Chunk)
class RecordPartitions(beam.PTransform):
    """(file index, RecordChunk) -> (record partition, [RecordChunk, ...]: its records, by input chunk)."""

    def __init__(self, partitions: int):
        super().__init__()
        self.partitions = partitions

    def expand(self, chunks):
        return (
            chunks
            | "SplitByRecordPartition" >> beam.ParDo(SplitByRecordPartition(self.partitions))
            | "GroupRecordPartitions" >> beam.GroupByKey()
        )
