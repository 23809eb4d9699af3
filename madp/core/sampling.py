"""Kernels of batch formation on numpy arrays: b-min-sep Poisson subsampling (b-min-sep paper,
Alg. 3, in a fully parallel form with no loop over steps: per-unit sampled steps, then per-user
exclusion by sorting (user, step)), its sampling-probability calibration,
truncation/padding (App. D), and the deterministic min-sep greedy (It's my data too, Alg. 4).

A *unit* is one copy of a selected record: a record selected with c copies is c units. Units are
identified by a 64-bit key (seeded hash of the record id and copy index); users by a 64-bit hash
of the user id. Both engines call these functions, so they form identical batches.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from madp.core.errors import InputError
from madp.core.hashing import splitmix64

_DRAW_STREAM = np.uint64(0xD1B54A32D192ED03)
_TRUNCATION_STREAM = np.uint64(0x8CB92BA72F3D8DD7)


def expand_ranges(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner, index) for every index in starts[owner] .. starts[owner] + counts[owner] - 1, owners in order."""
    owner = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    within = np.arange(len(owner), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, np.repeat(np.asarray(starts, dtype=np.int64), counts) + within


def unit_keys(record_hashes: np.ndarray, copies: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(record index, unit key) of every copy of every record, copies of a record adjacent."""
    record, copy_index = expand_ranges(np.zeros(len(copies), dtype=np.int64), copies)
    return record, splitmix64(record_hashes[record] ^ splitmix64(copy_index.astype(np.uint64)))


def _uniform(keys: np.ndarray, counter: np.ndarray | int, stream: np.uint64) -> np.ndarray:
    """Counter-based uniform in (0, 1]: a pure function of (unit key, counter, stream)."""
    bits = splitmix64(keys ^ splitmix64(np.asarray(counter, dtype=np.uint64) ^ stream))
    return ((bits >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53


def sampled_steps(keys: np.ndarray, probability: float, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Alg. 3 line 3 for all steps at once: (unit index, step) of every Bernoulli(p) success.

    Successive successes of a unit are geometric gaps; the j-th gap of a unit is drawn from the
    counter-based generator at (unit key, j), so a unit's steps do not depend on other units.
    """
    if probability <= 0.0 or steps <= 0 or len(keys) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if probability >= 1.0:
        return np.repeat(np.arange(len(keys)), steps), np.tile(np.arange(steps), len(keys))
    log_miss = np.log1p(-probability)
    position = np.full(len(keys), -1, dtype=np.int64)
    active = np.arange(len(keys), dtype=np.int64)
    found_units, found_steps = [], []
    draw = 0
    while len(active):
        gap = np.floor(np.log(_uniform(keys[active], draw, _DRAW_STREAM)) / log_miss)
        position[active] += 1 + np.minimum(gap, steps).astype(np.int64)
        active = active[position[active] < steps]
        found_units.append(active)
        found_steps.append(position[active])
        draw += 1
    return np.concatenate(found_units), np.concatenate(found_steps)


def blocked_user_steps(user_hashes: np.ndarray, steps: np.ndarray, min_sep: int) -> np.ndarray:
    """Alg. 3 line 4, per (user, step) incidence of a sample: True when the user has a sampled
    step t' with step - min_sep < t' < step (samples at the same step do not block each other).

    Only the user's nearest earlier distinct sampled step matters, so one sort suffices.
    """
    if len(steps) == 0:
        return np.zeros(0, dtype=bool)
    order = np.lexsort((steps, user_hashes))
    user, step = user_hashes[order], steps[order]
    new_user = np.concatenate([[True], user[1:] != user[:-1]])
    new_step = new_user | np.concatenate([[True], step[1:] != step[:-1]])
    # The previous distinct step of each position: the step where its run of equal steps began, minus one run.
    run_start = np.maximum.accumulate(np.where(new_step, np.arange(len(step)), 0))
    previous_step = np.where(new_step, np.concatenate([[0], step[:-1]]), 0)
    previous_step = previous_step[run_start]
    blocked_sorted = ~new_user[run_start] & (step - previous_step < min_sep)
    blocked = np.empty(len(steps), dtype=bool)
    blocked[order] = blocked_sorted
    return blocked


def excluded_samples(sample_of_incidence: np.ndarray, blocked: np.ndarray, samples: int) -> np.ndarray:
    """Alg. 3 line 5: a sample is excluded when any of its users is blocked at its step."""
    return np.bincount(sample_of_incidence[blocked], minlength=samples) > 0


def neighbour_pairs(record_of_incidence: np.ndarray, user_of_incidence: np.ndarray, max_pairs: int = 20_000_000):
    """N(e) of Alg. 3 line 1 as pairs: yields (record, neighbour) arrays, each pair once per chunk,
    itself included, all of a record's pairs in one chunk. Work is sum over users of degree^2,
    done about `max_pairs` at a time."""
    if len(record_of_incidence) == 0:
        return
    n = int(record_of_incidence.max()) + 1
    by_user = np.lexsort((record_of_incidence, user_of_incidence))
    users, user_records = user_of_incidence[by_user], record_of_incidence[by_user]
    starts = np.flatnonzero(np.concatenate([[True], users[1:] != users[:-1]]))
    degree = np.diff(np.concatenate([starts, [len(users)]]))
    # Per incidence (sorted by record): where its user's records start in `user_records`, and how many.
    by_record = np.argsort(user_records, kind="stable")
    record, first = user_records[by_record], np.repeat(starts, degree)[by_record]
    count = np.repeat(degree, degree)[by_record]
    record_end = np.cumsum(np.bincount(record, minlength=n))
    pairs_before = np.concatenate([[0], np.cumsum(np.bincount(record, weights=count, minlength=n))])
    cuts = np.unique(np.searchsorted(pairs_before, np.arange(0, pairs_before[-1] + max_pairs, max_pairs)).clip(0, n))
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        chunk = slice(record_end[lo - 1] if lo else 0, record_end[hi - 1])
        incidence, neighbour_position = expand_ranges(first[chunk], count[chunk])
        pair = np.sort(record[chunk][incidence] * n + user_records[neighbour_position])
        pair = pair[np.concatenate([[True], pair[1:] != pair[:-1]])]
        yield pair // n, pair % n


def neighbourhood_sizes(
    record_of_incidence: np.ndarray, user_of_incidence: np.ndarray, copies: np.ndarray
) -> np.ndarray:
    """|N(e)| in units per record: the copies of all records sharing a user with it, itself included."""
    sizes = np.zeros(len(copies), dtype=np.int64)
    for owner, neighbour in neighbour_pairs(record_of_incidence, user_of_incidence):
        sizes += np.bincount(owner, weights=copies[neighbour], minlength=len(copies)).astype(np.int64)
    return sizes


def neighbourhood_sizes_of_pairs(
    owner: np.ndarray, neighbour: np.ndarray, neighbour_copies: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """|N(e)| in units from (record, neighbour) pairs that may repeat (two shared users, or pairs
    formed in several user partitions): (size, units) per record present, the units being the
    copies on its pair with itself. The partitioned form of `neighbourhood_sizes`."""
    order = np.lexsort((neighbour, owner))
    owner, neighbour, copies = owner[order], neighbour[order], neighbour_copies[order]
    new = np.concatenate([[True], (owner[1:] != owner[:-1]) | (neighbour[1:] != neighbour[:-1])])
    owner, neighbour, copies = owner[new], neighbour[new], copies[new]
    group = np.cumsum(np.concatenate([[True], owner[1:] != owner[:-1]])) - 1
    sizes = np.bincount(group, weights=copies).astype(np.int64)
    units = np.zeros(len(sizes), np.int64)
    itself = neighbour == owner
    units[group[itself]] = copies[itself]
    return sizes, units


def size_histogram(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct value, count), sorted: what calibration needs of the units' neighbourhood sizes."""
    values = np.sort(values)
    starts = np.flatnonzero(np.concatenate([[True], values[1:] != values[:-1]]))
    return values[starts], np.diff(np.concatenate([starts, [len(values)]]))


def expected_batch_size(probability: float, sizes: np.ndarray, counts: np.ndarray, min_sep: int) -> float:
    """Stationary E|B_i| of Alg. 3 for i >= b: sum over units of p (1-p)^((b-1)|N(e)|), exact
    because exclusion depends only on the i.i.d. samples S_j of the previous b-1 steps."""
    if probability >= 1.0:
        return float(counts.sum()) if min_sep == 1 else 0.0
    return float(probability * (counts * np.exp((min_sep - 1) * sizes * np.log1p(-probability))).sum())


class Reach(NamedTuple):
    """The largest stationary expected batch size b-min-sep sampling reaches on a selection, and the p
    that reaches it (E|B| rises with p to a peak and then falls when b > 1: exclusion takes over)."""

    largest: float
    probability: float


def _probability_grid(sizes: np.ndarray, counts: np.ndarray, min_sep: int) -> tuple[np.ndarray, np.ndarray]:
    """(p, E|B| at p) on the grid calibration searches: up to where the sum certainly peaked. Every
    term p(1-p)^(c m) peaks at 1 / (1 + c m), so the sum peaks below 1 / (1 + c min m)."""
    grid = np.geomspace(1e-12, 1.0 / (1.0 + (min_sep - 1) * float(sizes[0])), 2000)
    return grid, np.array([expected_batch_size(p, sizes, counts, min_sep) for p in grid])


def largest_expected_batch_size(sizes: np.ndarray, counts: np.ndarray, min_sep: int) -> Reach:
    """The largest target `calibrate_probability` accepts on this selection (every target up to it
    is reached, on the same grid), with its p; all units at p = 1 without exclusion (b = 1)."""
    units = float(counts.sum())
    if units == 0:
        return Reach(0.0, 0.0)
    if min_sep == 1:
        return Reach(units, 1.0)
    grid, values = _probability_grid(sizes, counts, min_sep)
    peak = int(np.argmax(values))
    return Reach(float(values[peak]), float(grid[peak]))


def calibrate_probability(
    target: float, sizes: np.ndarray, counts: np.ndarray, min_sep: int, relative_tolerance: float = 1e-10
) -> float:
    """The smallest p whose stationary expected batch size is `target`, by bisection below the
    first grid point that reaches it (E|B| rises to a peak and then falls when b > 1)."""
    units = int(counts.sum())
    if units == 0:
        raise InputError("the selection holds no record (the bound kept none): there is nothing to batch")
    if not 0 < target <= units:
        raise InputError(f"--batch-size {target:g} must be in (0, {units}]: there are {units} selected record copies")
    if min_sep == 1:
        return target / units
    grid, values = _probability_grid(sizes, counts, min_sep)
    reaching = np.flatnonzero(values >= target)
    if not len(reaching):
        peak = int(np.argmax(values))
        raise InputError(
            f"--batch-size {target:g} is unreachable with --min-sep {min_sep} on this data: the "
            f"largest expected batch size is {values[peak]:.1f} (at p = {grid[peak]:.3g}); lower "
            f"the batch size or the min-sep, or bound contributions more tightly (`madp recommend-k` "
            f"shows what each choice reaches)"
        )
    low, high = (grid[reaching[0] - 1] if reaching[0] else 0.0), grid[reaching[0]]
    while high - low > relative_tolerance * high:
        middle = 0.5 * (low + high)
        low, high = (middle, high) if expected_batch_size(middle, sizes, counts, min_sep) < target else (low, middle)
    return float(high)


def truncation_priority(keys: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Counter-based priority of a unit at a step: rows of a batch are ordered by it, and a batch
    over B_max keeps the B_max rows of smallest priority (a uniformly random subset, App. D)."""
    return splitmix64(keys ^ splitmix64(steps.astype(np.uint64) ^ _TRUNCATION_STREAM))


def order_and_truncate(steps: np.ndarray, priority: np.ndarray, max_batch_size: int | None) -> np.ndarray:
    """Indices of the rows to write, by (step, priority); at most `max_batch_size` per step."""
    order = np.lexsort((priority, steps))
    if max_batch_size is None or len(order) == 0:
        return order
    step = steps[order]
    start = np.searchsorted(step, step, side="left")
    return order[np.arange(len(order)) - start < max_batch_size]


def greedy_minsep(
    record_of_incidence: np.ndarray,
    user_of_incidence: np.ndarray,
    records: int,
    steps: int,
    batch_size: int,
    min_sep: int,
) -> tuple[np.ndarray | None, int]:
    """It's my data too, Alg. 4: cycle through records (sorted by increasing arity, then index)
    and append each one whose users all last appeared at least `min_sep` batches earlier; batch
    t is positions [tB, (t+1)B). Returns (the record of each position, T), or (None, t) when a full
    pass over the records adds nothing to batch t (no solution for these parameters).

    A user appears at most once per batch, so a user's participations k <= ceil(T / b).
    """
    order = np.argsort(np.bincount(record_of_incidence, minlength=records), kind="stable").tolist()
    by_record = np.argsort(record_of_incidence, kind="stable")
    users_sorted = user_of_incidence[by_record].tolist()
    offsets = np.concatenate([[0], np.cumsum(np.bincount(record_of_incidence, minlength=records))]).tolist()
    last_batch = [-min_sep] * (int(user_of_incidence.max()) + 1 if len(user_of_incidence) else 0)
    chosen = np.empty(steps * batch_size, dtype=np.int64)
    position, cursor = 0, 0
    for batch in range(steps):
        filled, considered = 0, 0
        while filled < batch_size:
            if considered == records:
                return None, batch
            record = order[cursor]
            cursor = cursor + 1 if cursor + 1 < records else 0
            considered += 1
            users = users_sorted[offsets[record] : offsets[record + 1]]
            if all(batch - last_batch[u] >= min_sep for u in users):
                for u in users:
                    last_batch[u] = batch
                chosen[position] = record
                position += 1
                filled += 1
                considered = 0
    return chosen, steps
