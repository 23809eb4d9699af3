"""`madp import-mbox MBOX OUTPUT`: email as multi-user records.

One record per message: id = its Message-ID (without angle brackets), or "sha256:" + a hash of
sender, date, subject and body when it has none; users = every address of every From, To, Cc, Bcc
and Resent-From/To/Cc/Bcc header (an email belongs to everyone on it, It's my data too, Sec. 1; a
user left out would have contributions the bound does not count); content = subject and plain-text
body. Messages that cannot be used are skipped, counted by reason and written to
OUTPUT/rejected.jsonl; records go to OUTPUT/records/ as Parquet, ready for `madp bound OUTPUT/records ...`.

Memory stays linear in a message's size: the headers madp reads (addresses, Subject, Message-ID,
Date) are decoded here in one pass each, because the email package's header parser keeps a copy of
the rest of the header for every RFC 2047 encoded-word (memory quadratic in their number: a 280 KB
Subject took 2.85 GB); the headers the email package itself parses to find the body (Content-*) are
refused above MAX_PARSED_HEADER characters (reason `oversized_header`), and a message of more than
MAX_LINES lines or MAX_PARTS MIME parts (`oversized_message`), as the email package's memory grows
with its lines and its time with its parts.
"""

from __future__ import annotations

import binascii
import codecs
import email
import email.message
import email.policy
import email.utils
import encodings
import encodings.aliases
import functools
import hashlib
import json
import logging
import mailbox
import os
import pkgutil
import re
import time
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from madp.core.errors import InputError

log = logging.getLogger("madp.mbox")
ROWS_PER_WRITE = 10_000
SCHEMA = pa.schema(
    [("id", pa.string()), ("users", pa.list_(pa.string())), ("subject", pa.string()), ("body", pa.string())]
)
REASONS = (
    "unparseable",
    "no_sender",
    "duplicate_message_id",
    "undecodable_body",
    "oversized_header",
    "oversized_message",
    "text_before_first_message",
)
SENDER_FIELDS = ("from",)
# Resent-* name the people a message was forwarded by and to, who hold it as much as its first
# recipients; Sender and Reply-To are left out: they name an agent or a list (one user on all of
# its mail would let the bound keep only k of those messages) rather than a party to the message.
ADDRESS_FIELDS = frozenset(("from", "to", "cc", "bcc", "resent-from", "resent-to", "resent-cc", "resent-bcc"))
# Longest header (in characters, folded) the email package may parse: its parser needs memory
# quadratic in the encoded-words of a header and ~20 us per character of parameters.
MAX_PARSED_HEADER = 8192
# Most lines in one message: the email package holds a Python object per line (and per MIME part)
# while it parses, ~100 bytes for a line that may be 2 ("a\n" a million times took 115 MB for a
# 2.8 MB message). A 25 MB attachment in base64 is ~450,000 lines.
MAX_LINES = 1_000_000
# Most MIME parts in one message: the email package spends ~165 us on each (a 2.3 MB message of
# 333,000 empty parts took 55 s).
MAX_PARTS = 10_000


class Skipped(Exception):
    """A message that cannot be a record: `reason` (one of REASONS) and `detail`, what was wrong."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class _BoundedPolicy(email.policy.EmailPolicy):
    """email.policy.default, except that a header longer than MAX_PARSED_HEADER is refused
    (Skipped `oversized_header`) instead of parsed: the parser reads Content-Type while it splits
    the parts and get_body reads the Content-* headers, all through this method."""

    def header_fetch_parse(self, name: str, value: str) -> Any:
        if len(value) > MAX_PARSED_HEADER:
            raise Skipped("oversized_header", f"{name} header of {len(value)} characters (limit {MAX_PARSED_HEADER})")
        return super().header_fetch_parse(name, value)


POLICY = _BoundedPolicy()


class _PartCounter:
    """The message_factory of one message's parse: an EmailMessage per part, up to MAX_PARTS."""

    def __init__(self) -> None:
        self.parts = 0

    def __call__(self, policy: email.policy.Policy) -> email.message.EmailMessage:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise Skipped("oversized_message", f"more than {MAX_PARTS} MIME parts")
        return email.message.EmailMessage(policy=policy)


# Every name the encodings package can resolve (its aliases and modules), normalized as it does:
# only these reach codecs.lookup, which caches every name it fails on for the life of the process.
_CODEC_NAMES = frozenset(encodings.aliases.aliases) | frozenset(encodings.aliases.aliases.values())
_CODEC_NAMES |= frozenset(module.name for module in pkgutil.iter_modules(encodings.__path__))
# Decoders with time quadratic in their input (a list insertion per character).
_SLOW_CODECS = frozenset(("punycode", "idna"))


