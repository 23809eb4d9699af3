"""A Spark DataFrame of records as the input of `madp.bound` and `madp.batch` (`runner="pyspark"`): built
from the rows of a Parquet file, with bad rows among them, it selects the same records, byte for byte,
rejects the same rows for the same reasons, and gives the same batch files as the file through
`--runner local`. One SparkSession (local[2]) for the module, the caller's own."""

from __future__ import annotations

import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, graph_rows

import madp
from madp.core.errors import InputError
from madp.spark.session import SparkOptions, spark_session

pytestmark = [pytest.mark.spark]

BAD_REASONS = {"missing_id": 1, "missing_users": 1, "empty_users": 1, "bad_user_type": 1, "duplicate_id": 2}


@pytest.fixture(scope="module")
def spark():
    with spark_session(SparkOptions(master="local[2]", conf=("spark.ui.enabled=false",))) as session:
        yield session


def _users_with_one_not_utf8(users: list[list[str] | None]) -> pa.Array:
    """String user id lists, the first user of the first row's bytes that are not UTF-8 (as a Parquet
    file may hold them): `view` gives a string array without checking its text."""
    lengths = [0 if each is None else len(each) for each in users]
    flat = [user.encode() for each in users if each is not None for user in each]
    flat[0] = b"\xff\xfe"
    offsets = pa.array([0, *pa.array(lengths).to_numpy().cumsum().tolist()], pa.int32())
    values = pa.array(flat, pa.binary()).view(pa.string())
    mask = pa.array([each is None for each in users])
    return pa.ListArray.from_arrays(offsets, values, mask=mask)


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> str:
    """800 records with string user ids and two content columns, in row groups of 100, with a row of each
    bad kind: a null id, null users, an empty users list, a user id that is not text, and an id twice
    (both rows rejected)."""
    from madp.tools.data.synthetic import GraphSpec, generate

    data = generate(GraphSpec(records=800, graph="skewed", records_per_user=3.0, seed=5))
    rows = [{**row, "users": [f"u{user}" for user in row["users"]]} for row in graph_rows(data.offsets, data.users)]
    bad = [["u1", "u2"], *([f"u{n}"] for n in range(3)), [], None, ["u4"]]
    ids = [900_000, None, 900_001, 900_002, 900_003, 900_004, rows[10]["id"]]  # the last one's id repeats
    ids += [row["id"] for row in rows]
    users = _users_with_one_not_utf8([*bad, *(row["users"] for row in rows)])
    table = pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "users": users,
            "label": pa.array([index % 3 for index in range(len(ids))], pa.int64()),
            "text": pa.array([f"text {index}" for index in range(len(ids))]),
        }
    )
    path = str(tmp_path_factory.mktemp("records") / "records.parquet")
    pq.write_table(table, path, row_group_size=100)
    return path


@pytest.fixture(scope="module")
def frame(spark, records):
    """The file's rows as a DataFrame of several partitions (Parquet row groups split among them, in order)."""
    spark.conf.set("spark.sql.files.maxPartitionBytes", "4096")
    try:
        frame = spark.read.parquet(records).persist()
        assert frame.rdd.getNumPartitions() > 1
    finally:
        spark.conf.unset("spark.sql.files.maxPartitionBytes")
    yield frame
    frame.unpersist()


def files_of(directory: str) -> dict[str, bytes]:
    paths = {name: os.path.join(directory, name) for name in sorted(os.listdir(directory))}
    return {name: open(path, "rb").read() for name, path in paths.items() if os.path.isfile(path)}


