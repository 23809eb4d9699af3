"""`madp import-mbox`: users from From/To/Cc normalized and deduplicated, Message-ID or a stable
fallback, plain-text bodies, malformed messages counted and written out, and the records bound."""

from __future__ import annotations

import json
import mailbox
from email.message import EmailMessage

import pyarrow.parquet as pq
import pytest

from madp.cli import main


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
