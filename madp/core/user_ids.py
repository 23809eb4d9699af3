"""String user ids that may name one person under several ids, and reading user ids as e-mail addresses.

The contribution bound holds per user id: a person written as "ann@x" in one row and "Ann <ann@x>"
in another is two users, and keeps up to K records under each. A string user id shows a sign of
this (`SIGNS`) when it has surrounding whitespace, holds an address in angle brackets (a display
name), holds several addresses, or is an address with upper-case letters. Reading records finds
them per value (`find_suspects`, vectorized over each users column), so every engine and every
split of a file finds the same, and `record_reading.check_facts` refuses them over the whole
input unless `--user-ids` says how to read the ids: `email` (each value's addresses become its
users: `email_users`) or `as-is`. `madp/core/verify.py` implements the same rules on its own.
"""

from __future__ import annotations

from email.utils import getaddresses
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

EMAIL = "email"  # --user-ids email: each value's e-mail addresses are its users
AS_IS = "as-is"  # --user-ids as-is: every id as it is (the operator's word that they are distinct users)
USER_IDS = (EMAIL, AS_IS)  # the choices of --user-ids; None (not given): checked for the signs, refused on one

# The signs, in the order a refusal names them, with what a value showing one holds.
SEVERAL_ADDRESSES = "several_addresses"
DISPLAY_NAME = "display_name"
WHITESPACE = "surrounding_whitespace"
UPPER_CASE = "upper_case"
SIGNS = {
    SEVERAL_ADDRESSES: "several addresses in one value: ',' or ';' and two '@' or more",
    DISPLAY_NAME: "an address in angle brackets, as after a display name",
    WHITESPACE: "whitespace around the id",
    UPPER_CASE: "an address (one '@', no whitespace) with upper-case letters A-Z",
}
EXAMPLES = 3  # values a refusal shows per sign
_ANGLE_ADDRESS = r"<[^<>]*@[^<>]*>"
_MAY_SHOW_A_SIGN = "[A-Z<,;]"  # what every sign but whitespace needs
# A bare ASCII address (dot-atom local part and domain): getaddresses finds it as it is, so
# `email_users` takes it lower-cased without a parse.
_ATEXT = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_BARE_ADDRESS = rf"^{_ATEXT}(\.{_ATEXT})*@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*$"


class Suspect(NamedTuple):
    """One user id showing a sign, where it was read."""

    sign: str
    source: str  # the input file
    row: int  # in the file
    column: str
    value: str


class SuspectUserIds(NamedTuple):
    """The string user ids of one read (a file, or a split of one) that show a sign: how many per
    sign (a value may show several), and the first `EXAMPLES` of each, in row order."""

    counts: tuple[tuple[str, int], ...]
    examples: tuple[Suspect, ...]


def signs(values: pa.Array) -> dict[str, np.ndarray]:
    """For each sign, whether each of `values` (string user ids, no nulls) shows it, vectorized: two
    passes over every value, the rest over those that may show one. Whitespace is Unicode's, as
    Python's str.isspace and str.strip take it."""
    whitespace = pc.not_equal(pc.utf8_trim_whitespace(values), values).to_numpy(zero_copy_only=False)
    found = {sign: np.zeros(len(values), dtype=bool) for sign in SIGNS}
    found[WHITESPACE] = whitespace
    index = np.flatnonzero(_matches(values, _MAY_SHOW_A_SIGN))
    if not len(index):
        return found
    candidates = values.take(pa.array(index))
    at_signs = pc.count_substring(candidates, "@").to_numpy(zero_copy_only=False)
    has_whitespace = pc.list_value_length(pc.utf8_split_whitespace(candidates)).to_numpy(zero_copy_only=False) > 1
    found[SEVERAL_ADDRESSES][index] = (at_signs >= 2) & _matches(candidates, "[,;]")
    found[DISPLAY_NAME][index] = _matches(candidates, _ANGLE_ADDRESS)
    found[UPPER_CASE][index] = (at_signs == 1) & ~has_whitespace & _matches(candidates, "[A-Z]")
    return found


def _matches(values: pa.Array, pattern: str) -> np.ndarray:
    return pc.match_substring_regex(values, pattern).to_numpy(zero_copy_only=False)


def find_suspects(source: str, read: list[tuple[str, pa.Array, np.ndarray]]) -> SuspectUserIds | None:
    """The user ids showing a sign among `read`: per users column, (its name, its string user ids of
    valid records, the row in the file of each); None when none shows one."""
    counts = dict.fromkeys(SIGNS, 0)
    examples = []
    for position, (column, values, rows) in enumerate(read):
        if not len(values):
            continue
        for sign, flags in signs(values).items():
            hits = np.flatnonzero(flags)
            counts[sign] += len(hits)
            for i in hits[:EXAMPLES].tolist():
                row = int(rows[i])
                examples.append((row, position, Suspect(sign, source, row, column, values[i].as_py())))
    if not any(counts.values()):
        return None
    examples.sort(key=lambda found: found[:2])
    return SuspectUserIds(
        tuple((sign, n) for sign, n in counts.items() if n), first_examples(found for _, _, found in examples)
    )