@functools.lru_cache(maxsize=256)
def text_codec(charset: str) -> str | None:
    """The Python text codec of a MIME charset name (RFC 2045/2231, a "*language" suffix
    ignored), or None when Python has none, it is not a text encoding (base64, zlib: bytes to
    bytes) or its decoder is slower than linear."""
    name = encodings.normalize_encoding(charset.partition("*")[0]).lower().replace(".", "_")
    if name not in _CODEC_NAMES:
        return None
    try:
        codec = codecs.lookup(name).name
        if codec in _SLOW_CODECS:
            return None
        b"a".decode(codec, "replace")  # LookupError for a codec that is not a text encoding
    except (LookupError, UnicodeError):  # UnicodeError: the "undefined" codec, which refuses all
        return None
    return codec


_SURROGATE = re.compile("[\ud800-\udfff]")


def _without_surrogates(text: str) -> str:
    """`text` with each lone surrogate (from UTF-7, unicode_escape, ...) replaced by U+FFFD, as
    Parquet strings are UTF-8."""
    return _SURROGATE.sub("\ufffd", text)


def _unfolded(value: str) -> str:
    """A raw header value on one line (RFC 5322 2.2.3: line breaks removed), its 8-bit bytes read
    as UTF-8 (RFC 6532) with U+FFFD for bytes that are not, as email.policy.default does."""
    value = value.replace("\r", "").replace("\n", "")
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


# RFC 2047 2: "=?" charset "?" encoding "?" encoded-text "?=". Neither charset nor text holds "?"
# or whitespace, so each character is scanned by at most one attempt: finditer is linear.
_ENCODED_WORD = re.compile(r"=\?([^?\s]+)\?([bBqQ])\?([^?\s]*)\?=", re.ASCII)


def _decoded_word(charset: str, encoding: str, text: str) -> str | None:
    """The text of one RFC 2047 encoded-word (4.1 B: base64, padding optional; 4.2 Q: "_" is a
    space, "=XX" a byte), or None when it is not one (non-ASCII or bad base64). Bytes in an
    unknown charset are read as UTF-8, as email.policy.default does."""
    if not text.isascii():
        return None
    data = text.encode("ascii")
    if encoding in "bB":
        try:
            raw = binascii.a2b_base64(data + b"=" * (-len(data) % 4))
        except binascii.Error:
            return None
    else:
        raw = binascii.a2b_qp(data, header=True)
    return raw.decode(text_codec(charset) or "utf-8", "replace")


def decoded_header(value: str) -> str:
    """An unstructured header (Subject) as text, in one pass and linear memory: unfolded, each
    encoded-word replaced by its text and the whitespace between two adjacent encoded-words
    dropped (RFC 2047 6.2); what is not a valid encoded-word is kept as written."""
    value = _unfolded(value)
    pieces: list[str] = []
    position = 0
    after_word = False
    for match in _ENCODED_WORD.finditer(value):
        text = _decoded_word(*match.groups())
        if text is None:
            continue  # left as written: it is part of the next gap
        gap = value[position : match.start()]
        if gap and (not after_word or gap.strip(" \t")):
            pieces.append(gap)
        pieces.append(text)
        position, after_word = match.end(), True
    pieces.append(value[position:])
    return _without_surrogates("".join(pieces))


def _normalized_address(text: str) -> str:
    """One address as a user id: whitespace runs as one space, none beside "@" or "." (RFC 5322's
    obsolete syntax allows it there: "bob @ example.com" is bob@example.com), trimmed, lower-cased.
    Two spellings of one mailbox may stay two users; normalizing only merges, never splits."""
    text = " ".join(text.split()).lower()
    for spaced, joined in ((" @", "@"), ("@ ", "@"), (" .", "."), (". ", ".")):
        text = text.replace(spaced, joined)
    return text


# A run of ordinary characters, a quoted-pair, or one special of RFC 5322 3.2.3.
_ADDRESS_TOKEN = re.compile(r'[^(),:;<>"\\]+|\\.?|.', re.DOTALL)


