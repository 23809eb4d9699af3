"""The input on Spark, read with madp's own readers exactly as Beam's `record_chunks.ReadRecords` reads
it: each file planned into splits (`input_splits.plan_splits`), the rows of a JSON Lines file's later
ranges counted first so rows are numbered as in the whole file, each split read and validated on an
executor in pieces (`input_splits.read_planned_pieces`), and the rules over the whole input judged on the driver
from every split's facts (`record_reading.check_facts`) before any record goes on. Then the records
are grouped into their record partitions by id hash (`records.by_record_partition`).

An InputError that a task meets is kept under the job's errors folder (`kept_errors`), and the driver
raises it as the one line the local engine prints (`raising_kept_errors`), not as the JVM's traceback.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from pyspark import StorageLevel

from madp.core import input_splits, record_reading
from madp.core import records as rec
from madp.core.errors import InputError
from madp.core.input_splits import InputSplit
from madp.core.kept_errors import keeping_input_errors, kept_input_error, kept_messages
from madp.core.selection import stat_total

if TYPE_CHECKING:
    from pyspark import RDD, SparkContext


def kept(errors_dir: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` for a task: an InputError it raises is kept under `errors_dir` for the driver."""

    @functools.wraps(function)
    def keeping(*args: Any) -> Any:
        with keeping_input_errors(errors_dir):
            return function(*args)

    return keeping


@contextlib.contextmanager
def raising_kept_errors(errors_dir: str) -> Iterator[None]:
    """Around the driver's Spark actions: a job that fails after a task kept an InputError raises that
    error, the one line the local engine gives; any other failure as Spark raised it."""
    try:
        yield
    except InputError:
        raise
    except Exception:
        error = kept_input_error(kept_messages(errors_dir))
        if error is None:
            raise
        raise error from None


# How the executors keep what later steps read again (the input's reads, a step's state): on their local
# disks, not in the JVM heap. Held there, at 100M records the cached blocks left no room in the heap for a
# task's large values ("Java heap space", executors lost); on disk (the page cache) 10M records bound as
# fast, and the executors' JVMs stayed at 0.75 GB instead of filling their 3 GB heaps (2.0-2.2 GB).
KEPT = StorageLevel.DISK_ONLY


def by_part(part: int) -> int:
    """Spark's partition of a user or record partition: its own number. One function object for every
    shuffle, so Spark sees one partitioner and a join keeps in place what is partitioned already."""
    return part


def gathered(partitions: int, *keyed: RDD) -> RDD:
    """(partition, its values) of the (partition, value) pairs of every RDD of `keyed`, partition p in
    Spark partition p. Only what is not partitioned so already crosses a shuffle: an RDD that a shuffle
    by `by_part` left in place (a step's state, the record partitions) is read where it is, and only the
    messages sent to it move."""
    from pyspark import RDD

    union = functools.reduce(RDD.union, [rdd.partitionBy(partitions, by_part) for rdd in keyed])
    return union.groupByKey(partitions, by_part)


def summed_stats(counts: list[dict[str, int]]) -> dict[str, int]:
    """Counts the tasks sent, by name: summed, or the largest of a `max_` one (`selection.stat_total`)."""
    by_name: dict[str, list[int]] = {}
    for each in counts:
        for name, value in each.items():
            by_name.setdefault(name, []).append(int(value))
    return {name: stat_total(name, values) for name, values in by_name.items()}


class SparkRecords(NamedTuple):
    """The input read on Spark: (file index, RecordChunk) of its valid records (conformed to the input's
    content types), the rejected rows, the read's counts by name (`FileResult.stats`, summed), and the
    reads the chunks come from, persisted: the caller releases them (`unpersist`) once a job has grouped
    the chunks into their partitions, where they would hold every record in the executors' storage."""

    chunks: RDD
    rejects: rec.Rejects
    stats: dict[str, int]
    reads: RDD


def _planned_splits(sc: SparkContext, files: list[str], split_bytes: int, errors_dir: str) -> list[InputSplit]:
    """Every input file's splits, planned on the executors (a Parquet file's footer read there)."""

    def plan(listed: tuple[int, str]) -> list[InputSplit]:
        index, path = listed
        return input_splits.plan_splits(index, path, split_bytes, input_splits.STORAGE)

    return sc.parallelize(list(enumerate(files)), len(files)).flatMap(kept(errors_dir, plan)).collect()


def _first_rows(sc: SparkContext, splits: list[InputSplit], errors_dir: str) -> dict[tuple[int, int], int]:
    """Per JSON Lines range after a file's first, the rows of its file before it (a first pass)."""
    counted = [split for split in splits if split.counted]
    if not counted:
        return {}
    count = kept(errors_dir, lambda split: input_splits.count_split(split, input_splits.STORAGE))
    return input_splits.first_rows(dict(sc.parallelize(counted, len(counted)).map(count).collect()))


def read_records(
    sc: SparkContext,
    files: list[str],
    columns: rec.Columns,
    split_bytes: int,
    errors_dir: str,
    content: record_reading.Content = None,
) -> SparkRecords:
    """The input `files` read in splits of about `split_bytes` (`--input-split-bytes`) with `columns`
    (and the `content` columns, for batching), every rule of the local engine applied.

    Raises:
        madp.core.errors.InputError: an unreadable file, a rule over whole files or the whole input broken
            (invalid rows are rejects, which the caller handles under --on-invalid).
    """
    with raising_kept_errors(errors_dir):
        splits = _planned_splits(sc, files, split_bytes, errors_dir)
        before = _first_rows(sc, splits, errors_dir)

    def read(split: InputSplit) -> Iterator[rec.FileResult]:
        with keeping_input_errors(errors_dir):  # around the pieces as they are read, not their generator's making
            first_row = input_splits.first_row(split, before)
            yield from input_splits.read_planned_pieces(split, columns, content, first_row, input_splits.STORAGE)

    pieces = sc.parallelize(splits, len(splits)).flatMap(read)
    return checked_reads(pieces, columns, errors_dir, content)


def checked_reads(
    results: RDD, columns: rec.Columns, errors_dir: str, content: record_reading.Content = None
) -> SparkRecords:
    """The input from `results`, the FileResult of each of its reads (a file's split, a DataFrame's
    partition), once the rules over whole files and the whole input have passed on the driver
    (`record_reading.check_facts`): their valid records conformed to the input's content types."""
    results = results.persist(KEPT)
    with raising_kept_errors(errors_dir):
        read_facts = results.map(lambda result: (result.facts, result.rejects, result.stats())).collect()
    schema = record_reading.check_facts([facts for facts, _, _ in read_facts], columns, content)
    rejects = rec.merge_rejects(rejects for _, rejects, _ in read_facts)
    conform = kept(errors_dir, record_reading.conform_content)
    chunks = results.map(lambda result: (result.facts.file_index, conform(result.chunk, schema)))
    return SparkRecords(chunks, rejects, summed_stats([stats for _, _, stats in read_facts]), results)


def record_partitions(chunks: RDD, partitions: int) -> RDD:
    """(file index, RecordChunk) -> (record partition, [RecordChunk, ...]: its records, by input chunk),
    record partition p in Spark partition p."""
    return (
        chunks.flatMap(lambda element: rec.by_record_partition(element[1], partitions))
        .groupByKey(partitions, by_part)
        .mapValues(list)
    )