def first_examples(examples) -> tuple[Suspect, ...]:
    """The first `EXAMPLES` of each sign among `examples` (in the order given)."""
    kept: dict[str, list[Suspect]] = {sign: [] for sign in SIGNS}
    for found in examples:
        if len(kept[found.sign]) < EXAMPLES:
            kept[found.sign].append(found)
    return tuple(found for sign in SIGNS for found in kept[sign])


def refusal(suspects: list[SuspectUserIds]) -> str | None:
    """The message refusing the suspect user ids of every read (in file and row order), or None."""
    counts = dict.fromkeys(SIGNS, 0)
    for read in suspects:
        for sign, n in read.counts:
            counts[sign] += n
    if not any(counts.values()):
        return None
    examples = first_examples(found for read in suspects for found in read.examples)
    parts = []
    for sign, n in counts.items():
        if n:
            shown = "; ".join(
                f"{found.source} row {found.row} column {found.column!r}: {found.value!r}"
                for found in examples
                if found.sign == sign
            )
            parts.append(f"{sign}: {n} ({SIGNS[sign]}; e.g. {shown})")
    return (
        "string user ids that may name one person under several ids, who would then keep up to K records "
        "under each: " + ", ".join(parts) + ". Read them with --user-ids email (each value's e-mail addresses "
        "become its users: display names dropped, split at ',' and ';', stripped, lower-cased) or "
        "--user-ids as-is (take every id as it is: you state that distinct ids are distinct people)"
    )


def email_addresses(value: str) -> list[str]:
    """The e-mail addresses one user value holds, as user ids: those `email.utils.getaddresses` finds
    in it, split at ',' and at ';' too (display names, quotes and comments dropped), each stripped and
    lower-cased, in order; parts without an '@' (a name's "Smith" in `Smith, Ann <ann@x>`) are no
    address. A repeat stays, for the reading to remove and count as any repeated user."""
    found = (address.strip().lower() for _, address in getaddresses(value.split(";")))
    return [address for address in found if "@" in address]


def email_users(users: pa.ListArray) -> tuple[pa.ListArray, np.ndarray]:
    """Each record's string user values replaced by the addresses they hold (`email_addresses`, once
    per distinct value; a bare ASCII address lower-cased without a parse), and whether each record
    has a value holding none (a `bad_address`)."""
    flat = pc.list_flatten(users)
    parents = pc.list_parent_indices(users).to_numpy(zero_copy_only=False).astype(np.int64)
    encoded = pc.dictionary_encode(flat)
    codes = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    found = _addresses_of_distinct(encoded.dictionary)
    counts = pc.list_value_length(found).to_numpy(zero_copy_only=False).astype(np.int64)
    addresses = pc.list_flatten(found)
    per_value = counts[codes]  # addresses each user value becomes
    value_of = np.repeat(np.arange(len(codes)), per_value)
    within = np.arange(len(value_of)) - np.repeat(np.cumsum(per_value) - per_value, per_value)
    first = (np.cumsum(counts) - counts)[codes]
    row_counts = np.bincount(parents[value_of], minlength=len(users))
    offsets = np.concatenate([[0], np.cumsum(row_counts)]).astype(np.int32)
    no_address = np.zeros(len(users), dtype=bool)
    no_address[parents[per_value == 0]] = True
    normalized = addresses.take(pa.array(first[value_of] + within))
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), normalized), no_address


def _addresses_of_distinct(distinct: pa.Array) -> pa.ListArray:
    """`email_addresses` of each distinct value, in order: a bare ASCII address is its lower case (as
    getaddresses finds it whole), every other value is parsed."""
    is_bare = _matches(distinct, _BARE_ADDRESS)
    bare, other = np.flatnonzero(is_bare), np.flatnonzero(~is_bare)
    one_each = pa.array(np.arange(len(bare) + 1, dtype=np.int32))
    lists = pa.concat_arrays(
        [
            pa.ListArray.from_arrays(one_each, pc.utf8_lower(distinct.take(pa.array(bare))).cast(pa.string())),
            pa.array([email_addresses(v) for v in distinct.take(pa.array(other)).to_pylist()], pa.list_(pa.string())),
        ]
    )
    return lists.take(pa.array(np.argsort(np.concatenate([bare, other]))))
