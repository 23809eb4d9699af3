"""`madp import-mbox`: users from From/To/Cc normalized and deduplicated, Message-ID or a stable
fallback, plain-text bodies, malformed messages counted and written out, and the records bound."""

from __future__ import annotations

import email
import email.policy
import json
import mailbox
import tracemalloc
from email.message import EmailMessage

import pyarrow.parquet as pq
import pytest

from madp.cli import main
from madp.tools.data.mbox import decoded_header, text_codec


def message(sender, to=None, cc=None, subject="hello", body="text", message_id=None, html=None) -> EmailMessage:
    mail = EmailMessage()
    if sender is not None:
        mail["From"] = sender
    if to:
        mail["To"] = to
    if cc:
        mail["Cc"] = cc
    mail["Subject"] = subject
    mail["Date"] = "Mon, 02 Nov 2026 10:00:00 +0000"
    if message_id:
        mail["Message-ID"] = message_id
    mail.set_content(body)
    if html:
        mail.add_alternative(html, subtype="html")
    return mail


@pytest.fixture
def mbox_file(tmp_path):
    path = tmp_path / "mail.mbox"
    box = mailbox.mbox(str(path))
    box.add(
        message(
            "Alice <Alice@Example.com>",
            "bob@example.com, Carol <carol@example.com>",
            cc="ALICE@example.com, dave@example.com",
            message_id="<m1@example.com>",
        )
    )
    box.add(
        message(
            "bob@example.com",
            "alice@example.com",
            subject="Re: hello",
            body="reply",
            message_id="<m2@example.com>",
            html="<p>reply</p>",
        )
    )
    box.add(message("carol@example.com", "alice@example.com", subject="no id", body="first"))
    box.add(message("carol@example.com", "bob@example.com", message_id="<m1@example.com>"))  # same Message-ID
    box.add(message(None, "bob@example.com", message_id="<m5@example.com>"))  # no sender
    box.add(
        message(
            "Zoë <zoe@example.com>",
            "alice@example.com",
            subject="Grüße",
            body="Hallo Welt",
            message_id="<m6@example.com>",
        )
    )
    box.flush()
    return str(path)


