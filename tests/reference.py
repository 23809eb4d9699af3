"""References in plain Python that share no code with madp: the sequential greedy contribution
bounding ("It's my data too", Alg. 2 and 3), which tests compare the engines with and
benchmarks/bound.py times; and SipHash-2-4, which tests compare the keyed hashes with.
"""

from __future__ import annotations


def sequential_greedy(
    order: list[int], record_users: list[list], capacity: dict, default: int, duplicates: bool = False
) -> list[int]:
    """Copies per record: one pass in `order` (Alg. 2); with duplicates, passes until one adds nothing (Alg. 3)."""
    used: dict = {}
    copies = [0] * len(record_users)
    while True:
        added = 0
        for r in order:
            users = record_users[r]
            if all(used.get(u, 0) < capacity.get(u, default) for u in users):
                for u in users:
                    used[u] = used.get(u, 0) + 1
                copies[r] += 1
                added += 1
        if not duplicates or added == 0:
            return copies


_MASK = (1 << 64) - 1


def reference_siphash24(key: tuple[int, int], message: bytes) -> int:
    """SipHash-2-4 of a message of any length, written from the paper with Python integers."""
    rotl = lambda x, b: ((x << b) | (x >> (64 - b))) & _MASK  # noqa: E731
    v = [key[0] ^ 0x736F6D6570736575, key[1] ^ 0x646F72616E646F6D, key[0] ^ 0x6C7967656E657261]
    v.append(key[1] ^ 0x7465646279746573)

    def sipround():
        v[0] = (v[0] + v[1]) & _MASK
        v[1] = rotl(v[1], 13) ^ v[0]
        v[0] = rotl(v[0], 32)
        v[2] = (v[2] + v[3]) & _MASK
        v[3] = rotl(v[3], 16) ^ v[2]
        v[0] = (v[0] + v[3]) & _MASK
        v[3] = rotl(v[3], 21) ^ v[0]
        v[2] = (v[2] + v[1]) & _MASK
        v[1] = rotl(v[1], 17) ^ v[2]
        v[2] = rotl(v[2], 32)

    whole = len(message) // 8 * 8
    blocks = [int.from_bytes(message[i : i + 8], "little") for i in range(0, whole, 8)]
    blocks.append(int.from_bytes(message[whole:], "little") | ((len(message) & 0xFF) << 56))
    for block in blocks:
        v[3] ^= block
        sipround()
        sipround()
        v[0] ^= block
    v[2] ^= 0xFF
    for _ in range(4):
        sipround()
    return v[0] ^ v[1] ^ v[2] ^ v[3]
