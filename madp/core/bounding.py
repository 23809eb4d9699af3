"""Kernels of round-based unanimous-proposal contribution bounding (distributed-contribution-
bounding paper, Alg. 1), on numpy arrays.

State lives on two sides, which the engines may split into partitions:
- the *user side*: incidences (user, record) sorted by user, then by the universal preference
  order; an eligibility flag per incidence; a residual capacity per user;
- the *record side*: the arity of each record, to recognise unanimous proposals.
Records are referred to by int64 keys; every function takes partition-local arrays.

With a universal order, the result equals the sequential greedy (Alg. 2 / Alg. 3 of "It's my
data too") run in that order: a record proposed by all its owners cannot be rejected by the greedy,
and every record removed for saturation is also rejected by it; the globally first undecided
record is accepted in every round, so the rounds terminate.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from madp.core.columnar import Columnar, dense_codes
from madp.core.errors import InputError
from madp.core.hashing import hash_ids
from madp.core.reports import RoundStats

ORDERS = ("arity", "hash", "weight", "alternate")
log = logging.getLogger("madp.bound")


@dataclasses.dataclass(frozen=True)
class AlternateRuns:
    """The bias-mitigating order of It's my data too (Sec. 5.5, App. C.5): runs of `small_run` records
    with at most `threshold` users alternating with runs of `large_run` records with more; the group
    sizes place the run boundaries, so the order is a function of the record (universal)."""

    threshold: int
    small_run: int
    large_run: int
    small_records: int
    large_records: int

    def run_of(self, arity: np.ndarray, position: np.ndarray) -> np.ndarray:
        """Primary keys 2 j (small) and 2 j + 1 (large) of run j, a record's rank in its group being
        estimated by its `position` in [0, 1): the uniform id hash, which also orders each run."""
        small = arity <= self.threshold
        runs = np.where(
            small,
            np.floor(position * self.small_records / self.small_run),
            np.floor(position * self.large_records / self.large_run),
        )
        return 2 * runs + (~small)


def preference_keys(
    ids: pa.Array,
    arity: np.ndarray,
    order: str,
    seed: int,
    weights: np.ndarray | None = None,
    alternate: AlternateRuns | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Universal preference order as sort keys, smaller first: (primary, seeded 64-bit id hash).

    The hash breaks ties, so every user sees the same total order without any global sort; on
    the rare tie of both keys, the record key (input file and row) decides.
    """
    tie = hash_ids(ids, seed, purpose=1)
    if order == "alternate":
        if alternate is None:
            raise ValueError("--order alternate needs the run lengths and group sizes")
        return alternate.run_of(arity, tie / np.float64(2**64)).astype(np.float64), tie
    if order == "arity":
        primary = arity.astype(np.float64)
    elif order == "hash":
        primary = np.zeros(len(arity), dtype=np.float64)
    elif order == "weight":
        if weights is None:
            raise ValueError("--order weight needs --weight-column")
        primary = -weights.astype(np.float64)  # higher weight preferred
    else:
        raise ValueError(f"unknown order {order!r}; expected one of {ORDERS}")
    return primary, tie


def preference_rank_order(primary: np.ndarray, tie: np.ndarray, record_keys: np.ndarray) -> np.ndarray:
    """Indices sorting records by (primary, tie, record key); the key only matters on a 64-bit tie."""
    by_tie = np.argsort(tie)
    order = by_tie[np.argsort(primary[by_tie], kind="stable")]
    if np.any((primary[order][1:] == primary[order][:-1]) & (tie[order][1:] == tie[order][:-1])):
        return np.lexsort((record_keys, tie, primary))
    return order


