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
    order = np.argsort(partition, kind="stable")
    parts, starts = np.unique(partition[order], return_index=True)
    for part, chunk in zip(parts, np.split(keys[order], starts[1:])):
        yield int(part), chunk


def split_rows(destination: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(partition, the row indices sent to it) for each partition in `destination`, rows in order."""
    return split_by_partition(np.arange(len(destination)), destination)


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


def take_csr(offsets: np.ndarray, values: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The CSR rows `rows` (in that order) of (offsets, values), as a CSR of their own."""
    _, positions = csr_rows(offsets, rows)
    counts = np.diff(offsets)[rows]
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), values[positions]


def messages_of(grouped: dict[str, list], kind: str) -> np.ndarray:
    """The key arrays of one kind met at a partition (`by_kind`), end to end (none: empty)."""
    return np.concatenate(grouped[kind]) if kind in grouped else np.zeros(0, np.int64)


def by_kind(values: Iterable[tuple[str, Any]]) -> dict[str, list]:
    """A partition's messages, met at their destination tagged (kind, payload), as kind -> [payloads]."""
    grouped: dict[str, list] = {}
    for kind, value in values:
        grouped.setdefault(kind, []).append(value)
    return grouped
