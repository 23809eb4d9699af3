"""Generators follow App. C.1 and are reproducible; id hashing is stable and seeded."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from madp.core.columnar import dense_codes
from madp.core.hashing import hash_ids, partition_of, splitmix64
from madp.tools.data.synthetic import GraphSpec, generate


def degrees(data) -> np.ndarray:
    counts = np.bincount(data.users)
    return counts[counts > 0]


def test_reproducible_and_seeded():
    a, b = generate(GraphSpec(records=5000, seed=1)), generate(GraphSpec(records=5000, seed=1))
    assert np.array_equal(a.users, b.users) and np.array_equal(a.features, b.features)
    assert not np.array_equal(a.users, generate(GraphSpec(records=5000, seed=2)).users)


def test_mean_arity_and_skew():
    regular = generate(GraphSpec(records=50000, graph="regular", seed=0))
    skewed = generate(GraphSpec(records=50000, graph="skewed", seed=0))
    for data in (regular, skewed):
        arity = np.diff(data.offsets)
        assert arity.min() >= 1 and abs(arity.mean() - 2.0) < 0.05
        for r in range(0, 50000, 997):  # no user twice in a record
            users = data.users[data.offsets[r] : data.offsets[r + 1]]
            assert len(set(users.tolist())) == len(users)
    assert degrees(skewed).max() > 20 * degrees(regular).max()
    spec = GraphSpec(records=50000, graph="regular")
    assert abs(len(regular.users) / spec.users - spec.records_per_user) < 0.05


def test_labels_follow_the_arity_dependent_logistic_model():
    data = generate(GraphSpec(records=20000, graph="regular", seed=0, bias_scale=0.0))
    # With k = 0 the label depends on <a, z> only: a least-squares fit of the labels on z separates them.
    z, y = data.features, data.labels
    w = np.linalg.lstsq(z, y - y.mean(), rcond=None)[0]
    assert np.mean((z @ w > 0) == (y == 1)) > 0.8


def test_hashes_are_stable_and_seeded():
    ids = pa.array(["a", "bb", "", "héllo", "a"])
    h = hash_ids(ids, seed=3)
    assert h[0] == h[4] and len(set(h[:4].tolist())) == 4
    assert np.array_equal(h[1:3], hash_ids(pa.array(["bb", ""]), seed=3)), "independent of the batch"
    assert not np.array_equal(h, hash_ids(ids, seed=4))
    ints = hash_ids(np.arange(1000), seed=0)
    assert len(np.unique(ints)) == 1000
    parts = partition_of(np.arange(10000), 4)
    assert set(parts.tolist()) == {0, 1, 2, 3} and np.bincount(parts).min() > 2300


def test_splitmix64_is_the_reference_generator_in_place_or_not():
    """The reference SplitMix64 stream from state 0 (Steele et al.'s outputs), as arrays, scalars and
    written into its own input."""
    golden = 0x9E3779B97F4A7C15
    states = np.array([0, golden, 2 * golden % 2**64], dtype=np.uint64)
    expected = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert splitmix64(states).tolist() == expected and states[1] == golden
    assert int(splitmix64(golden)) == expected[1] and isinstance(splitmix64(np.uint64(0)), np.uint64)
    assert splitmix64(states, out=states) is states and states.tolist() == expected


def test_dense_codes_give_each_distinct_id_one_code():
    for values in (pa.array([7, -3, 7, 2**40, -3]), pa.array(["b", "a", "b", ""]), pa.array([], pa.int64())):
        codes, distinct = dense_codes(values)
        assert distinct.take(pa.array(codes, pa.int64())).equals(values) and len(distinct) == len(
            set(values.to_pylist())
        )
