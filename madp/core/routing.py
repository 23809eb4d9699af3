"""Routing kernels of the partitioned engines: which partition each message goes to, on numpy arrays.

A record's users may live in several user partitions; the set of them is kept per record as a CSR
list (offsets, partitions ascending), so any number of partitions fits in arity-many entries.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np


def split_by_partition(keys: np.ndarray, partition: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(partition, its keys in their order) for each partition present."""
    order, parts, bounds = _partition_order(partition)
    for part, chunk in zip(parts, np.split(keys[order], bounds)):
        yield int(part), chunk


def split_rows(destination: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(partition, the row indices sent to it) for each partition in `destination`, rows in order."""
    order, parts, bounds = _partition_order(destination)
    for part, rows in zip(parts, np.split(order, bounds)):
        yield int(part), rows


def _partition_order(partition: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the rows by partition, stable; the partitions present, ascending; where each after the first
    starts in that order)."""
    order = np.argsort(partition, kind="stable")
    ordered = partition[order]
    bounds = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
    return order, ordered[np.concatenate([[0], bounds])] if len(ordered) else ordered, bounds


def distinct_partitions(arity: np.ndarray, partition: np.ndarray, num_partitions: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR (offsets, partitions) of the distinct partitions among each record's users, ascending;
    `partition` has one entry per incidence, records in order, `arity` incidences each."""
    n = len(arity)
    pairs = np.repeat(np.arange(n, dtype=np.int64), arity)
    pairs *= num_partitions
    pairs += partition
    pairs.sort()
    # Sort and mask: numpy 2's hash-based np.unique is ~25x slower on these many distinct values.
    pairs = pairs[np.concatenate([[True], pairs[1:] != pairs[:-1]])[: len(pairs)]]  # a record may have no users
    offsets = np.concatenate([[0], np.cumsum(np.bincount(pairs // num_partitions, minlength=n))]).astype(np.int64)
    return offsets, pairs % num_partitions


def csr_rows(offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row of each entry, entry position) for the entries of the given CSR rows, rows in their order."""
    counts, positions = _entry_positions(offsets, rows)
    return np.repeat(rows, counts), positions


def take_csr(offsets: np.ndarray, values: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The CSR rows `rows` (in that order) of (offsets, values), as a CSR of their own."""
    counts, positions = _entry_positions(offsets, rows)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), values[positions]


def _entry_positions(offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(entries per row, the positions of the rows' entries in order): two arrays of the entries'
    length at most, where a user partition's peers number millions."""
    counts = np.diff(offsets)[rows]
    first = np.cumsum(counts) - counts  # where each row's entries start in the result
    positions = np.arange(int(counts.sum()), dtype=np.int64)
    positions += np.repeat(offsets[rows] - first, counts)
    return counts, positions


def messages_of(grouped: dict[str, list], kind: str) -> np.ndarray:
    """The key arrays of one kind met at a partition (`by_kind`), end to end (none: empty)."""
    return np.concatenate(grouped[kind]) if kind in grouped else np.zeros(0, np.int64)


def by_kind(values: Iterable[tuple[str, Any]]) -> dict[str, list]:
    """A partition's messages, met at their destination tagged (kind, payload), as kind -> [payloads]."""
    grouped: dict[str, list] = {}
    for kind, value in values:
        grouped.setdefault(kind, []).append(value)
    return grouped