def test_a_dataframe_bounds_and_batches_as_its_file_does(tmp_path, records, frame):
    options = {"max_contributions": 2, "order": "hash", "seed": 3, "on_invalid": "skip"}
    local = madp.bound(records, str(tmp_path / "local"), **options)
    spark = madp.bound(
        frame, str(tmp_path / "spark"), runner="pyspark", runner_options=["--partitions", "3"], **options
    )
    assert files_of(str(tmp_path / "local" / "selected")) == files_of(str(tmp_path / "spark" / "selected"))
    assert local.rejected == spark.rejected == BAD_REASONS
    assert (local.input_rows, local.graph_digest) == (spark.input_rows, spark.graph_digest)
    assert spark.input == "<DataFrame>"
    rejected = open(tmp_path / "spark" / "rejected" / "rejected.jsonl").read()
    assert '"file": "<DataFrame> partition 0", "row": 1, "reason": "missing_id"' in rejected

    batching = {"steps": 6, "batch_size": 8, "min_sep": 2, "seed": 0, "on_invalid": "skip"}
    madp.batch(str(tmp_path / "local"), records, str(tmp_path / "local-batches"), **batching)
    report = madp.batch(str(tmp_path / "local"), frame, str(tmp_path / "spark-batches"), runner="pyspark", **batching)
    assert report.parameters.content_columns == ("label", "text") and report.data == "<DataFrame>"
    local_files, spark_files = files_of(str(tmp_path / "local-batches")), files_of(str(tmp_path / "spark-batches"))
    assert [name for name in spark_files if name.endswith(".tfrecord")]
    for name in local_files:
        if name.endswith(".tfrecord") or name == "schema.json":
            assert local_files[name] == spark_files[name], name


def test_a_column_of_another_type_is_one_error_naming_it(tmp_path, frame):
    with pytest.raises(InputError, match=r"<DataFrame>: id column 'id' has type double; expected integers"):
        madp.bound(
            frame.withColumn("id", frame.id.cast("double")),
            str(tmp_path / "out"),
            runner="pyspark",
            max_contributions=2,
        )
    with pytest.raises(InputError, match=r"runner='pyspark'"):
        madp.bound(frame, str(tmp_path / "out"), max_contributions=2)


def test_the_spark_page_example_runs(tmp_path, monkeypatch, spark):
    from madp.tools.data.synthetic import GraphSpec, generate, write_dataset

    page = open(os.path.join(ROOT, "docs", "how-to", "spark.md"), encoding="utf-8").read()
    (example,) = [block for block in re.findall(r"```python\n(.*?)```", page, re.DOTALL) if "DataFrame" in block]
    monkeypatch.chdir(tmp_path)
    spec = GraphSpec(records=2000, seed=1)
    write_dataset(generate(spec), spec, str(tmp_path / "records.parquet"), shards=1)
    # Spark's JVM and its Python workers resolve a relative path against their own working folder, which
    # chdir does not move: the example's paths, absolute
    for name in ("records.parquet", "bounded", "batches"):
        example = example.replace(f'"{name}"', repr(str(tmp_path / name)))
    exec(compile(example, "spark.md", "exec"), {"__name__": "example"})
    assert os.path.exists(tmp_path / "batches" / "report.json")


def test_a_partition_is_read_in_pieces_that_cross_the_jvm_and_read_back_as_it_whole(records, monkeypatch):
    from collections import namedtuple

    from madp.core import input_splits, record_reading
    from madp.core import records as rec
    from madp.spark import dataframe

    table = pq.read_table(records)
    content = ("label", "text")
    whole = record_reading.read_parquet_rows(table, rec.dataframe_partition(3), 3, rec.Columns(), content)
    batches = table.to_batches(max_chunksize=13)
    source = rec.dataframe_partition(3)
    pieces = list(input_splits.arrow_pieces(batches, table.schema, source, 3, rec.Columns(), content, 0, 500))
    assert len(pieces) > 10 and sum(p.rows_read for p in pieces) == whole.rows_read == len(table)
    monkeypatch.setattr(dataframe, "CROSSING_BYTES", 1000)  # each piece's pickle in several rows
    Row = namedtuple("Row", ["result", "piece"])
    crossed = [dataframe.pickled(number, piece) for number, piece in enumerate(pieces)]
    rows = [Row(*values) for batch in crossed for values in zip(*batch.to_pydict().values())]
    assert len(rows) > 2 * len(pieces)
    back = list(dataframe.unpickled(rows))
    assert [b.chunk.keys.tolist() for b in back] == [p.chunk.keys.tolist() for p in pieces]
    assert sum((b.chunk.keys.tolist() for b in back), []) == whole.chunk.keys.tolist()
    assert pa.concat_tables([b.chunk.content for b in back]).equals(whole.chunk.content)
    rejects = [(row, why) for b in back for row, why in zip(b.rejects.row, b.rejects.reason)]
    assert rejects == list(zip(whole.rejects.row, whole.rejects.reason)) and len(rejects) == 4
    (empty,) = input_splits.arrow_pieces([], table.schema, source, 3, rec.Columns(), content, 0, 500)
    assert empty.rows_read == 0 and empty.facts.columns == frozenset(table.column_names)
