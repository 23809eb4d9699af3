"""String user ids that may name one person under several ids, and reading user ids as e-mail addresses.

The contribution bound holds per user id: a person written as "ann@x" in one row and "Ann <ann@x>"
in another is two users, and keeps up to K records under each. A string user id shows a sign of
this (`SIGNS`) when it has surrounding whitespace, or holds an '@' (is an e-mail address) and is not
a plain lower-case address: one in angle brackets (a display name), several addresses, an address
with upper-case letters, or anything else around or inside one. Reading records finds
them per value (`find_suspects`, vectorized over each users column), so every engine and every
split of a file finds the same, and `record_reading.check_facts` refuses them over the whole
input unless `--user-ids` says how to read the ids: `email` (each value's addresses become its
users: `email_users`) or `as-is`. `madp/core/verify/user_ids.py` implements the same rules on its own.
"""

from __future__ import annotations

import re
import unicodedata
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
NOT_PLAIN = "not_a_plain_address"
SIGNS = {
    SEVERAL_ADDRESSES: "several addresses in one value: ',' or ';' and two '@' or more",
    DISPLAY_NAME: "an address in angle brackets, as after a display name",
    WHITESPACE: "whitespace around the id",
    UPPER_CASE: "an address (one '@', no whitespace) with upper-case letters A-Z",
    NOT_PLAIN: "an id holding '@' that is no plain lower-case address, as with a comment, a separator, inner "
    "whitespace, 'mailto:', an invisible character, quotes, a subaddress ('+') or a trailing dot",
}
EXAMPLES = 3  # values a refusal shows per sign
_ANGLE_ADDRESS = r"<[^<>]*@[^<>]*>"


def _address_pattern(letters: str) -> str:
    """An address of dot-atoms of `letters` and RFC 5322's other atext characters but '|' (exports separate
    addresses with it) and '+' (what follows it is a subaddress of the same mailbox: `ann+news@x` is
    `ann@x`), neither beginning nor ending with a quote ("'ann'@x" is `ann@x` quoted), at a domain of
    dot-separated labels of `letters`, digits and '-', neither beginning nor ending with '-' (RFC 1035).
    Written for RE2 (pyarrow's regular expressions), which has no lookaround."""
    character = f"{letters}0-9!#$%&*/=?^_`{{}}~-"  # atext but '|', '+' and the quote
    atext = f"['{character}]"
    local = rf"[{character}](?:(?:\.?{atext})*\.?[{character}])?"
    label = f"[{letters}0-9](?:[{letters}0-9-]*[{letters}0-9])?"
    return rf"^{local}@{label}(\.{label})*$"


