"""Routing kernels of the partitioned engines: which partition each message goes to, on numpy arrays.

A record's users may live in several user partitions; a set of partitions is kept per record as a
bitmask of uint64 words (partition p is bit p % 64 of word p // 64), so any number of partitions fits.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def split_by_partition(keys: np.ndarray, partition: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(partition, its keys in their order) for each partition present."""
    order = np.argsort(partition, kind="stable")
    parts, starts = np.unique(partition[order], return_index=True)
    for part, chunk in zip(parts, np.split(keys[order], starts[1:])):
        yield int(part), chunk


def partition_bits(rows: np.ndarray, partitions: np.ndarray, n: int, num_partitions: int) -> np.ndarray:
    """Per row, the set of partitions as a bitmask: n x ceil(P/64) uint64 words."""
    bits = np.zeros((n, (num_partitions + 63) // 64), dtype=np.uint64)
    np.bitwise_or.at(bits, (rows, partitions // 64), np.left_shift(np.uint64(1), (partitions % 64).astype(np.uint64)))
    return bits


def bits_below(partition: int, words: int) -> np.ndarray:
    """Bitmask (one row of words) of the partitions numbered below `partition`."""
    mask = np.zeros(words, dtype=np.uint64)
    mask[: partition // 64] = np.uint64(0xFFFFFFFFFFFFFFFF)
    if partition % 64:
        mask[partition // 64] = np.uint64((1 << (partition % 64)) - 1)
    return mask


def set_bits(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, partition) for every set bit of a bitmask matrix."""
    rows, partitions = [], []
    for word in range(bits.shape[1]):
        values = bits[:, word].copy()
        index = np.flatnonzero(values)
        while len(index):
            lowest = values[index] & (~values[index] + np.uint64(1))
            rows.append(index)
            partitions.append(64 * word + np.log2(lowest.astype(np.float64)).astype(np.int64))
            values[index] ^= lowest
            index = index[values[index] != 0]
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(rows), np.concatenate(partitions)


def owned(bits: np.ndarray, partition: int) -> np.ndarray:
    """Per row, whether no partition below `partition` is in its set: of the partitions holding a
    row, only the lowest one counts it."""
    return ~np.any(bits & bits_below(partition, bits.shape[1]), axis=1)


def distinct_partitions(arity: np.ndarray, partition: np.ndarray, num_partitions: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR (offsets, partitions) of the distinct partitions among each record's users, ascending;
    `partition` has one entry per incidence, records in order, `arity` incidences each."""
    n = len(arity)
    pairs = np.sort(np.repeat(np.arange(n), arity) * num_partitions + partition)
    # Sort and mask: numpy 2's hash-based np.unique is ~25x slower on these many distinct values.
    pairs = pairs[np.concatenate([[True], pairs[1:] != pairs[:-1]])[: len(pairs)]]  # a record may have no users
    offsets = np.concatenate([[0], np.cumsum(np.bincount(pairs // num_partitions, minlength=n))]).astype(np.int64)
    return offsets, pairs % num_partitions


def csr_rows(offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row of each entry, entry position) for the entries of the given CSR rows, rows in their order."""
    counts = np.diff(offsets)[rows]
    positions = np.repeat(offsets[rows], counts) + (
        np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    )
    return np.repeat(rows, counts), positions