@dataclasses.dataclass
class UserSide(Columnar):
    """Incidences of a set of users, sorted by (user, preference)."""

    inc_user: np.ndarray  # int64 local user index, non-decreasing
    inc_record: np.ndarray  # int64 index into `record_keys`
    record_keys: np.ndarray  # int64 sorted distinct record keys of these incidences
    first_incidence: np.ndarray  # int64 position of each user's first incidence
    residual: np.ndarray  # int64 remaining capacity per user
    capacity: np.ndarray  # int64 capacity per user
    eligible: np.ndarray  # bool per incidence

    @property
    def contribution(self) -> np.ndarray:
        return self.capacity - self.residual


def build_user_side(
    inc_user_ids: pa.Array,
    inc_record: np.ndarray,
    record_keys: np.ndarray,
    record_order: tuple[np.ndarray, np.ndarray],
    capacity_of: Capacities,
    copies: np.ndarray,
    in_pass: np.ndarray,
) -> UserSide:
    """Sort incidences by (user, preference) and derive the state of a (partial) selection.

    Incidences point into a record table (`record_keys`, sorted, with the preference keys
    `record_order` and, per record, `copies` selected so far and whether one was selected in
    the current pass). A user's residual is its capacity minus the copies it is part of.
    """
    rank = np.empty(len(record_keys), dtype=np.int64)
    rank[preference_rank_order(*record_order, record_keys)] = np.arange(len(record_keys))
    user_codes, user_ids = dense_codes(inc_user_ids)
    if len(user_ids) * max(len(record_keys), 1) < 2**62:
        order = np.argsort(user_codes * len(record_keys) + rank[inc_record])
    else:
        order = np.lexsort((rank[inc_record], user_codes))
    inc_user, inc_record = user_codes[order], inc_record[order]
    capacity = capacity_of.lookup(user_ids)
    used = np.bincount(inc_user, weights=copies[inc_record], minlength=len(user_ids)).astype(np.int64)
    return UserSide(
        inc_user=inc_user,
        inc_record=inc_record,
        record_keys=record_keys,
        first_incidence=np.searchsorted(inc_user, np.arange(len(user_ids))),
        residual=capacity - used,
        capacity=capacity,
        eligible=~in_pass[inc_record],
    )


@dataclasses.dataclass
class Capacities:
    """Per-user capacity: an explicit table overriding a default bound.

    Typed user ids (JSON Lines, Parquet) match input users of the same type and value only. A CSV
    cannot type its user ids, so they are kept as text (`text_ids`) and match an input user whose id
    is that exact text: the string "007", or for integer user ids the integer written "7" (never "007").
    """

    default: int
    user_ids: pa.Array | None = None
    values: np.ndarray | None = None
    text_ids: bool = False

    @property
    def listed(self) -> tuple[pa.Array, np.ndarray]:
        """The listed user ids and their capacities (a table read from a file has both)."""
        if self.user_ids is None or self.values is None:
            raise ValueError("these capacities list no users")
        return self.user_ids, self.values

    def typed_as(self, target: pa.DataType) -> pa.Array:
        """The listed users as ids of type `target` (int64 or string), null where a text id cannot be one."""
        user_ids = self.listed[0]
        if self.text_ids:
            if pa.types.is_integer(target):
                return pa.array([_canonical_integer(text) for text in user_ids.to_pylist()], pa.int64())
            return user_ids
        if pa.types.is_integer(user_ids.type) != pa.types.is_integer(target):
            raise InputError(
                f"capacities file has {user_ids.type} user ids but the input's user ids are "
                f"{target}: a capacity applies to a user of the same id type only"
            )
        return user_ids

    def lookup(self, user_ids: pa.Array) -> np.ndarray:
        result = np.full(len(user_ids), self.default, dtype=np.int64)
        if self.user_ids is not None and len(user_ids):
            where = pc.index_in(user_ids, value_set=self.typed_as(user_ids.type)).to_numpy(zero_copy_only=False)
            found = ~np.isnan(where.astype(np.float64))
            result[found] = self.listed[1][where[found].astype(np.int64)]
        return result


_INT64 = (-(2**63), 2**63 - 1)


