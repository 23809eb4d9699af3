"""String user ids as the verifiers read them: the signs that one may name a person also written another
way (noted without --user-ids, `_Suspects`), and the e-mail addresses it holds (--user-ids email)."""

from __future__ import annotations

import re
import unicodedata
from collections import Counter, defaultdict
from email.utils import getaddresses

# The signs that a string user id may name a person who is also written another way (docs/how-to/your-data.md,
# User ids written as e-mail addresses).
_SIGNS = {
    "several_addresses": "several addresses in one value",
    "display_name": "an address in angle brackets",
    "surrounding_whitespace": "whitespace around the id",
    "upper_case": "an address with upper-case letters",
    "not_a_plain_address": "an id holding '@' that is no plain lower-case address",
}
_ANGLE_ADDRESS = re.compile(r"<[^<>]*@[^<>]*>")
_UPPER = re.compile(r"[A-Z]")
# RFC 5322's atext but '|' and '+' (a subaddress follows it), and a domain's label (no '-' at either end),
# of ASCII letters `letters` (a plain address's are lower case), or with `letters` any printable non-ASCII
# character too (an address read under email); the local part neither begins nor ends with a quote
# (`_unquoted_ends`).
_ATOM = "[{letters}0-9!#$%&'*/=?^_`{{}}~-]+"
_LABEL = "[{letters}0-9]+(?:-+[{letters}0-9]+)*"
_ADDRESS = r"{atom}(?:\.{atom})*@{label}(?:\.{label})*"
_PLAIN = re.compile(_ADDRESS.format(atom=_ATOM.format(letters="a-z"), label=_LABEL.format(letters="a-z")))
_INTERNATIONAL = "a-z\u0080-\U0010ffff"
_READ = re.compile(
    _ADDRESS.format(atom=_ATOM.format(letters=_INTERNATIONAL), label=_LABEL.format(letters=_INTERNATIONAL))
)


def _signs_of(user: str) -> list[str]:
    """The signs a string user id shows: ',' or ';' with two '@' or more; an address in angle brackets;
    whitespace (str.isspace's) around it; one '@', no whitespace and an upper-case letter A-Z; an '@'
    in an id that shows none of those and is not a plain address (lower-case dot-atoms but '|' at a
    domain of lower-case labels)."""
    at_signs = user.count("@")
    shown = {
        "several_addresses": at_signs >= 2 and ("," in user or ";" in user),
        "display_name": bool(_ANGLE_ADDRESS.search(user)),
        "surrounding_whitespace": user != user.strip(),
        "upper_case": at_signs == 1 and not any(c.isspace() for c in user) and bool(_UPPER.search(user)),
    }
    plain = _PLAIN.fullmatch(user) and _unquoted_ends(user)
    shown["not_a_plain_address"] = at_signs > 0 and not any(shown.values()) and not plain
    return [sign for sign, found in shown.items() if found]


def _unquoted_ends(address: str) -> bool:
    """Whether the local part of an address neither begins nor ends with a quote ("'ann'@x" quotes ann@x)."""
    local = address.rpartition("@")[0]
    return not local.startswith("'") and not local.endswith("'")


# Unicode's Default_Ignorable_Code_Point ranges (DerivedCoreProperties.txt), as (first, last) code points
_IGNORABLE = (
    (0xAD, 0xAD), (0x34F, 0x34F), (0x61C, 0x61C), (0x115F, 0x1160), (0x17B4, 0x17B5), (0x180B, 0x180F),
    (0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F), (0x3164, 0x3164), (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF),
)  # fmt: skip


def _shown(c: str) -> bool:
    """Whether a reader sees character `c`: not a format character (Cf) nor another default-ignorable one."""
    return unicodedata.category(c) != "Cf" and not any(first <= ord(c) <= last for first, last in _IGNORABLE)


def _addresses(user: str) -> list[str]:
    """The e-mail addresses a user value holds (--user-ids email), or none where one cannot be read: in
    the value's NFKC form, without invisible characters (Cf, and the other default-ignorable ones) and
    'mailto:' (any case), split at ';' and '|' (and at whitespace unless it holds one of <>()"),
    email.utils.getaddresses' addresses holding an '@', each stripped, lower-cased, unquoted ('"ann"@x'
    and "'ann'@x" are ann@x), without a subaddress (ann+news@x is ann@x) and without a final '.'; each
    must then be a plain address (non-ASCII letters allowed)."""
    text = "".join(c for c in unicodedata.normalize("NFKC", user) if _shown(c))
    text = re.sub("(?ai)mailto:", "", text)
    parts = re.split("[;|]", text)
    if not any(c in text for c in '<>()"'):
        parts = [word for part in parts for word in part.split()]
    read = []
    for _, found in getaddresses(parts):
        address = found.strip().lower()
        if "@" in address:
            local, _, domain = address.rpartition("@")
            if len(local) > 1 and local[0] == local[-1] and local[0] in "\"'" and local[0] not in local[1:-1]:
                local = local[1:-1]
            if "+" in local[1:] and "@" not in local:  # (an address of two '@' is none)
                local = local[: local.index("+", 1)]
            address = f"{local}@{domain[:-1] if domain.endswith('.') else domain}"
            if not (_READ.fullmatch(address) and _unquoted_ends(address) and address.isprintable()):
                return []
            read.append(address)
    return read


class _Suspects:
    """The string user ids of valid rows that show a sign, read without --user-ids: how many per sign,
    and the first few of each (file, row, column, value)."""

    def __init__(self) -> None:
        self.count: Counter = Counter()
        self.shown: defaultdict = defaultdict(list)

    def note(self, path: str, row: int, columns: list[str], values: list) -> None:
        for column, value in zip(columns, values):
            for user in value if isinstance(value, list) else [value]:
                for sign in _signs_of(user) if isinstance(user, str) else ():
                    self.count[sign] += 1
                    if len(self.shown[sign]) < 3:
                        self.shown[sign].append(f"{path} row {row} column {column!r}: {user!r}")

    def violations(self) -> list[str]:
        if not self.count:
            return []
        found = ", ".join(
            f"{sign}: {self.count[sign]} ({_SIGNS[sign]}; e.g. {'; '.join(self.shown[sign])})"
            for sign in _SIGNS
            if self.count[sign]
        )
        return [
            f"string user ids that may name one person under several ids, each then bounded on its own: {found}; "
            f"no engine reads them without --user-ids email or --user-ids as-is"
        ]
