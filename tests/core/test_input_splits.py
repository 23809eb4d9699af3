"""One large input file read in splits by many workers gives the rows, row numbers, rejects and
records of the file read whole, and the rules over a whole file hold across its splits."""

from __future__ import annotations

import io
import json
import os
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import write_records

from madp.beam.batch import run_beam as batch_beam
from madp.beam.bound import run_beam as bound_beam
from madp.core import input_splits, record_reading
from madp.core.errors import InputError
from madp.core.input_splits import count_rows, first_row, first_rows, jsonl_splits, parquet_splits, range_bytes
from madp.core.records import Columns
from madp.core.selection import BoundOptions
from madp.engines.batch_local import run_local as batch_local
from madp.engines.batching import BatchOptions
from madp.engines.local_engine import run_local as bound_local

BOM = b"\xef\xbb\xbf"
# Rows by the README's rules at their edges: blank lines, CRLF and lone CR, a BOM past byte 0,
# invalid rows, a row without users, string ids mixed in only through an invalid row.
PIECES = [
    b'{"id":%d,"users":[1,2],"x":1}',
    b'{"id":%d,"users":[3],"x":2.5}',
    b"",
    b" \t ",
    b"\r",
    b"not json %d",
    b'{"id":%d}',
    BOM + b'{"id":%d,"users":[4]}',
    b'{"id":%d,"users":[5]}\r{"id":0}',
    b'{"id":%d,"users":[6],"x":3}\r',
]
RARE = [b'{"id":"s%d","users":[7]}', b'{"id":%d,"users":[8],"x":"s"}', b'{"id":%d,"users":["u"]}']


def hostile_bytes(rng: random.Random, rows: int) -> bytes:
    lines = [rng.choice(RARE if rng.random() < 0.03 else PIECES).replace(b"%d", str(i).encode()) for i in range(rows)]
    data = b"\n".join(lines) + rng.choice([b"", b"\n", b"\r\n"])
    return BOM + data if rng.random() < 0.3 else data


def read_in_splits(data: bytes, split_bytes: int, columns=None, content=None, piece_bytes=None):
    """What the engines' reading does with one file, in process: count, read each range (row by row;
    with `piece_bytes`, in pieces as a worker reads them), check the facts (given in reverse: their
    order must not matter)."""
    columns = columns or Columns()
    splits = jsonl_splits(0, "f.jsonl", len(data), split_bytes)
    counts = {
        (0, s.start): count_rows(range_bytes(io.BytesIO(data), s.start, s.stop), s.start == 0)
        for s in splits
        if s.first_row is None
    }
    before = first_rows(counts)
    in_memory = input_splits.FileAccess(lambda _: io.BytesIO(data))
    results = []
    for split in splits:
        if piece_bytes is not None:
            pieces = input_splits.read_planned_pieces(
                split, columns, content, first_row(split, before), in_memory, piece_bytes
            )
            results.extend(pieces)
            continue
        data_of = range_bytes(io.BytesIO(data), split.start, split.stop) if split.first_row is None else data
        lines = record_reading.jsonl_rows(data_of, split.start == 0)
        results.append(record_reading.read_lines(lines, "f.jsonl", 0, columns, content, first_row(split, before)))
    schema = record_reading.check_facts([r.facts for r in results][::-1], columns, content)
    return results, schema


def whole(data: bytes, columns=None, content=None):
    columns = columns or Columns()
    result = record_reading.read_lines(record_reading.jsonl_rows(data), "f.jsonl", 0, columns, content)
    return result, record_reading.check_facts([result.facts], columns, content)


def test_ranges_hold_every_row_once_numbered_as_in_the_whole_file(monkeypatch):
    monkeypatch.setattr(input_splits, "_BLOCK", 3)  # rows longer than a block read past a range's end
    rng = random.Random(0)
    for _ in range(400):
        data = hostile_bytes(rng, rng.randint(0, 15))
        split_bytes = rng.randint(1, max(1, len(data)))
        expected = record_reading.jsonl_rows(data)
        got: list[bytes] = []
        splits = jsonl_splits(0, "f.jsonl", len(data), split_bytes)
        counts = {
            (0, s.start): count_rows(range_bytes(io.BytesIO(data), s.start, s.stop), s.start == 0) for s in splits
        }
        before = first_rows(counts)
        for split in splits:
            assert first_row(split, before) == len(got)
            got += record_reading.jsonl_rows(range_bytes(io.BytesIO(data), split.start, split.stop), split.start == 0)
        assert got == expected, (data, split_bytes)


