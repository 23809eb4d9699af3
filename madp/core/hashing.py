"""64-bit hashing of ids: seeded, public hashes (the only source of randomness in bounding), and
SipHash-2-4, the keyed pseudorandom function that batch sampling keys come from.

Every random choice is a pure function of (seed or key, id, purpose), so re-runs, re-shardings
and Beam bundle retries give identical results. The public hashes (`hash_ids`, `partition_of`)
pre-hash a string id with unkeyed FNV-1a, so anyone can make two ids collide: they are for choices
that privacy does not rest on. Sampling keys hash each whole id under the key (`siphash24_bytes`).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from numba import njit, uint64

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


def splitmix64(x: np.ndarray | np.uint64 | int, out: np.ndarray | None = None) -> np.ndarray:
    """SplitMix64 finalizer (Steele et al. 2014): a bijection on uint64 with full avalanche, wrapping
    modulo 2^64. In place on its result (or on `out`, which may be `x` itself) with one temporary: a
    partition's hashes take two arrays of its length, not one per operation. Plain numpy, not a
    compiled kernel: the first compiled call loads LLVM into the worker (about 90 MB)."""
    values = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):  # wrap-around addition and multiplication are the point
        z = np.add(values, _GOLDEN, out=np.empty_like(values) if out is None else out)
        shifted = np.empty_like(z)
        for shift, multiplier in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            np.right_shift(z, np.uint64(shift), out=shifted)
            np.bitwise_xor(z, shifted, out=z)
            np.multiply(z, np.uint64(multiplier), out=z)
        np.right_shift(z, np.uint64(31), out=shifted)
        np.bitwise_xor(z, shifted, out=z)
    return z if z.ndim else z[()]  # a scalar for a scalar


def _binary_buffers(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, data) of each value's bytes (UTF-8 for strings): value i is data[offsets[i]:offsets[i + 1]]."""
    binary = pc.cast(values, pa.large_binary())
    if binary.null_count:
        raise ValueError("cannot hash null ids")
    offsets = np.frombuffer(binary.buffers()[1], dtype=np.int64)[binary.offset : binary.offset + len(binary) + 1]
    data_buffer = binary.buffers()[2]
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.zeros(0, np.uint8)
    return offsets, data


@njit(cache=True, nogil=True)
def _fnv1a_kernel(offsets: np.ndarray, data: np.ndarray, out: np.ndarray) -> None:
    """FNV-1a 64 (Fowler, Noll, Vo) of data[offsets[i]:offsets[i + 1]] into out[i]: one pass over the bytes."""
    for i in range(out.shape[0]):
        h = _FNV_OFFSET
        for position in range(offsets[i], offsets[i + 1]):
            h = (h ^ uint64(data[position])) * _FNV_PRIME
        out[i] = h


def _fnv1a_bytes(values: pa.Array) -> np.ndarray:
    """FNV-1a over each value's UTF-8 bytes: unkeyed, so never a sampling key (anyone can make two
    strings collide); a fixed, public spreading of ids for tie-breaks and partitions."""
    offsets, data = _binary_buffers(values)
    out = np.empty(len(offsets) - 1, dtype=np.uint64)
    _fnv1a_kernel(offsets, data, out)
    return out


def _as_array(ids: pa.Array | pa.ChunkedArray | np.ndarray) -> pa.Array:
    if isinstance(ids, np.ndarray):
        ids = pa.array(ids)
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    return ids


def id_words(ids: pa.Array | np.ndarray) -> np.ndarray:
    """One uint64 per id, in a new array: an integer id's two's complement bits, a string id's
    (unkeyed) FNV-1a hash."""
    ids = _as_array(ids)
    if pa.types.is_integer(ids.type):
        return ids.to_numpy(zero_copy_only=False).astype(np.int64).view(np.uint64)
    return _fnv1a_bytes(ids)


def hash_ids(ids: pa.Array | np.ndarray, seed: int, purpose: int = 0) -> np.ndarray:
    """Seeded uint64 hash of integer or string ids; `purpose` gives independent streams."""
    key = splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ splitmix64(np.uint64(purpose)))
    words = id_words(ids)
    np.bitwise_xor(words, key, out=words)
    return splitmix64(words, out=words)


