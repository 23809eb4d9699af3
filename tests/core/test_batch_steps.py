"""The per-partition steps of the batching (`madp.core.batch_steps`, `batching.join_partition`) on a
small graph cut into record and user partitions, routed by hand as a runner would: each step's
messages reach the partitions they name, and the partitions' results add up to what the local
engine's whole-graph kernels give."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from madp.core import batch_steps, input_splits, record_reading, sampling
from madp.core import records as rec
from madp.core.batch_files import Feature, WrittenFile, file_rows
from madp.core.errors import InputError
from madp.core.hashing import partition_of
from madp.engines.batch_report import participation_of, participation_stats
from madp.engines.batching import BatchOptions, join_partition, record_hashes, user_hashes

PARTITIONS = 3


def graph(records: int = 40, seed: int = 5) -> rec.RecordChunk:
    """A random multi-attribution graph: record i's users among 12, one to three each, a float content column."""
    rng = np.random.default_rng(seed)
    arity = rng.integers(1, 4, records)
    users = [rng.choice(12, size=a, replace=False).tolist() for a in arity]
    return rec.RecordChunk(
        keys=np.arange(records, dtype=np.int64),
        ids=pa.array(np.arange(100, 100 + records, dtype=np.int64)),
        offsets=np.concatenate([[0], np.cumsum(arity)]).astype(np.int64),
        users=pa.array([u for record in users for u in record], pa.int64()),
        weights=None,
        sources={0: "records.jsonl"},
        content=pa.table({"x": rng.random(records)}),
    )


def grouped(routed) -> dict[int, list]:
    """(partition, message) pairs gathered by partition, as a GroupByKey gives them."""
    by_partition: dict[int, list] = {}
    for part, message in routed:
        by_partition.setdefault(part, []).append(message)
    return by_partition


def whole(chunk: rec.RecordChunk, copies: np.ndarray, options: BatchOptions) -> batch_steps.JoinedPartition:
    """The whole graph as one joined partition, as the local engine holds it."""
    return batch_steps.JoinedPartition(
        chunk.ids,
        copies,
        chunk.offsets,
        user_hashes(chunk.users, options.key),
        chunk.content,
        record_hashes(chunk.ids, options.key),
        np.ones(len(copies), dtype=bool),
    )


@pytest.fixture
def joined():
    """(the whole graph joined as one partition, each record partition's join_partition result, options)."""
    options = BatchOptions(steps=6, batch_size=4, min_sep=2, seed=11)
    chunk = graph()
    copies = (np.arange(len(chunk)) % 3 + 1).astype(np.int64)
    table = pa.table({"id": chunk.ids, "copies": copies})
    selection = grouped(batch_steps.split_selection(0, table, PARTITIONS))
    parts = {
        part: join_partition(records, selection[part], options, "DATA", PARTITIONS)
        for part, records in rec.by_record_partition(chunk, PARTITIONS)
    }
    return whole(chunk, copies, options), parts, options


def test_the_selection_and_the_records_go_to_the_partition_of_their_id():
    chunk = graph()
    table = pa.table({"id": chunk.ids, "copies": np.ones(len(chunk), np.int64)})
    for part, selected in batch_steps.split_selection("shard.parquet", table, PARTITIONS):
        assert (partition_of(selected.ids, PARTITIONS) == part).all()
    for part, records in rec.by_record_partition(chunk, PARTITIONS):
        assert (partition_of(records.ids, PARTITIONS) == part).all()
        assert (np.diff(records.keys) > 0).all()  # in chunk order
    assert sum(len(r) for _, r in rec.by_record_partition(chunk, PARTITIONS)) == len(chunk)
    with pytest.raises(InputError, match="selection shard 4"):
        batch_steps.split_selection(4, pa.table({"id": [1]}), PARTITIONS)


