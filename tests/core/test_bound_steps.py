"""The partitioned steps of Alg. 1 (`madp.core.bound_steps`) without an engine: a record partition's
proposals summed, a user partition's consume step, and the whole algorithm run step by step over
record and user partitions in memory, against the whole-graph local kernel (`bound_records`)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pyarrow as pa
import pytest

from madp.core.bound_steps import (
    ProposalBatch,
    RecordPartition,
    SelectedKeys,
    UserPartition,
    build_user_partition,
    consume_in_partition,
    finish_locally,
    propose_to_record_partitions,
    record_selection,
    retire_in_partition,
    select_unanimous,
    split_record_partition,
)
from madp.core.bounding import DONE, START_PASS, Capacities, Control, build_user_side, unanimous
from madp.core.records import RecordChunk
from madp.core.selection import BoundOptions
from madp.engines.local_engine import bound_records
from madp.tools.data.synthetic import GraphSpec, generate


def _batch(user_partition: int, keys: list[int], proposers: list[int], arity: list[int]) -> ProposalBatch:
    return ProposalBatch(user_partition, np.array(keys, np.int64), np.array(proposers, np.uint8), np.array(arity))


def test_a_record_is_selected_when_the_proposals_of_every_user_partition_add_up_to_its_arity():
    batches = [_batch(2, [10, 20, 30], [1, 1, 2], [2, 1, 4]), _batch(0, [10, 30], [1, 1], [2, 4])]
    for delivered in (batches, batches[::-1]):  # whatever order the runner delivers them in
        selection = select_unanimous(delivered)
        assert selection.selected.tolist() == [10, 20]
        assert [(part, keys.tolist()) for part, keys in selection.accepted] == [(0, [10]), (2, [10, 20])]
        assert selection.message_bytes == 3 * 8


def test_unanimous_counts_a_partitions_proposers_as_that_many_proposals():
    rng = np.random.default_rng(4)
    arity = rng.integers(1, 4, 50)
    records = rng.integers(0, 50, 120)
    proposers = rng.integers(1, 3, 120)
    expanded = np.repeat(records, proposers)
    np.testing.assert_array_equal(unanimous(records, arity, proposers), unanimous(expanded, arity))


def _chunk(offsets: np.ndarray, users: np.ndarray, records: np.ndarray) -> RecordChunk:
    """The records `records` (ascending) of the graph as a chunk, keyed by their index."""
    arity = np.diff(offsets)[records]
    rows = np.concatenate([np.arange(offsets[r], offsets[r + 1]) for r in records] + [np.zeros(0, np.int64)])
    return RecordChunk(
        keys=records.astype(np.int64),
        ids=pa.array(records.astype(np.int64)),
        offsets=np.concatenate([[0], np.cumsum(arity)]).astype(np.int64),
        users=pa.array(users[rows]),
        weights=None,
        sources={0: "memory"},
    )


class _Partitioned:
    """The steps run over partitions in memory, as a partitioned engine runs them: messages grouped by
    destination between steps, the counts summed into the shared control."""

    def __init__(self, offsets, users, options: BoundOptions, capacities: Capacities, partitions: int):
        self.options = options
        records = np.arange(len(offsets) - 1)
        splits = [
            split_record_partition(
                part,
                _chunk(offsets, users, records[records % partitions == part]),
                _nothing_selected(int((records % partitions == part).sum())),
                options,
                partitions,
                capacities,
            )
            for part in range(partitions)
        ]
        self.records = {split.records.part: split.records for split in splits}
        to_users = defaultdict(list)
        for split in splits:
            for user_part, incidences in split.incidences:
                to_users[user_part].append(incidences)
        built = [build_user_partition(part, batches, capacities) for part, batches in sorted(to_users.items())]
        self.input_users = sum(one.input_users for one in built)
        self.states = {one.state.part: one.state for one in built if one.state is not None}
        self.selections: dict[int, list[SelectedKeys]] = defaultdict(list)
        self.control = Control(options.duplicates, options.max_rounds)

    def step(self, certify: bool = False) -> None:
        """A round, or a pass start: each user partition's messages gathered before it runs."""
        pass_start = self.control.next == START_PASS
        accepted, selected = defaultdict(list), 0
        if not pass_start:
            proposals = defaultdict(list)
            for state in self.states.values():
                for record_part, batch in propose_to_record_partitions(state).batches:
                    proposals[record_part].append(batch)
            for record_part, batches in proposals.items():
                selection = select_unanimous(batches)
                selected += len(selection.selected)
                if len(selection.selected):
                    self.selections[record_part].append(SelectedKeys(selection.selected, self.control.passes))
                for user_part, keys in selection.accepted:
                    accepted[user_part].append(keys)
        consumed = {
            part: consume_in_partition(state, _keys(accepted[part]), pass_start, certify)
            for part, state in self.states.items()
        }
        dead = defaultdict(list)
        for one in consumed.values():
            for user_part, keys in one.dead_elsewhere:
                assert user_part in self.states  # a co-owner's partition is still there
                dead[user_part].append(keys)
        eligible, states = 0, {}
        for part, state in self.states.items():
            retired = retire_in_partition(state, consumed[part].dead, _keys(dead[part]), self.options.duplicates)
            eligible += retired.eligible
            if retired.stays:
                states[part] = retired.state
        self.states, self.control = states, self.control.after(selected, eligible)

    def copies(self, records: int) -> np.ndarray:
        copies = np.zeros(records, np.int64)
        for part, partition in self.records.items():
            copies[partition.keys] = record_selection(partition, self.selections[part], self.control, 0).copies
        return copies