def _scan_addresses(value: str, literal: frozenset[str]) -> tuple[list[str], str | None]:
    """address_list's one pass, with the openers in `literal` read as plain characters:
    (addresses, None), or (partial, opener) when a comment, quoted string or angle bracket is
    still open at the end."""
    addresses: list[str] = []
    text: list[str] = []  # the current address's characters outside <...>
    angles: list[str] = []  # its <...> addresses
    inside: list[str] | None = None  # the characters of the open <...>
    depth = 0  # comment nesting
    quoted = False

    def finish() -> None:
        found = [_normalized_address(_route_stripped(angle)) for angle in angles]
        found = [address for address in found if address] or [_normalized_address("".join(text))]
        addresses.extend(address for address in found if address)
        text.clear()
        angles.clear()

    for match in _ADDRESS_TOKEN.finditer(value):
        token = match.group()
        target = text if inside is None else inside
        if token[0] == "\\":  # a quoted-pair: the character it quotes
            if not depth:
                target.append(token[1:])
        elif depth:  # comments (RFC 5322 3.2.2) nest; their text is no address
            depth += {"(": 1, ")": -1}.get(token, 0)
        elif quoted:
            if token == '"':
                quoted = False
            else:
                target.append(token)
        elif token in literal:
            target.append(token)
        elif token == '"':
            quoted = True
        elif token == "(":
            depth = 1
            target.append(" ")  # a comment separates like whitespace
        elif token == "<" and inside is None:
            inside = []
        elif token == ">" and inside is not None:
            angles.append("".join(inside))
            inside = None
        elif inside is None and token in ",;":
            finish()
        elif inside is None and token == ":":
            text.clear()  # a group's display name (RFC 5322 3.4) is no address
        else:
            target.append(token)
    for opener, still_open in (("(", depth > 0), ('"', quoted), ("<", inside is not None)):
        if still_open:
            return addresses, opener
    finish()
    return addresses, None


def _route_stripped(angle: str) -> str:
    """An angle-addr's addr-spec without an obsolete route ("<@relay,@relay2:bob@example.com>")."""
    return angle.partition(":")[2] if angle.lstrip().startswith("@") and ":" in angle else angle


def _address_list(value: str) -> list[str]:
    """The addresses of one address-list header (RFC 5322 3.4), normalized_address'ed, in order,
    in linear time: the addr-spec in angle brackets when there is one, else the text without its
    comments (an address without "@", "bob", is a user too); a group's display name and empty
    entries ("undisclosed-recipients:;") give none. A comment, quoted string or angle bracket
    never closed would swallow the addresses after it: the header is read again with that opener
    as a plain character (at most three passes)."""
    value = _unfolded(value)
    literal: frozenset[str] = frozenset()
    while True:
        addresses, unclosed = _scan_addresses(value, literal)
        if unclosed is None:
            return addresses
        literal |= {unclosed}


def _header_date(value: str) -> str:
    """The Date header as email.policy.default shows it (RFC 5322 form when it parses, else as
    written), so that fallback ids stay what they were; only short values are parsed."""
    value = _unfolded(value)
    if len(value) > 256:
        return value
    try:
        return email.utils.format_datetime(email.utils.parsedate_to_datetime(value))
    except (ValueError, TypeError, OverflowError, IndexError):
        return value


def _plain_text(message: email.message.EmailMessage) -> str:
    """The plain-text body ('' when the message has only other parts), its bytes decoded in its
    charset (us-ascii when it names none) as the email package's get_content does."""
    part = message.get_body(preferencelist=("plain",))
    if part is None:
        return ""
    charset = part.get_param("charset", "us-ascii")
    if isinstance(charset, tuple):  # an RFC 2231 value: (its charset, language, the value)
        charset = charset[2]
    codec = text_codec(str(charset))
    if codec is None:
        raise Skipped("undecodable_body", f"unknown charset {str(charset)[:100]!r}")
    payload = part.get_payload(decode=True)
    if not isinstance(payload, bytes):
        return ""
    return _without_surrogates(payload.decode(codec, "replace"))


def _message_record(raw: bytes) -> dict:
    """One message's bytes as a record, or Skipped with the reason it cannot be one."""
    lines = raw.count(b"\n") + raw.count(b"\r") - raw.count(b"\r\n")  # the parser breaks lines at all three
    if lines > MAX_LINES:
        raise Skipped("oversized_message", f"{lines} lines (limit {MAX_LINES})")
    try:
        message = email.message_from_bytes(raw, policy=POLICY.clone(message_factory=_PartCounter()))
        assert isinstance(message, email.message.EmailMessage)  # the policy's message_factory
        headers = [(str(name).lower(), value) for name, value in message.raw_items() if isinstance(value, str)]
    except Skipped:
        raise
    except Exception as error:  # noqa: BLE001  (any message the email package cannot split is unusable)
        raise Skipped("unparseable", f"{type(error).__name__}: {str(error)[:200]}") from None
    senders = [address for name, value in headers if name in SENDER_FIELDS for address in _address_list(value)]
    if not senders:
        has_from = any(name in SENDER_FIELDS for name, _ in headers)
        raise Skipped("no_sender", "no address in From" if has_from else "no From header")
    users = dict.fromkeys(senders)  # senders first, then the others in header order, each once
    for name, value in headers:
        if name in ADDRESS_FIELDS and name not in SENDER_FIELDS:
            users.update(dict.fromkeys(_address_list(value)))
    first = {name: value for name, value in reversed(headers)}  # the first instance of each header
    subject = decoded_header(first.get("subject", ""))
    message_id = _unfolded(first.get("message-id", "")).strip().strip("<>").strip()
    date = _header_date(first.get("date", ""))
    try:
        body = _plain_text(message)
    except (LookupError, UnicodeError, ValueError, RecursionError) as error:
        raise Skipped("undecodable_body", f"{type(error).__name__}: {str(error)[:200]}") from None
    if not message_id:
        digest = hashlib.sha256("\0".join([senders[0], date, subject, body]).encode("utf-8", "surrogatepass"))
        message_id = "sha256:" + digest.hexdigest()
    return {"id": message_id, "users": list(users), "subject": subject, "body": body}


