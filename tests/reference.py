"""Straightforward sequential greedy contribution bounding ("It's my data too", Alg. 2 and 3).

An in-process Python reference that shares no code with madp's engines: tests compare the
engines with it, and benchmarks/bound.py times it.
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