def test_the_join_keys_each_partition_and_sends_its_incidences_to_their_users_partitions(joined):
    everything, parts, _ = joined
    assert sum(p.records for p in parts.values()) == len(everything.copies)
    assert {p.id_type for p in parts.values()} == {pa.int64()}
    assert all(p.content == {"x": Feature("x", "float", ())} for p in parts.values())
    incidences = [i for p in parts.values() for _, i in p.incidences]
    assert sum(len(i.users) for i in incidences) == len(everything.users)
    for part, message in (routed for p in parts.values() for routed in p.incidences):
        assert (batch_steps.user_partition_of(message.users, PARTITIONS) == part).all()
    with pytest.raises(InputError, match="2 selected ids are not valid records of DATA"):
        selected = batch_steps.SelectedIds(pa.array([1, 2]), np.ones(2, np.int64))
        join_partition(None, [selected], BatchOptions(steps=1, batch_size=1), "DATA", PARTITIONS)


def test_the_partitions_neighbourhood_histograms_add_up_to_the_whole_graphs(joined):
    everything, parts, _ = joined
    by_user = grouped(routed for p in parts.values() for routed in p.incidences)
    pairs = grouped(
        routed for pieces in by_user.values() for routed in batch_steps.neighbour_pairs_by_record(pieces, PARTITIONS)
    )
    merged: dict[int, int] = {}
    for part, pieces in pairs.items():
        assert all((batch_steps.record_partition_of(p.owners, PARTITIONS) == part).all() for p in pieces)
        for size, units in batch_steps.neighbourhood_histogram(pieces).items():
            merged[size] = merged.get(size, 0) + units
    record_of_incidence = np.repeat(np.arange(len(everything.copies)), np.diff(everything.offsets))
    sizes = sampling.neighbourhood_sizes(record_of_incidence, everything.users, everything.copies)
    record_of_unit, _ = sampling.unit_keys(everything.record_keys, everything.copies)
    expected = sampling.size_histogram(sizes[record_of_unit])
    assert [a.tolist() for a in batch_steps.histogram_arrays(merged)] == [a.tolist() for a in expected]


