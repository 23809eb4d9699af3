"""Items partitioned by a hash of a key (a record id, a user) into buckets on disk, under a temporary folder,
so that a verifier holds one bucket at a time whatever the input's size; and how many buckets an input
needs."""

from __future__ import annotations

import os
import pickle
from collections.abc import Hashable, Iterator

# Input bytes per bucket: the ids and users of 128 MiB of records, as Python objects, fit in about 1 GiB.
_INPUT_BYTES_PER_BUCKET = 128 << 20
_HELD_ITEMS = 1 << 18  # items held in memory over all buckets before they are written


def _bucket_count(paths: list[str], asked: int | None) -> int:
    """The buckets to partition an input of these files into: `asked` where given, else one per
    _INPUT_BYTES_PER_BUCKET of the files (at least one)."""
    if asked is not None:
        if asked < 1:
            raise ValueError(f"--buckets must be at least 1, not {asked}")
        return asked
    size = sum(os.path.getsize(path) for path in paths if os.path.isfile(path))
    return max(1, -(-size // _INPUT_BYTES_PER_BUCKET))


class _Buckets:
    """Items put in the bucket of their key (Python's hash of it, the same within this process), read back
    a bucket at a time in the order they were put. One bucket stays in memory; several go to pickle files
    in `folder`, each written a few items at a time."""

    def __init__(self, count: int, folder: str, name: str):
        self.count = count
        self.paths = [os.path.join(folder, f"{name}-{bucket}.pickle") for bucket in range(count)]
        self.held: list[list] = [[] for _ in range(count)]
        self.written_at = max(1, _HELD_ITEMS // count)

    def put(self, key: Hashable, item: object) -> None:
        bucket = hash(key) % self.count
        held = self.held[bucket]
        held.append(item)
        if self.count > 1 and len(held) >= self.written_at:
            self._write(bucket)

    def _write(self, bucket: int) -> None:
        with open(self.paths[bucket], "ab") as handle:
            pickle.dump(self.held[bucket], handle, protocol=pickle.HIGHEST_PROTOCOL)
        self.held[bucket] = []

    def items(self, bucket: int) -> Iterator:
        """The items of a bucket in the order put (read again, the same)."""
        if os.path.exists(self.paths[bucket]):
            with open(self.paths[bucket], "rb") as handle:
                while True:
                    try:
                        yield from pickle.load(handle)
                    except EOFError:
                        break
        yield from self.held[bucket]