@pytest.mark.slow
def test_split_reads_give_the_whole_files_records_rejects_and_rules():
    rng = random.Random(1)
    errors = 0
    for _ in range(150):
        data = hostile_bytes(rng, rng.randint(1, 30))
        split_bytes = rng.randint(1, max(1, len(data)))
        piece_bytes = rng.choice([None, rng.randint(1, max(1, split_bytes))])
        try:
            expected, expected_schema = whole(data, content=("x",))
        except InputError as error:
            errors += 1
            with pytest.raises(InputError, match=r"^f\.jsonl: ") as raised:
                read_in_splits(data, split_bytes, content=("x",), piece_bytes=piece_bytes)
            mixes = ("ids mix", "mixes types")  # two mixes in one file: either may be met first
            if not (any(m in str(error) for m in mixes) and any(m in str(raised.value) for m in mixes)):
                assert str(raised.value) == str(error)
            continue
        results, schema = read_in_splits(data, split_bytes, content=("x",), piece_bytes=piece_bytes)
        assert schema == expected_schema, data
        keys = np.concatenate([r.chunk.keys for r in results])
        assert keys.tolist() == expected.chunk.keys.tolist(), (data, split_bytes)
        assert pa.concat_arrays([r.chunk.ids for r in results if len(r.chunk)] or [expected.chunk.ids]).to_pylist() == (
            expected.chunk.ids.to_pylist()
        )
        content = [record_reading.conform_content(r.chunk, schema).content for r in results if len(r.chunk)]
        if content:
            assert pa.concat_tables(content).equals(expected.chunk.content), data
        rejects = [(f, row, why, rec) for r in results for f, row, why, rec in zip(*vars(r.rejects).values())]
        assert rejects == list(zip(*vars(expected.rejects).values())), data
        assert sum(r.rows_read for r in results) == expected.rows_read
    assert 10 < errors < 100, errors  # both branches, many times


def test_rules_over_a_whole_file_hold_across_its_splits():
    ints, strings = b'{"id":1,"users":[1],"x":1}\n', b'{"id":"a","users":[2],"x":"text"}\n'
    with pytest.raises(InputError, match="^f.jsonl: id ids mix integers and strings"):
        read_in_splits(ints * 50 + strings * 50, 200)
    no_users = b'{"id":1}\n' * 50
    _, schema = read_in_splits(no_users + b'{"id":2,"users":[1]}\n', 100)  # users in one split: rows rejected
    with pytest.raises(InputError, match=r"^f.jsonl: no column \['users'\] in any row"):
        read_in_splits(no_users, 100)
    with pytest.raises(InputError, match="^f.jsonl: content column"):
        read_in_splits(b'{"id":1,"users":[1],"x":1}\n' * 50 + b'{"id":2,"users":[1],"x":"a"}\n', 100, content=("x",))
    with pytest.raises(InputError, match="^f.jsonl: no content column 'y' in any row"):
        read_in_splits(ints * 50, 100, content=("y",))
    floats = b"".join(b'{"id":%d,"users":[1],"x":0.5}\n' % i for i in range(50))
    integers = b"".join(b'{"id":%d,"users":[1],"x":7}\n' % i for i in range(50, 100))
    results, schema = read_in_splits(integers + floats, 100, content=("x",))
    assert schema == pa.schema([("x", pa.float64())]) == whole(integers + floats, content=("x",))[1]