def test_sampling_exclusion_and_survivors_by_partition_are_the_whole_graphs(joined):
    everything, parts, options = joined
    probability, steps = 0.3, options.sampled_steps
    sampled = {
        part: batch_steps.sample_partition(part, batch_steps.units_of(p.joined), probability, steps, PARTITIONS)
        for part, p in parts.items()
    }
    by_user = grouped(routed for s in sampled.values() for routed in reversed(s.incidences))
    excluded = grouped(routed for pieces in by_user.values() for routed in batch_steps.block_users(pieces, 2))
    rows = set()
    for part, p in parts.items():
        kept = batch_steps.survivors(p.joined, sampled[part].samples, excluded.get(part, []), 1, options.steps, 2)
        assert kept.excluded == len(np.unique(np.concatenate([np.zeros(0, np.int64), *excluded.get(part, [])])))
        assert kept.sampled_sizes.sum() == sampled[part].sampled_unit_steps - kept.excluded
        for file in range(2):
            written = batch_steps.rows_of_file(p.joined, kept.written, file)
            assert set(np.unique(written.steps // 3).tolist()) <= {file}
            rows |= set(zip(written.record_keys.tolist(), written.unit_keys.tolist(), written.steps.tolist()))
    # the whole graph, as the local engine samples it
    record_of_unit, keys = sampling.unit_keys(everything.record_keys, everything.copies)
    samples = batch_steps.sampled_units(record_of_unit, keys, probability, steps)
    users, user_steps, owner = batch_steps.sample_incidences(everything.offsets, everything.users, samples)
    survive = ~sampling.excluded_samples(owner, sampling.blocked_user_steps(users, user_steps, 2), len(samples.step))
    survivors = batch_steps.Samples(samples.record[survive], samples.keys[survive], samples.step[survive])
    written = batch_steps.written_samples(everything.valid, survivors, 1, options.steps, 2)
    expected = set(zip(everything.record_keys[written.record].tolist(), written.keys.tolist(), written.step.tolist()))
    assert rows == expected and rows


def test_rows_of_records_with_invalid_content_are_left_out_after_warm_up():
    valid = np.array([True, False, True])
    samples = batch_steps.Samples(np.array([0, 1, 2, 2]), np.array([5, 6, 7, 8], np.uint64), np.array([0, 1, 1, 4]))
    written = batch_steps.written_samples(valid, samples, 1, 4, 2)
    assert written.record.tolist() == [2, 2] and written.step.tolist() == [0, 3] and written.file.tolist() == [0, 1]


def test_a_files_rows_gather_in_partition_order_whatever_order_they_came_in():
    def rows(first: int, users: list[list[int]]):
        offsets = np.concatenate([[0], np.cumsum([len(u) for u in users])]).astype(np.int64)
        n = len(users)
        return file_rows(
            pa.array(range(first, first + n)),
            pa.table({"x": list(range(n))}),
            offsets,
            np.array([u for record in users for u in record], np.uint64),
            np.arange(first, first + n, dtype=np.uint64),
            np.arange(n),
            np.arange(n, dtype=np.uint64),
            np.zeros(n, np.int64),
        )

    gathered = batch_steps.gathered_file_rows([(2, rows(20, [[3]])), (0, rows(0, [[1, 2], [4]]))])
    assert gathered.ids.to_pylist() == [0, 1, 20]
    assert gathered.user_offsets.tolist() == [0, 2, 3, 4] and gathered.users.tolist() == [1, 2, 4, 3]


def test_the_content_description_merges_over_the_partitions_that_write_rows():
    fixed, longer = Feature("v", "float", (2,)), Feature("v", "float", (3,))
    assert batch_steps.merged_content([(1, {"v": fixed}), (2, {"v": longer})]) == {"v": Feature("v", "float", (None,))}
    assert batch_steps.merged_content([(0, {"v": longer}), (2, {"v": fixed})]) == {"v": fixed}
    with pytest.raises(InputError, match="content column 'v' is float in some records and int in others"):
        batch_steps.merged_content([(1, {"v": fixed}), (1, {"v": Feature("v", "int", (2,))})])


def test_what_was_written_is_counted_once_per_user_and_record_over_the_files():
    users = np.array([1, 2, 1, 7], np.uint64)
    steps = np.array([0, 0, 3, 3])
    records = np.array([10, 11, 10], np.uint64)
    routed = [batch_steps.written_by_partition(WrittenFile(None, users, steps, records), PARTITIONS)] * 2
    by_user = grouped(pair for r in routed for pair in r.users)
    by_record = grouped(pair for r in routed for pair in r.records)
    assert sum(participation_of(p).users for p in by_user.values()) == participation_stats(users, steps).users == 3
    assert sum(batch_steps.written_record_count(keys) for keys in by_record.values()) == 2


def test_a_split_reads_as_its_part_of_the_whole_file(tmp_path):
    path = str(tmp_path / "r.jsonl")
    lines = [b'{"id": %d, "users": [%d]}' % (i, i % 4) for i in range(30)]
    open(path, "wb").write(b"\n".join(lines) + b"\n")
    data = open(path, "rb").read()
    splits = input_splits.jsonl_splits(0, path, len(data), 100)
    counts = dict(
        input_splits.row_count(s, input_splits.range_bytes(open(path, "rb"), s.start, s.stop))
        for s in splits
        if s.counted
    )
    before = input_splits.first_rows(counts)
    keys = []
    for split in splits:
        first_row = input_splits.first_row(split, before)
        for piece in input_splits.read_planned_pieces(split, rec.Columns(), None, first_row, input_splits.STORAGE, 40):
            keys += piece.chunk.keys.tolist()
    assert keys == record_reading.read_file(path, 0, rec.Columns()).chunk.keys.tolist()
    chunk = record_reading.read_row_chunk(3, list(reversed(lines)), rec.Columns())
    assert chunk.chunk.ids.to_pylist() == sorted(range(30), key=lambda i: lines[i])
