"""Counter-based, seeded 64-bit hashing of ids: the only source of randomness in bounding.

Every random choice is a pure function of (seed, id, purpose), so re-runs, re-shardings
and Beam bundle retries give identical results.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer (Steele et al. 2014): a bijection on uint64 with full avalanche."""
    with np.errstate(over="ignore"):  # wrap-around multiplication is the point
        z = np.asarray(x, dtype=np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _fnv1a_bytes(values: pa.Array) -> np.ndarray:
    """FNV-1a over each value's UTF-8 bytes, vectorized across values one byte position at a time."""
    binary = pc.cast(values, pa.large_binary())
    if binary.null_count:
        raise ValueError("cannot hash null ids")
    offsets = np.frombuffer(binary.buffers()[1], dtype=np.int64)[binary.offset : binary.offset + len(binary) + 1]
    data_buffer = binary.buffers()[2]
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.zeros(0, np.uint8)
    starts, lengths = offsets[:-1], np.diff(offsets)
    h = np.full(len(binary), _FNV_OFFSET, dtype=np.uint64)
    for position in range(int(lengths.max()) if len(lengths) else 0):
        active = np.flatnonzero(lengths > position)
        h[active] = (h[active] ^ data[starts[active] + position].astype(np.uint64)) * _FNV_PRIME
    return h


def hash_ids(ids: pa.Array | np.ndarray, seed: int, purpose: int = 0) -> np.ndarray:
    """Seeded uint64 hash of integer or string ids; `purpose` gives independent streams."""
    if isinstance(ids, np.ndarray):
        ids = pa.array(ids)
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    if pa.types.is_integer(ids.type):
        base = ids.to_numpy(zero_copy_only=False).astype(np.int64).view(np.uint64)
    else:
        base = _fnv1a_bytes(ids)
    key = splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ splitmix64(np.uint64(purpose)))
    return splitmix64(base ^ key)


def partition_of(ids: pa.Array | np.ndarray, num_partitions: int) -> np.ndarray:
    """Stable partition index of each id (independent of any user seed)."""
    return (hash_ids(ids, seed=0, purpose=0xC0FFEE) % np.uint64(num_partitions)).astype(np.int64)
