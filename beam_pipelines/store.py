"""Partition state in files, so that only handles and messages travel through a Beam graph.

Elements of our pipelines are whole columnar partitions. Their arrays are pickled into files under
OUTPUT/_work/ (written and read by our own workers only) and a handle (a path, or for a bulk
exchange a (path, offset, length) slice) travels in their place: 20x faster than shuffling the
arrays on the DirectRunner.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable, Iterable

import numpy as np

from madp import storage


class PartitionStore:
    """Named files of arrays in one directory; a file's name is unique to what wrote it (pipeline
    run, partition, step), so a retried bundle rewrites identical content."""

    def __init__(self, directory: str):
        self.directory = directory

    def write_arrays(self, name: str, arrays: dict) -> str:
        path = storage.join(self.directory, name)
        with storage.open_output(path) as handle:
            handle.write(pickle.dumps(arrays, protocol=pickle.HIGHEST_PROTOCOL))
        return path

    @staticmethod
    def read_arrays(path: str) -> dict:
        with storage.open_input(path) as handle:
            return pickle.loads(handle.read())

    def write_slices(self, name: str, slices: dict[int, object]) -> dict[int, tuple[str, int, int]]:
        """One file per sender for a bulk exchange; each receiver gets (path, offset, length) of its slice."""
        blobs = {
            destination: pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
            for destination, payload in slices.items()
        }
        path, offset, where = storage.join(self.directory, name), 0, {}
        with storage.open_output(path) as handle:
            for destination, blob in blobs.items():
                handle.write(blob)
                where[destination] = (path, offset, len(blob))
                offset += len(blob)
        return where

    @staticmethod
    def read_slice(where: tuple[str, int, int]):
        path, offset, length = where
        with storage.open_input(path) as handle:
            return pickle.loads(handle.read_at(length, offset))

    def write_split(
        self, name: str, destination: np.ndarray, payload: Callable[[np.ndarray], object]
    ) -> list[tuple[int, tuple[str, int, int]]]:
        """Aligned arrays split by destination partition (`payload(mask)` of each) into one file;
        (destination, slice handle) pairs."""
        parts = {int(d): payload(destination == d) for d in np.unique(destination)}
        return list(self.write_slices(name, parts).items()) if parts else []

    def gather(self, handles: Iterable[tuple[str, int, int]]) -> list:
        """The slices sent to a partition, in a fixed order whatever order the runner delivers them in."""
        return [self.read_slice(h) for h in sorted(handles)]


@functools.lru_cache(maxsize=8)
def read_static(path: str) -> dict:
    """Arrays written once and never changed: each worker reads a file's once, read-only."""
    arrays = PartitionStore.read_arrays(path)
    for array in arrays.values():
        array.flags.writeable = False
    return arrays


def stack(pieces: list[tuple], field: int) -> np.ndarray:
    """One array from field `field` of every gathered slice."""
    return np.concatenate([piece[field] for piece in pieces])