def _nothing_selected(records: int) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(records, np.int64), np.zeros(records, bool)


def _keys(batches: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(batches) if batches else np.zeros(0, np.int64)


CASES = [(graph, k, duplicates) for graph in ("regular", "skewed") for k in (1, 3) for duplicates in (False, True)]


@pytest.mark.parametrize("graph,k,duplicates", CASES)
def test_the_steps_over_partitions_select_what_the_whole_graph_kernel_selects(graph, k, duplicates):
    data = generate(GraphSpec(records=600, graph=graph, mean_arity=2.5, records_per_user=4.0, seed=k))
    options = BoundOptions(max_contributions=k, seed=3, duplicates=duplicates)
    capacities = Capacities(k, pa.array([0, 1, 2]), np.array([0, 5, 1]))
    whole = bound_records(_chunk(data.offsets, data.users, np.arange(600)), options, capacities)

    partitioned = _Partitioned(data.offsets, data.users, options, capacities, partitions=4)
    assert partitioned.input_users == whole.input_users
    partitioned.step(certify=not duplicates)  # the first pass start, as Beam's FirstSaturation
    while partitioned.control.next != DONE:
        partitioned.step()
    np.testing.assert_array_equal(partitioned.copies(600), whole.copies)
    assert list(partitioned.control.per_round) == whole.rounds and partitioned.control.converged
    assert not partitioned.states  # every user's incidences decided


@pytest.mark.parametrize("duplicates", [False, True])
def test_finishing_locally_after_any_round_selects_the_same(duplicates):
    data = generate(GraphSpec(records=500, graph="skewed", mean_arity=2.5, records_per_user=4.0, seed=8))
    options = BoundOptions(max_contributions=2, seed=1, duplicates=duplicates)
    capacities = Capacities(2)
    whole = bound_records(_chunk(data.offsets, data.users, np.arange(500)), options, capacities)
    for rounds_in_partitions in (0, 1, 2):
        partitioned = _Partitioned(data.offsets, data.users, options, capacities, partitions=3)
        partitioned.step(certify=not duplicates)
        for _ in range(rounds_in_partitions):
            partitioned.step()
        finished = finish_locally(list(partitioned.states.values()), partitioned.control)
        for record_part, selected in finished.selected:
            partitioned.selections[record_part].append(selected)
        partitioned.control = finished.control
        np.testing.assert_array_equal(partitioned.copies(500), whole.copies)
        assert list(finished.control.per_round) == whole.rounds
        assert finished.incidences == sum(state.incidences for state in partitioned.states.values())


def test_consuming_retires_a_saturated_users_records_here_and_tells_their_other_partitions():
    # user "a" (capacity 1) of user partition 2 owns records 5 and 7; record 7's other user is in partition 4
    side = build_user_side(
        pa.array(["a", "a"]),
        np.array([0, 1]),
        np.array([5, 7]),
        (np.array([0.0, 1.0]), np.zeros(2, np.uint64)),
        Capacities(1),
        np.zeros(2, np.int64),
        np.zeros(2, bool),
    )
    offsets, peers = np.array([0, 1, 3]), np.array([2, 2, 4], np.int32)
    state = UserPartition(2, side, np.array([1, 2], np.int32), np.zeros(2, np.int32), offsets, peers)
    consumed = consume_in_partition(state, np.array([5]), pass_start=False, certify=False)
    assert state.side.residual.tolist() == [0] and not state.side.eligible.any()
    assert consumed.dead.tolist() == [False, True]  # 5 was taken, 7 dies with its saturated user
    assert [(part, keys.tolist()) for part, keys in consumed.dead_elsewhere] == [(4, [7])]
    assert consumed.message_bytes == 8
    retired = retire_in_partition(state, consumed.dead, np.zeros(0, np.int64), duplicates=False)
    assert (retired.eligible, retired.stays, retired.departed_contributions.tolist()) == (0, False, [1])


def test_a_record_partitions_copies_add_each_rounds_selection():
    partition = RecordPartition(
        0,
        np.array([3, 8, 9], np.int64),
        pa.array(["x", "y", "z"]),
        np.array([1, 2, 1]),
        np.array([1, 0, 0], np.int64),
        np.array([True, False, False]),
    )
    control = Control(True, None, next=START_PASS, passes=2)
    selection = record_selection(
        partition, [SelectedKeys(np.array([3, 9]), 1), SelectedKeys(np.array([9]), 2)], control, 2
    )
    assert selection.copies.tolist() == [2, 0, 2]
    assert selection.in_pass.tolist() == [True, False, True]
    later = record_selection(partition, [], control, 1)  # a pass started since: nothing is in this one yet
    assert later.in_pass.tolist() == [False, False, False]
