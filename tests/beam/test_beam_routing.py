"""The partitioned engines' kernels in memory, against sets, dictionaries and the whole-graph engine:
grouping keys by partition, each record's distinct partitions and their entries, CSR rows taken,
compacting a user side to what can still change, merging user sides, and the shared control flow."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from madp.core.bounding import DONE, ROUND, START_PASS, Capacities, Control, build_user_side, compact, merge_sides
from madp.core.routing import csr_rows, distinct_partitions, split_by_partition, take_csr


def test_split_groups_keys_by_partition_in_their_order():
    rng = np.random.default_rng(3)
    keys = rng.permutation(1000)
    partition = rng.integers(0, 7, 1000)
    groups = dict(split_by_partition(keys, partition))
    assert sorted(groups) == sorted(set(partition.tolist()))
    for part, chunk in groups.items():
        assert chunk.tolist() == keys[partition == part].tolist()


def test_distinct_partitions_of_each_record_and_the_entries_of_chosen_records():
    rng = np.random.default_rng(5)
    arity = rng.integers(0, 6, 300)
    partition = rng.integers(0, 9, arity.sum())
    offsets, partitions = distinct_partitions(arity, partition, 9)
    starts = np.concatenate([[0], np.cumsum(arity)])
    for record in range(300):
        expected = sorted(set(partition[starts[record] : starts[record + 1]].tolist()))
        assert partitions[offsets[record] : offsets[record + 1]].tolist() == expected
    chosen = np.array([7, 3, 250, 3])
    rows, positions = csr_rows(offsets, chosen)
    expected_rows = [r for r in chosen for _ in range(offsets[r], offsets[r + 1])]
    expected_positions = [p for r in chosen for p in range(offsets[r], offsets[r + 1])]
    assert rows.tolist() == expected_rows
    assert positions.tolist() == expected_positions


def test_taken_csr_rows_are_those_rows_in_that_order():
    offsets, values = np.array([0, 2, 2, 5, 6]), np.array([10, 11, 20, 21, 22, 30])
    taken_offsets, taken = take_csr(offsets, values, np.array([3, 0, 1, 2]))
    assert taken_offsets.tolist() == [0, 1, 3, 3, 6] and taken.tolist() == [30, 10, 11, 20, 21, 22]


def _side(rng, users: int, records: int, incidences: int):
    pairs = np.unique(np.stack([rng.integers(0, users, incidences), rng.integers(0, records, incidences)]), axis=1)
    inc_user_ids, inc_record = pa.array(pairs[0]), pairs[1].astype(np.int64)
    order = (rng.random(records), rng.integers(0, 2**63, records).astype(np.uint64))
    empty = np.zeros(records, np.int64)
    keys = np.arange(records, dtype=np.int64) * 3
    return build_user_side(inc_user_ids, inc_record, keys, order, Capacities(2), empty, empty.astype(bool))


def test_compacting_keeps_the_marked_incidences_with_their_users_and_records():
    rng = np.random.default_rng(11)
    side = _side(rng, 30, 50, 120)
    side.residual[:5] = 0  # a capacity used up stays with the user
    keep = rng.random(len(side.inc_record)) < 0.4
    compacted, records, users = compact(side, keep)
    before = {(int(u), int(side.record_keys[r])) for u, r in zip(side.inc_user[keep], side.inc_record[keep])}
    user_ids = np.flatnonzero(users)
    after = {
        (int(user_ids[u]), int(compacted.record_keys[r])) for u, r in zip(compacted.inc_user, compacted.inc_record)
    }
    assert before == after
    assert compacted.record_keys.tolist() == sorted({k for _, k in before})
    assert compacted.residual.tolist() == side.residual[users].tolist()
    assert compacted.eligible.tolist() == side.eligible[keep].tolist()
    for user, first in enumerate(compacted.first_incidence):  # each user's incidences start where it says
        assert first == np.flatnonzero(compacted.inc_user == user)[0]


def test_merged_sides_match_records_by_key_and_keep_each_users_order():
    rng = np.random.default_rng(12)
    sides = [_side(rng, 10, 40, 60), _side(rng, 12, 40, 70)]
    merged, positions = merge_sides(sides)
    assert merged.record_keys.tolist() == sorted(set(np.concatenate([s.record_keys for s in sides]).tolist()))
    base = 0
    for side, where in zip(sides, positions):
        assert np.array_equal(merged.record_keys[where], side.record_keys)
        mine = (merged.inc_user >= base) & (merged.inc_user < base + len(side.residual))
        assert np.array_equal(merged.record_keys[merged.inc_record[mine]], side.record_keys[side.inc_record])
        base += len(side.residual)


def test_control_passes_and_rounds_as_the_algorithm_goes():
    control = Control(duplicates=True, max_rounds=3)
    assert control.next == START_PASS
    control = control.after(0, 10)  # a pass starts with 10 records eligible
    assert (control.next, control.passes) == (ROUND, 1)
    control = control.after(6, 4).after(4, 0)  # two rounds end the pass
    assert control.next == START_PASS and [r.selected for r in control.per_round] == [6, 4]
    control = control.after(0, 3).after(1, 2)  # a second pass: max_rounds stops it undecided
    assert (control.next, control.passes, control.converged) == (DONE, 2, False)
    assert Control(duplicates=False, max_rounds=None).after(0, 5).after(5, 0).converged
    assert Control(duplicates=True, max_rounds=None).after(0, 0).converged  # nothing eligible: done


def test_a_user_partition_travels_packed_and_comes_back_the_same():
    """The compact form a partition travels in (32-bit positions, flags as bits, users by their
    incidence counts) gives back every array, with its dtype."""
    import dataclasses

    from madp.beam.bound_rounds import UserPartition

    rng = np.random.default_rng(13)
    side = _side(rng, 30, 80, 200)
    side.eligible[::3] = False
    side.residual[:4] = 0
    records = len(side.record_keys)
    peer_counts = rng.integers(1, 4, records)
    partition = UserPartition(
        part=5,
        side=side,
        arity=rng.integers(1, 5, records).astype(np.int32),
        record_partition=rng.integers(0, 9, records).astype(np.int32),
        peer_offsets=np.concatenate([[0], np.cumsum(peer_counts)]).astype(np.int64),
        peers=rng.integers(0, 70, peer_counts.sum()).astype(np.int32),
    )
    back = UserPartition.unpacked(partition.packed())
    assert back.part == 5
    for field in dataclasses.fields(side):
        before, after = getattr(side, field.name), getattr(back.side, field.name)
        assert np.array_equal(before, after) and before.dtype == after.dtype, field.name
    for name in ("arity", "record_partition", "peer_offsets", "peers"):
        assert np.array_equal(getattr(partition, name), getattr(back, name)), name
    assert len(partition.packed()) < sum(a.nbytes for a in dataclasses.asdict(side).values())