# A plain address: what shows no sign. A bare ASCII address (upper case too) is what `email_addresses`
# finds as it is, so `email_users` takes it lower-cased without a parse.
_PLAIN_ADDRESS = _address_pattern("a-z")
_BARE_ADDRESS = _address_pattern("A-Za-z")


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
    passes over every value, one over those holding '@', the rest over those that are not plain
    addresses. Whitespace is Unicode's, as Python's str.isspace and str.strip take it."""
    whitespace = pc.not_equal(pc.utf8_trim_whitespace(values), values).to_numpy(zero_copy_only=False)
    found = {sign: np.zeros(len(values), dtype=bool) for sign in SIGNS}
    found[WHITESPACE] = whitespace
    index = np.flatnonzero(pc.match_substring(values, "@").to_numpy(zero_copy_only=False))
    index = index[~_matches(values.take(pa.array(index)), _PLAIN_ADDRESS)]  # every other sign needs one of these
    if not len(index):
        return found
    candidates = values.take(pa.array(index))
    at_signs = pc.count_substring(candidates, "@").to_numpy(zero_copy_only=False)
    has_whitespace = pc.list_value_length(pc.utf8_split_whitespace(candidates)).to_numpy(zero_copy_only=False) > 1
    found[SEVERAL_ADDRESSES][index] = (at_signs >= 2) & _matches(candidates, "[,;]")
    found[DISPLAY_NAME][index] = _matches(candidates, _ANGLE_ADDRESS)
    found[UPPER_CASE][index] = (at_signs == 1) & ~has_whitespace & _matches(candidates, "[A-Z]")
    shown = [found[sign][index] for sign in (SEVERAL_ADDRESSES, DISPLAY_NAME, WHITESPACE, UPPER_CASE)]
    found[NOT_PLAIN][index] = ~np.logical_or.reduce(shown)
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
        tuple((sign, n) for sign, n in counts.items() if n), _first_examples(found for _, _, found in examples)
    )


def _first_examples(examples) -> tuple[Suspect, ...]:
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
    examples = _first_examples(found for read in suspects for found in read.examples)
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
        "become its users: display names, comments and 'mailto:' dropped, split at ',', ';' and '|', "
        "lower-cased; a value no address can be read from is a bad_address) or "
        "--user-ids as-is (take every id as it is: you state that distinct ids are distinct people)"
    )


# Unicode's Default_Ignorable_Code_Point characters (DerivedCoreProperties.txt): invisible where they are
# not supported (variation selectors, the combining grapheme joiner, Hangul fillers, tags); most are format
# characters (Cf), which are removed whatever their code point.
_DEFAULT_IGNORABLE = re.compile(
    "[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e\u2060-\u206f"
    "\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
    "\U000e0000-\U000e0fff]"
)


def _invisible(character: str) -> bool:
    """A format character (Cf) or another default-ignorable code point: what a reader does not see."""
    return unicodedata.category(character) == "Cf" or _DEFAULT_IGNORABLE.match(character) is not None


_SEPARATORS = re.compile("[;|]")  # what exports separate addresses with, beside the ',' getaddresses splits at
_PARSED_AS_WRITTEN = re.compile('[<>()"]')  # angle addresses, comments, quoted strings: getaddresses reads them
_MAILTO = re.compile("mailto:", re.IGNORECASE | re.ASCII)
_QUOTED_LOCAL_PART = re.compile(r"""^("[^"\\]*"|'[^'\\]*')@""")
_SUBADDRESS = re.compile(r"^([^@+]+)\+[^@]*@")
# What an address read from a value must be, lower-cased: a plain address, whose letters may be any
# printable non-ASCII character too (an internationalized address).
_READ_ADDRESS = re.compile(_address_pattern("a-z\u0080-\U0010ffff"))


def email_addresses(value: str) -> list[str]:
    """The e-mail addresses one user value holds, as user ids, in order; none where an address in it
    cannot be read. The value in NFKC form, without invisible characters (Unicode's format characters,
    Cf, and its other default-ignorable code points: zero-width spaces, byte order marks, variation
    selectors, the combining grapheme joiner) and 'mailto:', split at ';' and '|', and at whitespace too
    where it holds no angle bracket, parenthesis or quote; then what `email.utils.getaddresses` finds in
    it (it splits at ',' and drops display names, quotes and comments), each address stripped and
    lower-cased, a local part of a dot-atom in double or single quotes unquoted, a subaddress ('+' and
    what follows it in the local part) and a final '.' (the DNS root) dropped. Parts without an '@' (a
    name's "Smith" in `Smith, Ann <ann@x>`) are no address; an address that is then no plain address (a
    letter of it may be any printable non-ASCII character) makes the whole value hold none. A repeat
    stays, for the reading to remove and count as any repeated user."""
    text = "".join(c for c in unicodedata.normalize("NFKC", value) if not _invisible(c))
    text = _MAILTO.sub("", text)
    parts = _SEPARATORS.split(text)
    if not _PARSED_AS_WRITTEN.search(text):
        parts = [word for part in parts for word in part.split()]
    found = []
    for _, address in getaddresses(parts):
        address = address.strip().lower()
        if "@" not in address:
            continue
        address = _QUOTED_LOCAL_PART.sub(lambda quoted: f"{quoted[1][1:-1]}@", address)
        address = _SUBADDRESS.sub(r"\1@", address).removesuffix(".")
        if not (_READ_ADDRESS.fullmatch(address) and address.isprintable()):
            return []
        found.append(address)
    return found


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