def test_review_findings_read_the_same_whole_and_split():
    # integer weights beyond 2^53 in one split, floats in the next: rounded as Arrow types the whole file
    weights = Columns(weight="w")
    data = b'{"id":0,"users":[1],"w":9007199254740993}\n' + b"".join(
        b'{"id":%d,"users":[2],"w":0.5}\n' % i for i in range(1, 20)
    )
    expected, _ = whole(data, weights)
    results, _ = read_in_splits(data, 42, weights)
    assert np.concatenate([r.chunk.weights for r in results]).tolist() == expected.chunk.weights.tolist()
    assert expected.chunk.weights[0] == 9007199254740992.0
    assert whole(b'{"id":0,"users":[1],"w":9007199254740993}\n', weights)[0].chunk.weights.tolist() == [2.0**53]
    huge = whole(b'{"id":0,"users":[1],"w":%d}\n' % 10**400, weights)[0]
    assert huge.rejects.reason == ["bad_weight"]
    # struct content whose keys differ between splits: the file's order of keys, whatever the facts' order
    structs = b'{"id":0,"users":[1],"x":{"b":1}}\n{"id":1,"users":[1],"x":{"a":2}}\n'
    assert read_in_splits(structs, 33, content=("x",))[1] == whole(structs, content=("x",))[1]
    # an integer beyond 64 bits in content: an error naming the column, not a traceback
    with pytest.raises(InputError, match="^f.jsonl: content column 'x'"):
        whole(b'{"id":0,"users":[1],"x":%d}\n' % 2**64, content=("x",))


class CountingBytes(io.BytesIO):
    read_total = 0

    def read(self, size=-1):
        data = super().read(size)
        CountingBytes.read_total += len(data)
        return data


def test_a_row_spanning_many_ranges_is_read_about_twice_not_once_per_range():
    data = b'{"id":1,"users":[1],"x":"' + b"y" * 200_000 + b'"}\r' * 3 + b"\n"  # CR-only line ends: one row
    splits = jsonl_splits(0, "f.jsonl", len(data), 2048)
    CountingBytes.read_total = 0
    rows = [record_reading.jsonl_rows(range_bytes(CountingBytes(data), s.start, s.stop), s.start == 0) for s in splits]
    assert sum(rows, []) == record_reading.jsonl_rows(data) and len(splits) > 90
    assert CountingBytes.read_total <= 2 * len(data) + 2048


@pytest.mark.beam
def test_a_file_that_changes_while_read_is_an_error(tmp_path):
    from madp.beam import record_chunks

    path = write_records(str(tmp_path / "r.jsonl"), [{"id": i, "users": [i]} for i in range(100)])
    (split, *_) = jsonl_splits(0, path, os.path.getsize(path), 1024)
    with open(path, "a") as handle:
        handle.write('{"id": 100, "users": [1]}\n')
    with pytest.raises(InputError, match="r.jsonl: changed while it was read"):
        input_splits.split_range(split, record_chunks.BEAM_FILES)


def test_parquet_splits_are_runs_of_row_groups_with_their_first_rows():
    groups = [(10, 100), (5, 50), (7, 300), (1, 10)]
    assert parquet_splits(3, "p.parquet", 999, groups, 140) == [
        input_splits.InputSplit(3, "p.parquet", 0, 2, 0, 999),
        input_splits.InputSplit(3, "p.parquet", 2, 3, 15, 999),
        input_splits.InputSplit(3, "p.parquet", 3, 4, 22, 999),
    ]
    assert parquet_splits(0, "p.parquet", 9, [], 140) == [input_splits.InputSplit(0, "p.parquet", 0, 0, 0, 9)]
    assert jsonl_splits(0, "a.jsonl.gz", 10**9, 10) == [input_splits.InputSplit(0, "a.jsonl.gz", 0, 10**9, 0, 10**9)]


