"""The Beam bounding pipeline's routing kernels in memory, against sets and dictionaries: partition
bitmasks, the partitions below one, grouping keys by partition, and the bulk-exchange slices."""

from __future__ import annotations

import numpy as np
import pytest

from beam_pipelines.bound import PartitionStore, _bits_below, _partition_bits, _set_bits, _split


@pytest.mark.parametrize("num_partitions", [1, 63, 64, 65, 200])
def test_partition_bitmasks_hold_exactly_the_pairs_set(num_partitions):
    """Every (row, partition) pair goes in, repeated pairs once, and comes out again, across word edges."""
    rng = np.random.default_rng(num_partitions)
    rows = rng.integers(0, 40, 600)
    partitions = rng.integers(0, num_partitions, 600)
    edges = np.array([0, 63, 64, 127, 128, num_partitions - 1])
    rows = np.concatenate([rows, np.arange(len(edges))])
    partitions = np.concatenate([partitions, np.minimum(edges, num_partitions - 1)])
    bits = _partition_bits(rows, partitions, 40, num_partitions)
    assert bits.shape == (40, (num_partitions + 63) // 64)
    found_rows, found_partitions = _set_bits(bits)
    assert sorted(zip(found_rows.tolist(), found_partitions.tolist())) == sorted(
        set(zip(rows.tolist(), partitions.tolist()))
    )


def test_no_bits_give_no_pairs():
    rows, partitions = _set_bits(np.zeros((5, 2), np.uint64))
    assert len(rows) == len(partitions) == 0


@pytest.mark.parametrize("num_partitions", [1, 64, 130])
def test_bits_below_a_partition_are_the_partitions_numbered_below_it(num_partitions):
    words = (num_partitions + 63) // 64
    for partition in range(num_partitions):
        below = _bits_below(partition, words)
        everyone = _partition_bits(np.zeros(num_partitions, np.int64), np.arange(num_partitions), 1, num_partitions)
        _, found = _set_bits(everyone & below)
        assert sorted(found.tolist()) == list(range(partition))


def test_split_groups_keys_by_partition_in_their_order():
    rng = np.random.default_rng(3)
    keys = rng.permutation(1000)
    partition = rng.integers(0, 7, 1000)
    groups = dict(_split(keys, partition))
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