def test_import_mbox(mbox_file, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["-q", "import-mbox", mbox_file, str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["messages"] == 6 and report["records"] == 4
    assert report["skipped"] == {"duplicate_message_id": 1, "no_sender": 1} and report["skipped_total"] == 2
    rows = pq.read_table(out / "records").to_pylist()
    by_id = {row["id"]: row for row in rows}
    first = by_id["m1@example.com"]
    assert first["users"] == ["alice@example.com", "bob@example.com", "carol@example.com", "dave@example.com"]
    assert first["subject"] == "hello" and first["body"].strip() == "text"
    assert by_id["m2@example.com"]["body"].strip() == "reply"  # the plain part, not the HTML one
    assert by_id["m6@example.com"]["subject"] == "Grüße" and by_id["m6@example.com"]["users"][0] == "zoe@example.com"
    fallback = [row for row in rows if row["id"].startswith("sha256:")]
    assert len(fallback) == 1 and fallback[0]["body"].strip() == "first"
    rejected = [json.loads(line) for line in open(out / "rejected.jsonl")]
    assert [(r["message"], r["reason"]) for r in rejected] == [(3, "duplicate_message_id"), (4, "no_sender")]

    assert main(["-q", "import-mbox", mbox_file, str(tmp_path / "again")]) == 0
    capsys.readouterr()
    assert pq.read_table(tmp_path / "again" / "records").to_pylist() == rows  # stable ids, same records

    assert main(["-q", "bound", str(out / "records"), str(tmp_path / "bounded"), "-k", "2", "--runner", "local"]) == 0
    bounded = json.loads(capsys.readouterr().out)
    assert bounded["input_records"] == 4 and bounded["max_user_contribution"] <= 2


def test_missing_mbox_is_a_clear_error(tmp_path, capsys):
    assert main(["-q", "import-mbox", str(tmp_path / "none.mbox"), str(tmp_path / "out")]) == 2
    assert "no such mbox file" in capsys.readouterr().err


def test_unknown_charset_is_skipped_with_its_reason(tmp_path, capsys):
    path = tmp_path / "odd.mbox"
    box = mailbox.mbox(str(path))
    box.add(
        b"From: a@example.com\nTo: b@example.com\nSubject: odd\nMessage-ID: <x@y>\n"
        b"Content-Type: text/plain; charset=x-no-such-charset\n\nbody\n"
    )
    box.add(message("a@example.com", "c@example.com", message_id="<ok@y>"))
    box.flush()
    assert main(["-q", "import-mbox", str(path), str(tmp_path / "out")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["records"] == 1 and report["skipped"] == {"undecodable_body": 1}


def import_raw(tmp_path, capsys, *messages: bytes, name="box"):
    """Import mbox messages given as raw bytes through the CLI: (report, records by id, rejected rows)."""
    path = tmp_path / f"{name}.mbox"
    box = mailbox.mbox(str(path))
    for raw in messages:
        box.add(raw)
    box.flush()
    out = tmp_path / f"{name}-out"
    assert main(["-q", "import-mbox", str(path), str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    records = {row["id"]: row for row in pq.read_table(out / "records").to_pylist()}
    return report, records, [json.loads(line) for line in open(out / "rejected.jsonl")]


def test_every_address_header_counts(tmp_path, capsys):
    """A second To or Cc header, Bcc and Resent-* add users: each person on a message is one of its users."""
    raw = (
        b"From: Alice <alice@example.com>\nTo: bob@example.com\nTo: Carol <carol@example.com>\n"
        b"Cc: dave@example.com\nCc: erin@example.com, Bob <BOB@example.com>\nBcc: frank@example.com\n"
        b"Resent-From: gina@example.com\nResent-To: hank@example.com\nReply-To: list@example.com\n"
        b"Message-ID: <two-to@example.com>\nSubject: s\n\nbody\n"
    )
    report, records, _ = import_raw(tmp_path, capsys, raw)
    assert report["records"] == 1
    assert records["two-to@example.com"]["users"] == [
        "alice@example.com",
        "bob@example.com",
        "carol@example.com",
        "dave@example.com",
        "erin@example.com",
        "frank@example.com",
        "gina@example.com",
        "hank@example.com",
    ]


def test_an_address_without_at_is_a_user(tmp_path, capsys):
    """Local names and bare phrases are users (trimmed, lower-cased); groups and empty entries are not;
    an unclosed comment does not hide the addresses after it."""
    raw = (
        b"From: root\nTo: Bob ,  Carol   Smith , undisclosed-recipients:;, , (a comment only)\n"
        b"Cc: dave (never closed, erin@example.com\nMessage-ID: <local@host>\n\nbody\n"
    )
    no_sender = b"From: friends:;\nTo: bob\nMessage-ID: <nobody@host>\n\nbody\n"
    report, records, rejected = import_raw(tmp_path, capsys, raw, no_sender)
    assert records["local@host"]["users"] == ["root", "bob", "carol smith", "dave (never closed", "erin@example.com"]
    assert report["skipped"] == {"no_sender": 1} and rejected[0]["detail"] == "no address in From"


def traced_peak(call) -> tuple[object, int]:
    """(call(), the most bytes Python held above what it held at the start), by tracemalloc."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        baseline = tracemalloc.get_traced_memory()[0]
        result = call()
        return result, tracemalloc.get_traced_memory()[1] - baseline
    finally:
        if started:
            tracemalloc.stop()


@pytest.mark.slow
def test_many_encoded_words_take_linear_memory(tmp_path, capsys):
    """A Subject of 200,000 RFC 2047 encoded-words (2.8 MB) is decoded in memory linear in its size:
    the email package's parser held the rest of the header per word (a 280 KB Subject took 2.85 GB)."""

    def run(words: int, name: str):
        subject = b" ".join([b"=?utf-8?q?a?="] * (words - 1) + [b"=?utf-8?b?w7w=?="])
        raw = b"From: a@example.com\nSubject: " + subject + b"\nMessage-ID: <" + name.encode() + b"@x>\n\nbody\n"
        return traced_peak(lambda: import_raw(tmp_path, capsys, raw, name=name))

    # First a size the quadratic parser survives (~180 MB on it), so that it fails here and never
    # reaches the big one, which would need ~285 GB.
    (_, small, _), small_peak = run(5_000, "small")
    assert small["small@x"]["subject"] == "a" * 4_999 + "ü"
    assert small_peak < 20e6, f"{small_peak / 1e6:.0f} MB for a 70 KB Subject"
    (report, big, _), big_peak = run(200_000, "big")
    assert report["records"] == 1 and big["big@x"]["subject"] == "a" * 199_999 + "ü"
    assert big_peak < 200e6, f"{big_peak / 1e6:.0f} MB for a 2.8 MB Subject"


@pytest.mark.slow
def test_oversized_mime_header_and_message_are_skipped_with_their_reason(tmp_path, capsys):
    """A Content-* header the email package would parse, over MAX_PARSED_HEADER characters, and a message
    of more than MAX_LINES lines or MAX_PARTS parts are skipped, counted and written out; the next is imported."""
    content_type = 'text/plain; name="' + " ".join(["=?utf-8?q?a?="] * 1_000) + '"'  # 14 KB
    long_type = f"From: a@example.com\nContent-Type: {content_type}\nMessage-ID: <ct@x>\n\nbody\n"
    many_lines = b"From: a@example.com\nMessage-ID: <lines@x>\n\n" + b"a\n" * 1_000_001
    many_parts = (
        b"From: a@example.com\nMessage-ID: <parts@x>\nContent-Type: multipart/mixed; boundary=b\n\n"
        + b"--b\n\nx\n" * 10_000
        + b"--b--\n"
    )  # 10,001 parts with the message itself
    ok = b"From: a@example.com\nMessage-ID: <ok@x>\n\nfine\n"
    report, records, rejected = import_raw(tmp_path, capsys, long_type.encode(), many_lines, many_parts, ok)
    assert list(records) == ["ok@x"]
    assert report["skipped"] == {"oversized_header": 1, "oversized_message": 2}
    assert [(r["message"], r["reason"]) for r in rejected] == [
        (0, "oversized_header"),
        (1, "oversized_message"),
        (2, "oversized_message"),
    ]
    assert rejected[0]["detail"] == f"Content-Type header of {len(content_type)} characters (limit 8192)"
    assert rejected[1]["detail"].endswith(" lines (limit 1000000)")  # with the mbox's separating blank line
    assert rejected[2]["detail"] == "more than 10000 MIME parts"


def test_lone_surrogates_do_not_stop_the_import(tmp_path, capsys):
    """Text that decodes to a lone surrogate (UTF-7, unicode_escape) is stored with U+FFFD: Parquet
    strings are UTF-8, and pyarrow refused the whole file."""
    raw = (
        b"From: a@example.com\nSubject: =?utf-7?q?x+2D3-?=\nMessage-ID: <s@x>\n"
        b"Content-Type: text/plain; charset=unicode_escape\n\nbody \\ud800\n"
    )
    _, records, _ = import_raw(tmp_path, capsys, raw)
    assert records["s@x"]["subject"] == "x\ufffd" and records["s@x"]["body"] == "body \ufffd\n"


@pytest.mark.parametrize(
    "value",
    [
        "plain  text ",
        "Re: =?utf-8?q?Gr=C3=BC=C3=9Fe?= aus =?ISO-8859-1?Q?K=F6ln?=",
        "=?utf-8?q?a?= =?utf-8?q?b?=\n =?utf-8?b?w7w=?=  x =?utf-8?b?w7w?=",  # joined words, folding
        "=?UTF-8*en?Q?caf=c3=a9_noir?= and x=?utf-8?q?a?=y",
        "=?unknown-8bit?q?Gr=C3=BC?= =?bogus?b?w7w=?= =?utf-8?b?!!!?= =?utf-8?q?=3F?=",
        "=?utf-8?q?broken =?utf-8?x?a?= ?= =?",
    ],
)
def test_decoded_header_reads_subjects_as_the_email_package(value):
    """decoded_header equals email.policy.default's reading of a Subject (the independent reference)."""
    parsed = email.message_from_bytes(f"Subject: {value}\n\n".encode(), policy=email.policy.default)
    assert decoded_header(next(parsed.raw_items())[1]) == str(parsed["Subject"])


def test_text_codec_refuses_bytes_codecs_and_slow_ones():
    assert [text_codec(name) for name in ("UTF-8", "latin1", "ISO-8859-1*de", "utf.8")] == [
        "utf-8",
        "iso8859-1",
        "iso8859-1",
        "utf-8",
    ]
    assert [text_codec(name) for name in ("base64", "zlib", "rot13", "punycode", "idna", "x-no-such", "")] == [None] * 7