def test_a_parquet_split_read_in_pieces_smaller_than_its_row_groups_reads_as_the_whole_file(tmp_path):
    rows = [
        {"id": None if i % 53 == 0 else i, "users": [] if i % 41 == 0 else [i % 7, i % 11], "x": i / 2}
        for i in range(1000)
    ]
    path = str(tmp_path / "p.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=150)
    expected = record_reading.read_file(path, 0, Columns(), ("x",))
    for split_bytes, piece_bytes in [(1, 10**9), (3000, 500), (10**9, 64)]:
        splits = input_splits.plan_splits(0, path, split_bytes, input_splits.STORAGE)
        pieces = [
            piece
            for split in splits
            for piece in input_splits.read_planned_pieces(
                split, Columns(), ("x",), split.first_row, input_splits.STORAGE, piece_bytes
            )
        ]
        assert max(piece.rows_read for piece in pieces) <= (150 if piece_bytes > 10**6 else 60), piece_bytes
        schema = record_reading.check_facts([piece.facts for piece in pieces], Columns(), ("x",))
        assert schema == record_reading.check_facts([expected.facts], Columns(), ("x",))
        assert np.concatenate([p.chunk.keys for p in pieces]).tolist() == expected.chunk.keys.tolist()
        assert pa.concat_tables([p.chunk.content for p in pieces]).equals(expected.chunk.content)
        rejects = [(row, why) for p in pieces for row, why in zip(p.rejects.row, p.rejects.reason)]
        assert rejects == list(zip(expected.rejects.row, expected.rejects.reason)) and len(rejects) == 43
        assert sum(p.rows_read for p in pieces) == expected.rows_read == 1000
    empty = str(tmp_path / "empty.parquet")
    pq.write_table(pa.Table.from_pylist(rows).slice(0, 0), empty)
    (split,) = input_splits.plan_splits(0, empty, 1, input_splits.STORAGE)
    (piece,) = input_splits.read_planned_pieces(split, Columns(), ("x",), 0, input_splits.STORAGE, 64)
    assert piece.rows_read == 0 and piece.facts.columns == frozenset(["id", "users", "x"])


@pytest.fixture
def one_large_file_each(tmp_path, small_graph):
    """A JSON Lines file with hostile rows and a Parquet file of many row groups, in one input."""
    directory = tmp_path / "input"
    directory.mkdir()
    rng = random.Random(2)
    lines = []
    for i, row in enumerate(small_graph[:1500]):
        if i % 97 == 0:
            lines.append("  \r")
        if i % 301 == 0:
            lines.append("not json")
        lines.append(json.dumps(dict(row, x=i if i % 2 else i + 0.5, tag=f"t{i}")) + ("\r" if i % 7 == 0 else ""))
    (directory / "a.jsonl").write_bytes(BOM + "\n".join(lines).encode() + b"\n")
    rest = [dict(row, x=float(rng.random()), tag="p") for row in small_graph[1500:]]
    pq.write_table(pa.Table.from_pylist(rest), directory / "b.parquet", row_group_size=150)
    return str(directory)


@pytest.mark.beam
def test_beam_reads_large_files_in_splits_with_the_local_results(tmp_path, one_large_file_each, monkeypatch):
    monkeypatch.setattr(input_splits, "PIECE_BYTES", 700)  # each split in several pieces (in this process)
    split = ["--direct_running_mode=in_memory", "--partitions=3", "--input-split-bytes=3000"]
    options = BoundOptions(max_contributions=2, on_invalid="skip")
    local = bound_local(one_large_file_each, str(tmp_path / "local"), options)
    beam = bound_beam(one_large_file_each, str(tmp_path / "beam"), options, split)
    for name in ("input_rows", "selected_records", "rejected", "per_round"):
        assert getattr(local, name) == getattr(beam, name), name
    for name in ("selected/part-00000-of-00001.parquet", "rejected/rejected.jsonl"):
        assert (tmp_path / "local" / name).read_bytes() == (tmp_path / "beam" / name).read_bytes(), name
    assert beam.pipeline_runs[0]["beam_counters"]["input_rows"] == local.input_rows
    batch = BatchOptions(seed=0, steps=30, batch_size=25, min_sep=2, on_invalid="skip")
    batch_local(str(tmp_path / "local"), one_large_file_each, str(tmp_path / "b-local"), batch)
    batch_beam(str(tmp_path / "local"), one_large_file_each, str(tmp_path / "b-beam"), batch, split)
    for name in ("batches-00000-of-00001.tfrecord", "schema.json"):
        assert (tmp_path / "b-local" / name).read_bytes() == (tmp_path / "b-beam" / name).read_bytes(), name


@pytest.mark.beam
def test_beam_mixed_id_types_across_files_are_one_clear_error(tmp_path):
    """Found whatever partitions the records fall in (once a traceback, with many partitions)."""
    write_records(str(tmp_path / "a.jsonl"), [{"id": 1, "users": [1]}])
    write_records(str(tmp_path / "b.jsonl"), [{"id": "x", "users": [2]}])
    with pytest.raises(InputError, match=r"^record ids mix integers and strings across input files"):
        bound_beam(str(tmp_path), str(tmp_path / "out"), BoundOptions(max_contributions=1), ["--partitions=64"])


@pytest.mark.beam
def test_the_content_columns_are_found_by_the_reads_not_by_the_driver(tmp_path, small_graph, monkeypatch):
    """Without --content-columns, the Beam driver reads no data file: the splits' reads find the
    columns (one only the last rows of a file have, one in the Parquet file and in the JSON Lines
    file's last rows only; the first splits' rows have only the record's), in order of first
    appearance, and the batches are local's byte for byte."""
    directory = tmp_path / "input"
    directory.mkdir()
    lines = [
        json.dumps(dict(row, **({"x": i} if i >= 200 else {}), **({"late": i * 0.5} if i >= 1400 else {})))
        for i, row in enumerate(small_graph[:1500])
    ]
    (directory / "a.jsonl").write_text("\n".join(lines) + "\n")
    rest = [dict(row, late=0.25, x=1) for row in small_graph[1500:]]
    pq.write_table(pa.Table.from_pylist(rest), directory / "b.parquet", row_group_size=150)
    bound_local(str(directory), str(tmp_path / "bound"), BoundOptions(max_contributions=2))
    options = BatchOptions(seed=0, steps=30, batch_size=25, min_sep=2, on_invalid="skip")  # rows without "late"
    local = batch_local(str(tmp_path / "bound"), str(directory), str(tmp_path / "b-local"), options)
    assert local.parameters.content_columns == ("x", "late")

    def no_driver_read(path):
        raise AssertionError(f"the driver read {path}")

    monkeypatch.setattr(record_reading, "jsonl_lines", no_driver_read)
    split = ["--direct_running_mode=in_memory", "--partitions=3", "--input-split-bytes=3000"]
    beam = batch_beam(str(tmp_path / "bound"), str(directory), str(tmp_path / "b-beam"), options, split)
    assert beam.parameters.content_columns == ("x", "late")
    assert beam.rejected == local.rejected and local.rejected["null_content"] > 0
    for name in ("batches-00000-of-00001.tfrecord", "schema.json", "rejected/rejected.jsonl"):
        assert (tmp_path / "b-local" / name).read_bytes() == (tmp_path / "b-beam" / name).read_bytes(), name


@pytest.mark.beam
def test_a_file_without_a_column_other_files_have_is_named_by_both_engines(tmp_path, small_graph):
    directory = tmp_path / "input"
    directory.mkdir()
    write_records(str(directory / "a.jsonl"), [dict(row, x=1) for row in small_graph[:900]])
    write_records(str(directory / "b.jsonl"), [dict(row, x=1, note="n") for row in small_graph[900:]])
    bound_local(str(directory), str(tmp_path / "bound"), BoundOptions(max_contributions=2))
    options = BatchOptions(seed=0, steps=30, batch_size=25, min_sep=2)
    message = r"a.jsonl: no content column 'note' in any row \(other input files have it: choose the columns"
    with pytest.raises(InputError, match=message):
        batch_local(str(tmp_path / "bound"), str(directory), str(tmp_path / "b-local"), options)
    with pytest.raises(InputError, match=message):
        batch_beam(str(tmp_path / "bound"), str(directory), str(tmp_path / "b-beam"), options, ["--partitions=2"])
    chosen = BatchOptions(seed=0, steps=30, batch_size=25, min_sep=2, content_columns=("x",))
    report = batch_local(str(tmp_path / "bound"), str(directory), str(tmp_path / "b-x"), chosen)
    assert report.parameters.content_columns == ("x",)
