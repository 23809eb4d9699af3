"""The round-based algorithm equals the sequential greedy run in the same universal order."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from reference import sequential_greedy

from madp.core.bounding import (
    Capacities,
    Control,
    beyond_saturation,
    certified_records,
    preference_keys,
    preference_rank_order,
)
from madp.core.hashing import hash_ids
from madp.core.records import RecordChunk
from madp.core.selection import BoundOptions
from madp.engines.local_engine import bound_records
from madp.tools.data.synthetic import GraphSpec, generate


def as_chunk(offsets, users, ids=None, weights=None) -> RecordChunk:
    n = len(offsets) - 1
    return RecordChunk(
        keys=np.arange(n, dtype=np.int64),
        ids=pa.array(np.arange(n) if ids is None else ids),
        offsets=np.asarray(offsets, dtype=np.int64),
        users=pa.array(users),
        weights=weights,
        sources={0: "memory"},
    )


def reference_order(chunk: RecordChunk, order: str, seed: int) -> list[int]:
    """The documented universal order, sorted here with Python tuples."""
    tie = hash_ids(chunk.ids, seed, purpose=1)
    arity = np.diff(chunk.offsets)
    primary = {
        "arity": arity,
        "hash": np.zeros_like(arity),
        "weight": None if chunk.weights is None else -chunk.weights,
    }[order]
    return sorted(range(len(arity)), key=lambda r: (float(primary[r]), int(tie[r]), r))


def check(chunk, k, order="arity", seed=0, duplicates=False, capacity=None):
    options = BoundOptions(
        max_contributions=k,
        order=order,
        seed=seed,
        duplicates=duplicates,
        weight_column="w" if order == "weight" else None,
    )
    capacities = (
        Capacities(k)
        if capacity is None
        else Capacities(k, pa.array(list(capacity)), np.array(list(capacity.values())))
    )
    result = bound_records(chunk, options, capacities)
    users = chunk.users.to_pylist()
    record_users = [users[chunk.offsets[i] : chunk.offsets[i + 1]] for i in range(len(chunk))]
    expected = sequential_greedy(reference_order(chunk, order, seed), record_users, capacity or {}, k, duplicates)
    np.testing.assert_array_equal(result.copies, expected)
    assert result.converged
    return result


@pytest.mark.parametrize("graph", ["regular", "skewed"])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("duplicates", [False, True])
def test_random_graphs(graph, k, duplicates):
    for seed in range(4):
        data = generate(GraphSpec(records=2000, graph=graph, mean_arity=2.5, records_per_user=4.0, seed=seed))
        result = check(as_chunk(data.offsets, data.users), k, seed=seed, duplicates=duplicates)
        assert result.copies.sum() > 0


@pytest.mark.parametrize("order", ["hash", "arity"])
def test_other_orders_and_seeds(order):
    data = generate(GraphSpec(records=3000, graph="skewed", seed=11))
    chunk = as_chunk(data.offsets, data.users)
    results = [check(chunk, 2, order=order, seed=seed).copies for seed in (1, 2)]
    assert not np.array_equal(*results), "the seed must change the order"


def test_weight_order_with_many_ties():
    data = generate(GraphSpec(records=3000, graph="skewed", seed=5))
    weights = np.random.default_rng(0).integers(0, 3, size=3000).astype(np.float64)
    for duplicates in (False, True):
        check(as_chunk(data.offsets, data.users, weights=weights), 2, order="weight", duplicates=duplicates)


def test_per_user_capacities_including_zero():
    data = generate(GraphSpec(records=3000, graph="skewed", seed=9))
    rng = np.random.default_rng(1)
    users = np.unique(data.users)
    chosen = rng.choice(users, size=len(users) // 3, replace=False)
    capacity = {int(u): int(c) for u, c in zip(chosen, rng.integers(0, 6, size=len(chosen)))}
    for duplicates in (False, True):
        result = check(as_chunk(data.offsets, data.users), 2, capacity=capacity, duplicates=duplicates)
        zero = {u for u, c in capacity.items() if c == 0}
        for r in np.flatnonzero(result.copies):
            assert not zero & set(data.users[data.offsets[r] : data.offsets[r + 1]].tolist())


def test_string_ids_and_users():
    data = generate(GraphSpec(records=1500, graph="regular", seed=2))
    users = np.array([f"user-{u}@example.org" for u in data.users])
    check(as_chunk(data.offsets, users, ids=[f"msg-{i}" for i in range(1500)]), 2, duplicates=True)


def test_hand_made_graph():
    # Records: 0={a}, 1={a,b}, 2={b}, 3={a,b,c}, 4={c}; K=1 keeps the single-user records first.
    offsets, users = [0, 1, 3, 4, 7, 8], ["a", "a", "b", "b", "a", "b", "c", "c"]
    result = check(as_chunk(offsets, users), 1)
    assert result.copies.tolist() == [1, 0, 1, 0, 1]


def test_max_rounds_stops_early_safely():
    data = generate(GraphSpec(records=20000, graph="skewed", seed=3))
    chunk = as_chunk(data.offsets, data.users)
    full = check(chunk, 3)
    assert len(full.rounds) > 2
    partial = bound_records(chunk, BoundOptions(max_contributions=3, max_rounds=1), Capacities(3))
    assert not partial.converged and len(partial.rounds) == 1
    assert partial.copies.sum() == full.rounds[0].selected
    assert np.all(partial.copies <= full.copies), "an early stop selects a subset of the converged result"
    assert partial.max_user_contribution <= 3


def test_rounds_report_counts():
    data = generate(GraphSpec(records=5000, graph="skewed", seed=4))
    result = check(as_chunk(data.offsets, data.users), 2, duplicates=True)
    assert sum(r.selected for r in result.rounds) == result.copies.sum()
    assert result.rounds[-1].eligible == 0
    assert result.passes == max(r.pass_ for r in result.rounds) > 1


def alternate_reference_order(chunk: RecordChunk, seed: int, u: int, c1: int, c2: int) -> list[int]:
    """--order alternate as documented: a record's position q = hash / 2^64 in [0, 1) places it in run
    floor(q N_group / c) of its group; small runs (<= u users) precede the large run of the same index."""
    tie = hash_ids(chunk.ids, seed, purpose=1)
    arity = np.diff(chunk.offsets)
    small = [r for r in range(len(arity)) if arity[r] <= u]
    sizes = {True: len(small), False: len(arity) - len(small)}

    def key(r):
        is_small = bool(arity[r] <= u)
        run = int(float(tie[r]) / 2.0**64 * sizes[is_small] / (c1 if is_small else c2))
        return (2 * run + (0 if is_small else 1), int(tie[r]), r)

    return sorted(range(len(arity)), key=key)


@pytest.mark.parametrize("duplicates", [False, True])
def test_alternate_order_equals_the_sequential_greedy_in_that_order(duplicates):
    data = generate(GraphSpec(records=3000, graph="skewed", seed=8))
    chunk = as_chunk(data.offsets, data.users)
    options = BoundOptions(
        max_contributions=2,
        order="alternate",
        seed=3,
        duplicates=duplicates,
        arity_threshold=1,
        small_run=40,
        large_run=15,
    )
    result = bound_records(chunk, options, Capacities(2))
    users = chunk.users.to_pylist()
    record_users = [users[chunk.offsets[i] : chunk.offsets[i + 1]] for i in range(len(chunk))]
    expected = sequential_greedy(alternate_reference_order(chunk, 3, 1, 40, 15), record_users, {}, 2, duplicates)
    np.testing.assert_array_equal(result.copies, expected)


def test_alternate_order_runs_and_bias_mitigation():
    data = generate(GraphSpec(records=20000, graph="skewed", seed=9))
    chunk = as_chunk(data.offsets, data.users)
    order = alternate_reference_order(chunk, 0, 1, 50, 20)
    small = (np.diff(chunk.offsets) <= 1)[order]
    starts = np.flatnonzero(np.concatenate([[True], small[1:] != small[:-1]]))
    lengths = np.diff(np.concatenate([starts, [len(small)]]))
    first = small[starts]
    # runs alternate, small first; until one group runs out, runs hold c1 = 50 and c2 = 20 on average
    both = slice(0, 2 * min(int(first.sum()), int((~first).sum())) - 2)
    assert first[0] and not np.any(first[both][1:] == first[both][:-1])
    assert abs(lengths[both][first[both]].mean() - 50) < 3 and abs(lengths[both][~first[both]].mean() - 20) < 1.5
    kept_users = {}
    for name, options in (
        ("arity", BoundOptions(max_contributions=2)),
        (
            "alternate",
            BoundOptions(max_contributions=2, order="alternate", arity_threshold=1, small_run=50, large_run=20),
        ),
    ):
        copies = bound_records(chunk, options, Capacities(2)).copies
        kept_users[name] = np.diff(chunk.offsets)[copies > 0].mean()
    assert kept_users["alternate"] > kept_users["arity"] + 0.05  # more multi-user records kept: less bias


def test_alternate_order_options_are_checked():
    from madp.core.errors import InputError

    with pytest.raises(InputError, match="^order alternate needs arity_threshold, small_run and large_run"):
        BoundOptions(max_contributions=2, order="alternate", arity_threshold=1)
    with pytest.raises(InputError, match="apply to order alternate"):
        BoundOptions(max_contributions=2, small_run=3)


@pytest.mark.parametrize("order", ["arity", "hash"])
def test_the_saturation_certificate_names_only_records_the_greedy_rejects(order):
    """`certified_records` on the whole graph, and on any part of it that keeps whole records (a
    record partition), names records the sequential greedy rejects; on a part it names no more than
    on the whole, and the users' first capacity records owned alone survive on every part."""
    data = generate(GraphSpec(records=3000, graph="skewed", mean_arity=2.0, records_per_user=3.0, seed=5))
    chunk = as_chunk(data.offsets, data.users)
    k, capacity = 2, {0: 0, 1: 5, 3: 1}
    keys = preference_keys(chunk.ids, chunk.arity, order, 3)
    rank = np.empty(len(chunk), np.int64)
    rank[preference_rank_order(*keys, chunk.keys)] = np.arange(len(chunk))
    users = chunk.users.to_numpy()
    record_users = [list(users[chunk.offsets[i] : chunk.offsets[i + 1]]) for i in range(len(chunk))]
    greedy = np.array(sequential_greedy(list(np.argsort(rank)), record_users, capacity, k, False))
    inc_record = np.repeat(np.arange(len(chunk)), chunk.arity)
    capacities = np.array([capacity.get(u, k) for u in range(users.max() + 1)])

    def certified(records: np.ndarray) -> np.ndarray:
        part = np.isin(inc_record, records)
        found = certified_records(users[part], inc_record[part], rank, chunk.arity, capacities)
        return np.flatnonzero(found)

    whole = certified(np.arange(len(chunk)))
    assert len(whole) > 0.05 * len(chunk) and not greedy[whole].any()
    parts, found_in_parts = np.arange(len(chunk)) % 7, 0
    for part in range(7):
        found = certified(np.flatnonzero(parts == part))
        assert set(found) <= set(whole) and (parts[found] == part).all()
        found_in_parts += len(found)
    assert found_in_parts > 0


def test_rejecting_the_certified_records_up_front_changes_rounds_not_the_selection(monkeypatch):
    data = generate(GraphSpec(records=4000, graph="skewed", mean_arity=2.0, seed=9))
    chunk = as_chunk(data.offsets, data.users)
    options = BoundOptions(max_contributions=2)
    certified = bound_records(chunk, options, Capacities(2))
    monkeypatch.setattr(Control, "certifies", property(lambda control: False))
    plain = bound_records(chunk, options, Capacities(2))
    np.testing.assert_array_equal(certified.copies, plain.copies)
    assert certified.rounds[0].eligible < plain.rounds[0].eligible


def test_beyond_saturation_counts_records_alone_per_user():
    # user 0: alone, shared, alone, shared (capacity 2): the second shared comes after two alone
    # user 1: shared, shared (capacity 0): both beyond; user 2: alone (capacity 1): not beyond
    inc_user = np.array([0, 0, 0, 0, 1, 1, 2])
    alone = np.array([True, False, True, False, False, False, True])
    beyond = beyond_saturation(inc_user, alone, np.array([2, 0, 1]))
    assert beyond.tolist() == [False, False, False, True, True, True, False]