def preamble(path: str) -> bytes:
    """The bytes before the first line that starts a message ("From "): the mbox reader skips them."""
    head = []
    with open(path, "rb") as handle:
        for line in handle:
            if line.startswith(b"From "):
                break
            head.append(line)
    return b"".join(head)


def _text_before_messages(path: str) -> bytes:
    """The text of an mbox file before its first 'From ' line; a missing file, or one with no such line, is
    refused."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such mbox file")
    skipped_text = preamble(path)
    if skipped_text.strip() and len(skipped_text) == os.path.getsize(path):
        raise InputError(
            f"{path}: no message: an mbox file starts each message with a 'From ' line (a single "
            f".eml message needs one, e.g. 'From sender@example.com Thu Jan  1 00:00:00 1970')"
        )
    return skipped_text


def _emptied_records_dir(output: str) -> str:
    """OUTPUT/records/, without the Parquet files of an earlier import."""
    records_dir = os.path.join(output, "records")
    os.makedirs(records_dir, exist_ok=True)
    for name in os.listdir(records_dir):
        if name.endswith(".parquet"):
            os.remove(os.path.join(records_dir, name))
    return records_dir


def _rejection(message: int | None, reason: str, detail: str, head: bytes) -> str:
    """A line of rejected.jsonl: the skipped message's index in the mbox (None for text before the first
    message), why it was skipped, and its first 300 bytes as text."""
    fields = {"message": message, "reason": reason, "detail": detail, "head": head[:300].decode("utf-8", "replace")}
    return json.dumps(fields) + "\n"


def import_mbox(path: str, output: str) -> dict:
    """`madp import-mbox`: each message of the mbox file `path` as a record in OUTPUT/records/, the messages
    skipped (and why) in OUTPUT/rejected.jsonl, and the counts in OUTPUT/report.json, which it returns."""
    skipped_text = _text_before_messages(path)
    started = time.perf_counter()
    records_dir = _emptied_records_dir(output)
    seen_ids: set[str] = set()
    counts = dict.fromkeys(REASONS, 0)
    rows: list[dict] = []
    written = messages = 0
    box = mailbox.mbox(path, create=False)
    with (
        pq.ParquetWriter(os.path.join(records_dir, "part-00000.parquet"), SCHEMA, write_page_checksum=True) as writer,
        open(os.path.join(output, "rejected.jsonl"), "w") as rejected,
    ):
        if skipped_text.strip():  # the reader drops it; count and keep it rather than lose it silently
            counts["text_before_first_message"] += 1
            detail = f"{len(skipped_text)} bytes before the first 'From ' line"
            rejected.write(_rejection(None, "text_before_first_message", detail, skipped_text))
        for index, key in enumerate(box.iterkeys()):
            messages += 1
            raw = box.get_bytes(key)
            try:
                record = _message_record(raw)
                if record["id"] in seen_ids:
                    raise Skipped("duplicate_message_id", f"Message-ID {record['id'][:200]!r} seen before")
            except Skipped as skip:
                counts[skip.reason] += 1
                rejected.write(_rejection(index, skip.reason, skip.detail, raw))
                continue
            seen_ids.add(record["id"])
            rows.append(record)
            if len(rows) == ROWS_PER_WRITE:
                writer.write_table(pa.Table.from_pylist(rows, SCHEMA))
                written += len(rows)
                rows = []
                log.info(
                    "%d messages, %d records, %.0f messages/s",
                    messages,
                    written,
                    messages / (time.perf_counter() - started),
                )  # the total is unknown while streaming
        if rows:
            writer.write_table(pa.Table.from_pylist(rows, SCHEMA))
            written += len(rows)
    report = {
        "mbox": path,
        "output": output,
        "messages": messages,
        "records": written,
        "skipped": {reason: count for reason, count in counts.items() if count},
        "skipped_total": sum(counts.values()),
        "wall_time_s": round(time.perf_counter() - started, 3),
    }
    with open(os.path.join(output, "report.json"), "w") as handle:
        json.dump(report, handle, indent=2)
    return report