def _canonical_integer(text: str) -> int | None:
    """The int64 that `text` writes in canonical decimal ("7", "-12"; not "007", "+7" or " 7"), else None."""
    if not text or text != text.strip() or text.startswith("+"):
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if str(value) == text and _INT64[0] <= value <= _INT64[1] else None


def propose(users: UserSide) -> np.ndarray:
    """Alg. 1 line 7: each user proposes its top `residual` eligible incidences (bool mask)."""
    eligible = users.eligible
    seen = np.cumsum(eligible, dtype=np.int64)
    before_user = seen[users.first_incidence] - eligible[users.first_incidence] if len(seen) else seen
    rank = seen - before_user[users.inc_user]  # 1-based rank among the user's eligible records
    return eligible & (rank <= users.residual[users.inc_user])


def unanimous(proposals: np.ndarray, arity: np.ndarray, proposers: np.ndarray | None = None) -> np.ndarray:
    """Alg. 1 line 8: records proposed by all their users. `proposals` are local record indices, one
    per proposal, or with `proposers` one per proposing partition, `proposers` saying how many of the
    record's users there proposed it (the record side of partitioned engines sums them)."""
    return np.bincount(proposals, weights=proposers, minlength=len(arity)) == arity


def consume(users: UserSide, accepted: np.ndarray) -> np.ndarray:
    """Alg. 1 lines 9-13 on the user side: take accepted records, saturate users.

    `accepted` is a bool mask over `users.record_keys`. Returns the mask of records that just
    became ineligible because one of these users saturated, for the other users to learn of.
    """
    taken = users.eligible & accepted[users.inc_record]
    users.residual -= np.bincount(users.inc_user[taken], minlength=len(users.residual))
    users.eligible &= ~taken
    saturated = users.residual[users.inc_user] <= 0
    dead = np.zeros(len(users.record_keys), dtype=bool)
    dead[users.inc_record[users.eligible & saturated]] = True
    users.eligible &= ~saturated
    return dead


def consume_and_retire(
    users: UserSide, accepted: np.ndarray, arity: np.ndarray, pass_start: bool, certify: bool
) -> np.ndarray:
    """The user side of one step of Alg. 1 (lines 9-13): at a pass start (Alg. 3) every record of the
    pass is eligible again and `accepted` is empty; the users take their `accepted` records (mask over
    `users.record_keys`) and their saturated users' records are retired, with, where `certify`, the
    records the saturation certificate rejects (`certified_rejections`). Returns the retired records'
    mask, for the co-owners in other partitions to retire too."""
    if pass_start:
        users.eligible[:] = True
    dead = consume(users, accepted)
    if certify:
        dead |= certified_rejections(users, arity)
    retire(users, dead)
    return dead


