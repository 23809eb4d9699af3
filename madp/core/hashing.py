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


def splitmix64(x: np.ndarray | np.uint64) -> np.ndarray:
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


def id_words(ids: pa.Array | np.ndarray) -> np.ndarray:
    """One uint64 per id: an integer id's two's complement bits, a string id's FNV-1a hash."""
    if isinstance(ids, np.ndarray):
        ids = pa.array(ids)
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    if pa.types.is_integer(ids.type):
        return ids.to_numpy(zero_copy_only=False).astype(np.int64).view(np.uint64)
    return _fnv1a_bytes(ids)


def hash_ids(ids: pa.Array | np.ndarray, seed: int, purpose: int = 0) -> np.ndarray:
    """Seeded uint64 hash of integer or string ids; `purpose` gives independent streams."""
    key = splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ splitmix64(np.uint64(purpose)))
    return splitmix64(id_words(ids) ^ key)


def _rotl(x: np.ndarray, bits: int) -> np.ndarray:
    return (x << np.uint64(bits)) | (x >> np.uint64(64 - bits))


def siphash24(key: tuple[int, int], words: np.ndarray) -> np.ndarray:
    """SipHash-2-4 (Aumasson & Bernstein 2012) of each uint64 as an 8-byte little-endian message,
    under the 128-bit key (k0, k1): a keyed pseudorandom function, so that without the key its
    outputs cannot be predicted from the inputs, however well the rest of the code is known."""
    k0, k1 = (np.uint64(k & 0xFFFFFFFFFFFFFFFF) for k in key)
    m = np.asarray(words, dtype=np.uint64)
    v0 = np.full(m.shape, k0 ^ np.uint64(0x736F6D6570736575))
    v1 = np.full(m.shape, k1 ^ np.uint64(0x646F72616E646F6D))
    v2 = np.full(m.shape, k0 ^ np.uint64(0x6C7967656E657261))
    v3 = np.full(m.shape, k1 ^ np.uint64(0x7465646279746573))

    def rounds(count: int) -> None:
        nonlocal v0, v1, v2, v3
        for _ in range(count):
            v0 = v0 + v1
            v1 = _rotl(v1, 13) ^ v0
            v0 = _rotl(v0, 32)
            v2 = v2 + v3
            v3 = _rotl(v3, 16) ^ v2
            v0 = v0 + v3
            v3 = _rotl(v3, 21) ^ v0
            v2 = v2 + v1
            v1 = _rotl(v1, 17) ^ v2
            v2 = _rotl(v2, 32)

    with np.errstate(over="ignore"):  # additions wrap modulo 2^64 by definition
        final = np.uint64(8 << 56)  # the last block: the message length (8 bytes) in its top byte
        for block in (m, final):
            v3 = v3 ^ block
            rounds(2)
            v0 = v0 ^ block
        v2 = v2 ^ np.uint64(0xFF)
        rounds(4)
    return v0 ^ v1 ^ v2 ^ v3


def partition_of(ids: pa.Array | np.ndarray, num_partitions: int) -> np.ndarray:
    """Stable partition index of each id (independent of any user seed)."""
    return (hash_ids(ids, seed=0, purpose=0xC0FFEE) % np.uint64(num_partitions)).astype(np.int64)