def siphash24(key: tuple[int, int], words: np.ndarray) -> np.ndarray:
    """SipHash-2-4 (Aumasson & Bernstein 2012) of each uint64 as an 8-byte little-endian message,
    under the 128-bit key (k0, k1): a keyed pseudorandom function, so that without the key its
    outputs cannot be predicted from the inputs, however well the rest of the code is known. The same
    kernel as `siphash24_bytes`, over each word's 8 bytes."""
    m = np.ascontiguousarray(words, dtype="<u8")
    flat = m.reshape(-1)
    out = np.empty(len(flat), dtype=np.uint64)
    _siphash24_kernel(*_key_words(key), np.arange(0, 8 * len(flat) + 1, 8, dtype=np.int64), flat.view(np.uint8), out)
    return out.reshape(m.shape)


def _key_words(key: tuple[int, int]) -> tuple[np.uint64, np.uint64]:
    return np.uint64(key[0] & 0xFFFFFFFFFFFFFFFF), np.uint64(key[1] & 0xFFFFFFFFFFFFFFFF)


@njit(inline="always", cache=True)
def _sipround(v0, v1, v2, v3):
    """One SipRound (the paper's Figure 2); additions wrap modulo 2^64."""
    v0 += v1
    v1 = ((v1 << uint64(13)) | (v1 >> uint64(51))) ^ v0
    v0 = (v0 << uint64(32)) | (v0 >> uint64(32))
    v2 += v3
    v3 = ((v3 << uint64(16)) | (v3 >> uint64(48))) ^ v2
    v0 += v3
    v3 = ((v3 << uint64(21)) | (v3 >> uint64(43))) ^ v0
    v2 += v1
    v1 = ((v1 << uint64(17)) | (v1 >> uint64(47))) ^ v2
    v2 = (v2 << uint64(32)) | (v2 >> uint64(32))
    return v0, v1, v2, v3


@njit(cache=True, nogil=True)
def _siphash24_kernel(k0: np.uint64, k1: np.uint64, offsets: np.ndarray, data: np.ndarray, out: np.ndarray) -> None:
    """SipHash-2-4 of the message data[offsets[i]:offsets[i + 1]] into out[i], as specified by
    Aumasson and Bernstein (2012) and its reference implementation: little-endian 8-byte blocks, then
    a last block of the remaining bytes with the message length (mod 256) in its top byte. Linear in
    the bytes: each is read once."""
    for i in range(out.shape[0]):
        start, end = offsets[i], offsets[i + 1]
        v0 = k0 ^ uint64(0x736F6D6570736575)
        v1 = k1 ^ uint64(0x646F72616E646F6D)
        v2 = k0 ^ uint64(0x6C7967656E657261)
        v3 = k1 ^ uint64(0x7465646279746573)
        whole = start + (end - start) // 8 * 8
        for block_start in range(start, whole, 8):
            m = uint64(0)
            for byte in range(8):
                m |= uint64(data[block_start + byte]) << uint64(8 * byte)
            v3 ^= m
            v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
            v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
            v0 ^= m
        m = uint64(end - start) << uint64(56)
        for byte in range(end - whole):
            m |= uint64(data[whole + byte]) << uint64(8 * byte)
        v3 ^= m
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
        v0 ^= m
        v2 ^= uint64(0xFF)
        for _ in range(4):
            v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
        out[i] = v0 ^ v1 ^ v2 ^ v3


def siphash24_bytes(key: tuple[int, int], values: pa.Array | np.ndarray) -> np.ndarray:
    """SipHash-2-4 of each value's whole byte string (a string's UTF-8 bytes) under the 128-bit key
    (k0, k1): the keyed pseudorandom function of `siphash24` over messages of any length, with no
    unkeyed pre-hash, so that no choice of values gives two of them equal outputs more often than
    chance (an unkeyed 64-bit pre-hash would let whoever picks the values make them collide)."""
    offsets, data = _binary_buffers(_as_array(values))
    out = np.empty(len(offsets) - 1, dtype=np.uint64)
    _siphash24_kernel(*_key_words(key), offsets, data, out)
    return out


def partition_of(ids: pa.Array | np.ndarray, num_partitions: int) -> np.ndarray:
    """Stable partition index of each id (independent of any user seed)."""
    return (hash_ids(ids, seed=0, purpose=0xC0FFEE) % np.uint64(num_partitions)).astype(np.int64)