def beyond_saturation(inc_user: np.ndarray, alone: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Per incidence, whether its user certainly saturates before reaching it: at least capacity[u]
    records that u owns alone come earlier in u's preference order. Incidences are sorted by (user,
    preference); `alone` marks those whose record has this one user; `capacity` is per user.

    The certificate (sequential greedy in the universal order, It's my data too Alg. 2): a record owned
    by u alone is accepted exactly when u is not saturated as it comes, so u is saturated at the latest
    once its capacity[u]-th such record has come, and every later record of u is rejected. A rejected
    record changes no other decision (it takes no capacity), so dropping it from the graph before
    the rounds leaves the selection as it is. It holds on any subset of the graph that keeps whole
    records (a record partition): fewer records alone can only place the certificate later.
    """
    if not len(inc_user):
        return np.zeros(0, dtype=bool)
    alone_before = np.cumsum(alone, dtype=np.int64)
    alone_before -= alone
    starts = np.concatenate([[0], np.flatnonzero(inc_user[1:] != inc_user[:-1]) + 1])
    alone_before -= np.repeat(alone_before[starts], np.diff(np.append(starts, len(inc_user))))
    return alone_before >= capacity[inc_user]  # records alone strictly earlier, same user, against u's capacity


def certified_rejections(users: UserSide, arity: np.ndarray) -> np.ndarray:
    """Records (mask over `users.record_keys`) that `beyond_saturation` certifies rejected, from every
    incidence of these users (eligible or not: the certificate is a property of the graph and the
    capacities, the same at a pass start and when a later pipeline run rebuilds the state)."""
    beyond = beyond_saturation(users.inc_user, arity[users.inc_record] == 1, users.capacity)
    return np.bincount(users.inc_record[beyond], minlength=len(users.record_keys)) > 0


def certified_records(
    user_codes: np.ndarray, inc_record: np.ndarray, rank: np.ndarray, arity: np.ndarray, capacity: np.ndarray
) -> np.ndarray:
    """`certified_rejections` on whole records in any order (a record partition, before its incidences
    go to the users' partitions): per incidence its user code and record, per record its preference
    rank and arity, per user code its capacity -> mask over records."""
    order = np.lexsort((rank[inc_record], user_codes))
    inc_record = inc_record[order]
    beyond = beyond_saturation(user_codes[order], arity[inc_record] == 1, capacity)
    return np.bincount(inc_record[beyond], minlength=len(arity)) > 0


def retire(users: UserSide, dead: np.ndarray) -> None:
    """Alg. 1 line 13 for co-owners: records (mask over record_keys) of saturated users leave E."""
    users.eligible &= ~dead[users.inc_record]


def compact(users: UserSide, keep: np.ndarray) -> tuple[UserSide, np.ndarray, np.ndarray]:
    """The incidences `keep` marks, with only the records and users they reference, so that the state
    of later rounds holds only what can still change: (side, kept records mask over `record_keys`,
    kept users mask over the users)."""
    records = np.zeros(len(users.record_keys), dtype=bool)
    records[users.inc_record[keep]] = True
    kept_users = np.zeros(len(users.residual), dtype=bool)
    kept_users[users.inc_user[keep]] = True
    inc_user = (np.cumsum(kept_users) - 1)[users.inc_user[keep]]
    side = UserSide(
        inc_user=inc_user,
        inc_record=(np.cumsum(records) - 1)[users.inc_record[keep]],
        record_keys=users.record_keys[records],
        first_incidence=np.searchsorted(inc_user, np.arange(int(kept_users.sum()))),
        residual=users.residual[kept_users],
        capacity=users.capacity[kept_users],
        eligible=users.eligible[keep],
    )
    return side, records, kept_users


def merge_sides(sides: list[UserSide]) -> tuple[UserSide, list[np.ndarray]]:
    """User sides of distinct users as one, records matched by key across them: (merged side, each
    side's records' positions in the merged `record_keys`). Each side's incidences stay in their
    (user, preference) order, users numbered side after side."""
    record_keys = np.unique(np.concatenate([s.record_keys for s in sides] + [np.zeros(0, np.int64)]))
    positions = [np.searchsorted(record_keys, s.record_keys) for s in sides]
    user_base = np.cumsum([0] + [len(s.residual) for s in sides])
    inc_user = np.concatenate([s.inc_user + base for s, base in zip(sides, user_base)] + [np.zeros(0, np.int64)])
    merged = UserSide(
        inc_user=inc_user,
        inc_record=np.concatenate([p[s.inc_record] for s, p in zip(sides, positions)] + [np.zeros(0, np.int64)]),
        record_keys=record_keys,
        first_incidence=np.searchsorted(inc_user, np.arange(user_base[-1])),
        residual=np.concatenate([s.residual for s in sides] + [np.zeros(0, np.int64)]),
        capacity=np.concatenate([s.capacity for s in sides] + [np.zeros(0, np.int64)]),
        eligible=np.concatenate([s.eligible for s in sides] + [np.zeros(0, bool)]),
    )
    return merged, positions


def local_mask(record_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Bool mask over sorted `record_keys` of the given keys (all present)."""
    mask = np.zeros(len(record_keys), dtype=bool)
    mask[np.searchsorted(record_keys, keys)] = True
    return mask


START_PASS, ROUND, DONE = "pass", "round", "done"  # what the next step of the algorithm is


@dataclasses.dataclass(frozen=True)
class Control:
    """The control flow of Alg. 1 that every engine shares, as an immutable value advanced after each
    step: rounds until no record is eligible, and with duplicates (Alg. 3) passes over the residual
    capacities until a pass starts with none; `max_rounds` stops early, leaving the undecided records
    unselected. A step is a pass start (every record of the pass made eligible again, then the
    saturated users' records retired) or a round; `after` takes what the step selected and how many
    records are still eligible (undecided) after it."""

    duplicates: bool
    max_rounds: int | None
    next: str = START_PASS
    per_round: tuple[RoundStats, ...] = ()
    passes: int = 0
    converged: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            **{field.name: getattr(self, field.name) for field in dataclasses.fields(self)},
            "per_round": [one.to_json() for one in self.per_round],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Control:
        return cls(**{**data, "per_round": tuple(RoundStats.from_json(one) for one in data["per_round"])})

    def after(self, selected: int, eligible: int) -> Control:
        if self.next == START_PASS:
            if eligible == 0:
                return dataclasses.replace(self, next=DONE, converged=True)
            return dataclasses.replace(self, next=self._round_or_stop(), passes=self.passes + 1)
        if self.next != ROUND:
            raise ValueError(f"no step follows {self.next!r}")
        record = RoundStats(len(self.per_round) + 1, self.passes, selected, eligible)
        advanced = dataclasses.replace(self, per_round=(*self.per_round, record))
        if eligible:
            return dataclasses.replace(advanced, next=advanced._round_or_stop())
        if not self.duplicates:
            return dataclasses.replace(advanced, next=DONE, converged=True)
        return dataclasses.replace(advanced, next=START_PASS)

    @property
    def certifies(self) -> bool:
        """Whether this step also rejects the records `certified_rejections` names: the start of the
        only pass (with duplicates, each pass makes every record eligible again)."""
        return not self.duplicates and self.next == START_PASS and self.passes == 0

    def _round_or_stop(self) -> str:
        return DONE if self.max_rounds is not None and len(self.per_round) >= self.max_rounds else ROUND

    def log_rounds(self, since: int = 0) -> None:
        for one in self.per_round[since:]:
            log.info(
                "round %d (pass %d): selected %d, %d records still eligible",
                one.round,
                one.pass_,
                one.selected,
                one.eligible,
            )


def run_steps(
    users: UserSide,
    arity: np.ndarray,
    undecided: np.ndarray,
    control: Control,
    on_selected=None,
    log_rounds: bool = True,
) -> Control:
    """Alg. 1 (and Alg. 3's passes) on one partition holding whole records, from `control` to the end.

    `arity` counts each record's incidences (all in `users`), `undecided` marks the records eligible
    in the pass in progress; `on_selected(mask)` hears of each round's selected records; each round
    is logged as it ends unless `log_rounds` is False (a Beam worker: the driver logs them). The
    start of a bounding without duplicates also rejects the records the saturation certificate names
    (`certified_rejections`). Returns the final control.
    """
    while control.next != DONE:
        accepted = np.zeros(len(arity), dtype=bool)
        pass_start = control.next == START_PASS
        if pass_start:
            undecided = np.ones(len(arity), dtype=bool)
        else:
            accepted = unanimous(users.inc_record[propose(users)], arity)
            undecided &= ~accepted
            if on_selected is not None:
                on_selected(accepted)
        dead = consume_and_retire(users, accepted, arity, pass_start, control.certifies)
        undecided &= ~dead
        rounds_before = len(control.per_round)
        control = control.after(int(accepted.sum()), int(undecided.sum()))
        if log_rounds:
            control.log_rounds(rounds_before)
    return control
