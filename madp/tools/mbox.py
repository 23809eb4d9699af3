"""`madp import-mbox MBOX OUTPUT`: email as multi-user records.

One record per message: id = its Message-ID (without angle brackets), or "sha256:" + a hash of
sender, date, subject and body when it has none; users = the sender and the To and Cc addresses,
lower-cased and deduplicated (an email belongs to everyone on it, It's my data too, Sec. 1);
content = subject and plain-text body. Messages that cannot be used are skipped, counted by
reason and written to OUTPUT/rejected.jsonl; records go to OUTPUT/records/ as Parquet, ready for
`madp bound OUTPUT/records ...`.
"""

from __future__ import annotations

import email
import email.policy
import email.utils
import hashlib
import json
import logging
import mailbox
import os
import time

import pyarrow as pa
import pyarrow.parquet as pq

from madp.core.errors import InputError

log = logging.getLogger("madp.mbox")
ROWS_PER_WRITE = 10_000
SCHEMA = pa.schema(
    [("id", pa.string()), ("users", pa.list_(pa.string())), ("subject", pa.string()), ("body", pa.string())]
)
REASONS = ("unparseable", "no_sender", "duplicate_message_id", "undecodable_body", "text_before_first_message")


def normalized_addresses(*headers: str | None) -> list[str]:
    """Lower-cased addr-spec of every address in the headers, first occurrence kept, non-addresses dropped."""
    seen: dict[str, None] = {}
    for _, address in email.utils.getaddresses([h for h in headers if h]):
        address = address.strip().lower()
        if "@" in address and not address.startswith("@") and not address.endswith("@"):
            seen.setdefault(address, None)
    return list(seen)


def plain_text(message: email.message.EmailMessage) -> str:
    """The plain-text body ('' when the message has only other parts)."""
    part = message.get_body(preferencelist=("plain",))
    return "" if part is None else part.get_content()


def message_record(raw: bytes) -> tuple[dict | None, str | None]:
    """(record, None) or (None, reason) for one message's bytes."""
    try:
        message = email.message_from_bytes(raw, policy=email.policy.default)
        sender = normalized_addresses(str(message.get("From", "") or ""))
        users = normalized_addresses(
            str(message.get("From", "") or ""), str(message.get("To", "") or ""), str(message.get("Cc", "") or "")
        )
        subject = str(message.get("Subject", "") or "")
        message_id = str(message.get("Message-ID", "") or "").strip().strip("<>").strip()
        date = str(message.get("Date", "") or "")
    except Exception:  # noqa: BLE001  (any header the email package cannot parse makes the message unusable)
        return None, "unparseable"
    if not sender:
        return None, "no_sender"
    try:
        body = plain_text(message)
    except (LookupError, UnicodeError, KeyError):
        return None, "undecodable_body"
    if not message_id:
        digest = hashlib.sha256("\0".join([sender[0], date, subject, body]).encode("utf-8", "surrogatepass"))
        message_id = "sha256:" + digest.hexdigest()
    return {"id": message_id, "users": users, "subject": subject, "body": body}, None


def preamble(path: str) -> bytes:
    """The bytes before the first line that starts a message ("From "): the mbox reader skips them."""
    head = []
    with open(path, "rb") as handle:
        for line in handle:
            if line.startswith(b"From "):
                break
            head.append(line)
    return b"".join(head)


def import_mbox(path: str, output: str) -> dict:
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such mbox file")
    skipped_text = preamble(path)
    if skipped_text.strip() and len(skipped_text) == os.path.getsize(path):
        raise InputError(
            f"{path}: no message: an mbox file starts each message with a 'From ' line (a single "
            f".eml message needs one, e.g. 'From sender@example.com Thu Jan  1 00:00:00 1970')"
        )
    started = time.perf_counter()
    records_dir = os.path.join(output, "records")
    os.makedirs(records_dir, exist_ok=True)
    for name in os.listdir(records_dir):
        if name.endswith(".parquet"):
            os.remove(os.path.join(records_dir, name))
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
            rejected.write(
                json.dumps(
                    {
                        "message": None,
                        "reason": "text_before_first_message",
                        "head": skipped_text[:300].decode("utf-8", "replace"),
                    }
                )
                + "\n"
            )
        for index, key in enumerate(box.iterkeys()):
            messages += 1
            raw = box.get_bytes(key)
            record, reason = message_record(raw)
            if record is not None and record["id"] in seen_ids:
                record, reason = None, "duplicate_message_id"
            if record is None:
                assert reason is not None  # message_record gives a reason for every record it refuses
                counts[reason] += 1
                rejected.write(
                    json.dumps({"message": index, "reason": reason, "head": raw[:300].decode("utf-8", "replace")})
                    + "\n"
                )
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
