"""A Spark DataFrame of records as the input of `--runner pyspark` (`madp.bound(frame, ...)`,
`madp.batch(selected, frame, ...)`): each of its partitions goes to the executors as Arrow and is read,
in pieces as Spark's batches come, as a Parquet split is (`input_splits.arrow_pieces`), with the same
row rules, reject reasons and counts; the rules over the whole input are judged on the driver from every
partition's facts, as for files (`records.checked_reads`). Then the same engine path as files.

Rows are numbered within their partition: row r of the DataFrame's partition p (in Spark's order of
the partition's rows) is row r of the source `<DataFrame> partition p` (`records.dataframe_partition`),
as rejects and errors name it, and its record's key is p << 40 | r, as a record's of input file p. A
DataFrame read from one file, or built from its rows in order, keeps their order and so selects, and
rejects as duplicated, the same records as the file. A DataFrame whose partitions are not
deterministic (one shuffled without an order) may number its rows differently when Spark recomputes
a partition: `persist()` it or write it out first.

The record columns' types are checked on the driver from the DataFrame's schema, before any job: a
column that is missing, or not of a record column's type, is one error naming it.
"""

from __future__ import annotations

import itertools
import pickle
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import pyarrow as pa

from madp.core import input_splits, record_reading
from madp.core import records as rec
from madp.core.kept_errors import keeping_input_errors
from madp.spark.records import SparkRecords, checked_reads, read_records

if TYPE_CHECKING:
    from pyspark import SparkContext
    from pyspark.sql import DataFrame, Row

CROSSING_BYTES = 1 << 26  # a pickled read crosses the JVM in binary values of this size: none near Arrow's 2 GiB


def as_dataframe(value: object) -> DataFrame | None:
    """`value` where it is a PySpark DataFrame, else None (pyspark not imported where the caller has none)."""
    if "pyspark.sql" not in sys.modules:
        return None
    from pyspark.sql import DataFrame

    return value if isinstance(value, DataFrame) else None


def input_name(input: object) -> str:
    """How reports and errors name the input `input`: its path, or `<DataFrame>` (`records.DATAFRAME`)."""
    return str(input) if as_dataframe(input) is None else rec.DATAFRAME


def arrow_schema(frame: DataFrame) -> pa.Schema:
    """The Arrow schema of the batches Spark gives a DataFrame's partitions in."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(frame.schema, timezone="UTC")


def checked_columns(schema: pa.Schema, columns: rec.Columns, content: record_reading.Content = None) -> list[str]:
    """The columns of a DataFrame of `schema` that are read, checked as a Parquet file's are: a record
    column that is missing or of another type than a record's is an error naming it."""
    names = record_reading.parquet_read_columns(rec.DATAFRAME, schema.names, columns, content)
    record_reading.read_parquet_rows(schema.empty_table().select(names), rec.DATAFRAME, 0, columns, content)
    return names


def user_id_type(frame: DataFrame, columns: rec.Columns) -> pa.DataType:
    """The type of the user ids of a DataFrame's records, from its schema (the columns checked)."""
    schema = arrow_schema(frame)
    names = checked_columns(schema, columns)
    empty = record_reading.read_parquet_rows(schema.empty_table().select(names), rec.DATAFRAME, 0, columns)
    return empty.chunk.users.type


def input_files(frame: DataFrame) -> list[str]:
    """The files a DataFrame reads (none where it was built otherwise), local ones as paths: the inputs
    an output must not overlap."""
    return [urlparse(uri).path if uri.startswith("file:") else uri for uri in frame.inputFiles()]


def pickled(number: int, result: rec.FileResult) -> pa.RecordBatch:
    """A partition's `number`-th FileResult as rows of (`number`, a piece of its pickle) that cross the
    JVM (`unpickled` reads them back)."""
    data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    pieces = [data[at : at + CROSSING_BYTES] for at in range(0, len(data), CROSSING_BYTES)]
    numbers = pa.array([number] * len(pieces), pa.int64())
    return pa.RecordBatch.from_arrays([numbers, pa.array(pieces, pa.binary())], names=["result", "piece"])


def unpickled(rows: Iterable[Row]) -> Iterator[rec.FileResult]:
    """A partition's FileResults from the rows `pickled` made of them, in order (none where Spark ran no
    task on an empty partition)."""
    for _, pieces in itertools.groupby(rows, key=lambda row: row.result):
        yield pickle.loads(b"".join(row.piece for row in pieces))


def _partition_reader(
    schema: pa.Schema, columns: rec.Columns, content: record_reading.Content, errors_dir: str
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The task of `mapInArrow` over the DataFrame's partitions: a partition's rows (the columns read, of
    `schema`) read as a Parquet split's, in pieces as Spark's batches come (`input_splits.arrow_pieces`),
    each piece's FileResult `pickled`."""

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        task = TaskContext.get()
        assert task is not None, "a DataFrame's partition is read in a Spark task"
        with keeping_input_errors(errors_dir):
            index = task.partitionId()
            source, piece_bytes = rec.dataframe_partition(index), input_splits.PIECE_BYTES
            results = input_splits.arrow_pieces(batches, schema, source, index, columns, content, 0, piece_bytes)
            yield from itertools.starmap(pickled, enumerate(results))

    return read


def read_frame(
    frame: DataFrame, columns: rec.Columns, errors_dir: str, content: record_reading.Content = None
) -> SparkRecords:
    """The records of a DataFrame (and its `content` columns, for batching), each partition read as a
    Parquet split is, every rule of the local engine applied (the module's docstring: row numbers).

    Raises:
        madp.core.errors.InputError: a record column missing or of another type, a rule over the whole
            input broken (invalid rows are rejects, which the caller handles under --on-invalid).
    """
    schema = arrow_schema(frame)
    names = checked_columns(schema, columns, content)
    reader = _partition_reader(pa.schema([schema.field(name) for name in names]), columns, content, errors_dir)
    results = frame.select(*names).mapInArrow(reader, "result long, piece binary").rdd.mapPartitions(unpickled)
    return checked_reads(results, columns, errors_dir, content)


def read_input(
    sc: SparkContext,
    source: list[str] | DataFrame,
    columns: rec.Columns,
    split_bytes: int,
    errors_dir: str,
    content: record_reading.Content = None,
) -> SparkRecords:
    """The input, its files read in splits (`records.read_records`) or a DataFrame's partitions (`read_frame`)."""
    if isinstance(source, list):
        return read_records(sc, source, columns, split_bytes, errors_dir, content)
    return read_frame(source, columns, errors_dir, content)
