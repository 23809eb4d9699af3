"""The partitioned engines' routing kernels in memory, against sets and dictionaries: partition
bitmasks, the partitions below one, the owning partition, grouping keys by partition, each record's
distinct partitions and their entries, and the partition store: its bulk-exchange slices, every kind
of value it holds, and files it did not write."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from beam_pipelines.store import MAGIC, PartitionStore, encode
from madp.core.routing import (
    bits_below,
    csr_rows,
    distinct_partitions,
    owned,
    partition_bits,
    set_bits,
    split_by_partition,
)


@pytest.mark.parametrize("num_partitions", [1, 63, 64, 65, 200])
def test_partition_bitmasks_hold_exactly_the_pairs_set(num_partitions):
    """Every (row, partition) pair goes in, repeated pairs once, and comes out again, across word edges."""
    rng = np.random.default_rng(num_partitions)
    rows = rng.integers(0, 40, 600)
    partitions = rng.integers(0, num_partitions, 600)
    edges = np.array([0, 63, 64, 127, 128, num_partitions - 1])
    rows = np.concatenate([rows, np.arange(len(edges))])
    partitions = np.concatenate([partitions, np.minimum(edges, num_partitions - 1)])
    bits = partition_bits(rows, partitions, 40, num_partitions)
    assert bits.shape == (40, (num_partitions + 63) // 64)
    found_rows, found_partitions = set_bits(bits)
    assert sorted(zip(found_rows.tolist(), found_partitions.tolist())) == sorted(
        set(zip(rows.tolist(), partitions.tolist()))
    )


def test_no_bits_give_no_pairs():
    rows, partitions = set_bits(np.zeros((5, 2), np.uint64))
    assert len(rows) == len(partitions) == 0


@pytest.mark.parametrize("num_partitions", [1, 64, 130])
def test_bits_below_a_partition_are_the_partitions_numbered_below_it(num_partitions):
    words = (num_partitions + 63) // 64
    for partition in range(num_partitions):
        below = bits_below(partition, words)
        everyone = partition_bits(np.zeros(num_partitions, np.int64), np.arange(num_partitions), 1, num_partitions)
        _, found = set_bits(everyone & below)
        assert sorted(found.tolist()) == list(range(partition))


def test_split_groups_keys_by_partition_in_their_order():
    rng = np.random.default_rng(3)
    keys = rng.permutation(1000)
    partition = rng.integers(0, 7, 1000)
    groups = dict(split_by_partition(keys, partition))
    assert sorted(groups) == sorted(set(partition.tolist()))
    for part, chunk in groups.items():
        assert chunk.tolist() == keys[partition == part].tolist()


def test_bulk_exchange_slices_read_back_what_each_receiver_was_sent(tmp_path):
    store = PartitionStore(str(tmp_path))
    payloads = {3: {"keys": np.arange(5)}, 0: {"keys": np.array([], np.int64)}, 9: {"keys": np.arange(100, 90, -1)}}
    where = store.write_slices("pairs-00001.store", payloads)
    assert set(where) == set(payloads)
    assert len({path for path, _, _ in where.values()}) == 1  # one file per sender
    for destination, payload in payloads.items():
        assert np.array_equal(store.read_slice(where[destination])["keys"], payload["keys"])


def test_the_owner_of_a_record_is_the_lowest_partition_of_its_users_beyond_64_partitions():
    rng = np.random.default_rng(0)
    rows, partitions = rng.integers(0, 50, 400), rng.integers(0, 130, 400)
    bits = partition_bits(rows, partitions, 50, 130)
    for partition in (0, 1, 63, 64, 65, 129):
        expected = [all(p >= partition for r, p in zip(rows, partitions) if r == row) for row in range(50)]
        assert owned(bits, partition).tolist() == expected


def test_distinct_partitions_of_each_record_and_the_entries_of_chosen_records():
    rng = np.random.default_rng(5)
    arity = rng.integers(0, 6, 300)
    partition = rng.integers(0, 9, arity.sum())
    offsets, partitions = distinct_partitions(arity, partition, 9)
    starts = np.concatenate([[0], np.cumsum(arity)])
    for record in range(300):
        expected = sorted(set(partition[starts[record] : starts[record + 1]].tolist()))
        assert partitions[offsets[record] : offsets[record + 1]].tolist() == expected
    chosen = np.array([7, 3, 250, 3])
    rows, positions = csr_rows(offsets, chosen)
    expected_rows = [r for r in chosen for _ in range(offsets[r], offsets[r + 1])]
    expected_positions = [p for r in chosen for p in range(offsets[r], offsets[r + 1])]
    assert rows.tolist() == expected_rows
    assert positions.tolist() == expected_positions


def test_the_store_gives_back_every_kind_of_value_the_pipelines_write(tmp_path):
    from madp.core.batch_files import FileRows
    from madp.core.records import RecordChunk, Rejects

    rejects = Rejects()
    rejects.add("a.jsonl", 3, "null_user", {"id": 7, "users": [None]})
    chunk = RecordChunk(
        keys=np.array([5, 9], np.int64),
        ids=pa.array(["x", "é"]),
        offsets=np.array([0, 2, 3], np.int64),
        users=pa.array([1, 2, 3]),
        weights=None,
        sources={0: "a.jsonl"},
        content=pa.table({"text": ["hi", "🙂"], "v": pa.array([[1.5, float("nan")], [0.0, 2.0]])}),
    )
    rows = FileRows(
        steps=np.array([0, 1]),
        unit_keys=np.array([1, 2], np.uint64),
        record_keys=np.array([3, 4], np.uint64),
        ids=pa.array([1, 2]),
        content=pa.table({"a": [1, 2]}).select([]),  # no content columns, two rows
        user_offsets=np.array([0, 1, 2]),
        users=np.array([8, 9], np.uint64),
    )
    value = {
        "chunk": chunk,
        "rejects": rejects,
        "rows": rows,
        "bits": np.arange(12, dtype=np.uint64).reshape(4, 3),
        "eligible": np.array([True, False, True]),
        "empty": np.zeros(0, np.int64),
        "histogram": {3: 10, 1: 2},
        "id_type": pa.large_string(),
        "pair": (np.int64(4), None, 2.5, "text", [1, 2]),
    }
    store = PartitionStore(str(tmp_path))
    back = store.read_arrays(store.write_arrays("all.store", value))
    assert back["chunk"].ids.equals(chunk.ids) and back["chunk"].users.equals(chunk.users)
    content = back["chunk"].content
    assert content.schema == chunk.content.schema and repr(content.to_pydict()) == repr(chunk.content.to_pydict())
    assert back["chunk"].sources == {0: "a.jsonl"}
    assert back["chunk"].keys.tolist() == [5, 9] and back["chunk"].weights is None
    assert back["rejects"].to_jsonl() == rejects.to_jsonl()
    assert back["rows"].content.num_rows == 2 and back["rows"].unit_keys.dtype == np.uint64
    assert back["bits"].tolist() == value["bits"].tolist() and back["bits"].dtype == np.uint64
    assert back["eligible"].tolist() == [True, False, True]
    back["eligible"][0] = False  # the steps change state in place: arrays come back writable
    assert back["empty"].dtype == np.int64 and len(back["empty"]) == 0
    assert back["histogram"] == {3: 10, 1: 2} and back["id_type"] == pa.large_string()
    assert back["pair"] == (4, None, 2.5, "text", [1, 2]) and isinstance(back["pair"][0], np.int64)


def test_a_store_file_written_by_someone_else_runs_no_code(tmp_path):
    """Anyone who can write OUTPUT/_work/ could plant a file a worker reads: a pickle there would run
    its code when loaded. The store reads only its own format, and builds only the types it lists."""
    import json
    import pickle
    import struct

    marker = tmp_path / "ran"

    class Plant:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    planted = tmp_path / "records-00000-ids.store"
    planted.write_bytes(pickle.dumps(Plant()))
    with pytest.raises(ValueError, match="not a madp partition store file"):
        PartitionStore.read_arrays(str(planted))
    header = json.dumps({"value": {"dataclass": "Popen", "fields": {}}, "leaves": []}).encode()
    planted.write_bytes(MAGIC + struct.pack("<Q", len(header)) + header)
    with pytest.raises(ValueError, match="unknown entry"):
        PartitionStore.read_arrays(str(planted))
    assert not marker.exists()
    with pytest.raises(TypeError, match="cannot hold a Plant"):
        encode({"x": Plant()})
