"""The partitioned engines' routing kernels in memory, against sets and dictionaries: partition
bitmasks, the partitions below one, the owning partition, grouping keys by partition, each record's
distinct partitions and their entries, and the store's bulk-exchange slices."""

from __future__ import annotations

import numpy as np
import pytest

from beam_pipelines.store import PartitionStore
from madp.routing import bits_below, csr_rows, distinct_partitions, owned, partition_bits, set_bits, split_by_partition


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
    where = store.write_slices("pairs-00001.pkl", payloads)
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
