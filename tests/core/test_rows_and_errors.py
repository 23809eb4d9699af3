"""One definition of a row, read alike by the engines and the verifier (README, Input: what ends a row,
UTF-8 only, a byte order mark at byte 0 only, nesting depth, lone surrogates), and clear errors where
inputs, reports or the disk fail: a named `InputError` (exit 2) or a verifier's violation, never a
traceback, a crash or a hang. Both engines read records with `record_reading.read_file` and list
inputs with `records.list_input_files`, so these run on the local engine."""

from __future__ import annotations

import errno
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
from inspect import signature

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, reseal_selection, write_records

from madp.cli import main
from madp.core import record_reading, storage
from madp.core.errors import InputError
from madp.core.records import Columns, FileResult
from madp.core.verify import verify_batches

LOCAL = ["--runner", "local"]


def cli(capsys, *args) -> tuple[int, dict | None, str]:
    code = main(["-q", *map(str, args)])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip().startswith("{") else None), err


def cli_process(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    """The CLI in a process of its own: a row that crashes a reader (a segfault) or a listing that never
    ends must fail this test, not end the test run."""
    return subprocess.run(
        [sys.executable, "-m", "madp.cli", "-q", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def rows(count: int, users=lambda i: [i % 7, 100 + i % 5]) -> list[dict]:
    return [{"id": i, "users": users(i), "x": [float(i), 1.0], "label": i % 2} for i in range(count)]


def jsonl(values: list[dict]) -> bytes:
    return b"".join(json.dumps(v).encode() + b"\n" for v in values)


def bound_and_verify(capsys, tmp_path, data, *extra) -> tuple[dict, dict]:
    """Bound everything valid (K above any user's records) and verify it with a K that large: the
    verifier must find every selected id exactly once in the input and the same largest contribution,
    i.e. it reads the rows the engine kept."""
    output = tmp_path / "b"
    code, report, err = cli(capsys, "bound", data, output, "-k", "1000", "--on-invalid", "skip", *extra, *LOCAL)
    assert code == 0, err
    code, verdict, err = cli(capsys, "verify-bound", data, output, "-k", "1000")
    assert code == 0 and verdict["ok"], verdict or err
    assert verdict["max_user_contribution"] == report["max_user_contribution"]
    assert verdict["distinct_selected"] == report["input_records"]
    return report, verdict


def rejected(output) -> list[dict]:
    path = os.path.join(output, "rejected", "rejected.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


# --- Section 4: the row rules ------------------------------------------------------------------


def test_a_lone_cr_ends_no_row_so_engine_and_verifier_see_one_graph(tmp_path, capsys):
    """Split at a lone CR, this line is the record 5 of user 7 (a second record for 7, over K=1); read
    as one row it is record 5 of user 8. The engine split it and the verifier did not, so a selection
    over the engine's bound passed the verifier."""
    line = b'{"a":\r{"id":5,"users":[7]}\r,"id":5,"users":[8]}'
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"id":0,"users":[7]}\n' + line + b"\n")
    report, verdict = bound_and_verify(capsys, tmp_path, data)
    assert report["rejected_total"] == 0 and report["input_records"] == 2
    assert report["max_user_contribution"] == verdict["max_user_contribution"] == 1


def test_crlf_rows_read_as_lf_rows_and_a_bom_only_at_byte_0(tmp_path, capsys):
    """CRLF and LF files read the same (blank CRLF lines skipped); a byte order mark at byte 0 is
    allowed, one starting a later row (two Windows files concatenated) is invalid_json for the engine
    as for the verifier; a UTF-16 line is not UTF-8 text."""
    body = [json.dumps(r).encode() for r in rows(40)]
    data = tmp_path / "d.jsonl"
    utf16 = json.dumps({"id": 1000, "users": [1]}).encode("utf-16-le")
    data.write_bytes(
        b"\xef\xbb\xbf"
        + b"\r\n".join(body[:20])
        + b"\r\n \r\n"
        + b"\xef\xbb\xbf"
        + b"\r\n".join(body[20:])
        + b"\r\n"
        + utf16
        + b"\n"
    )
    report, _ = bound_and_verify(capsys, tmp_path, data)
    assert report["rejected"] == {"invalid_json": 2} and report["input_records"] == 39
    assert sorted(r["row"] for r in rejected(tmp_path / "b")) == [20, 40]


def test_lone_surrogates_and_text_that_is_not_utf8_are_invalid_rows(tmp_path, capsys):
    """A lone surrogate escaped in an id, a user or content, or raw bytes that are not UTF-8, could be
    neither hashed nor written (UnicodeEncodeError even under --on-invalid skip): such a row is
    invalid_json; an escaped surrogate pair is one character and fine."""
    good = [{"id": f"r{i}", "users": [f"u{i % 5}"], "text": "ok"} for i in range(30)]
    data = tmp_path / "d.jsonl"
    data.write_bytes(
        jsonl(good)
        + b'{"id": "\\ud800", "users": ["u1"], "text": "ok"}\n'
        + b'{"id": "r100", "users": ["\\udfff"], "text": "ok"}\n'
        + b'{"id": "r101", "users": ["u1"], "text": "x\\ud83dy"}\n'
        + b'{"id": "r102\xff", "users": ["u1"], "text": "ok"}\n'
        + b'{"id": "r103", "users": ["u1"], "text": "\\ud83d\\ude00"}\n'
    )
    report, _ = bound_and_verify(capsys, tmp_path, data)
    assert report["rejected"] == {"invalid_json": 4} and report["input_records"] == 31
    code, _, err = cli(capsys, "bound", data, tmp_path / "strict", "-k", "2", *LOCAL)
    assert code == 2 and "row 30: invalid_json" in err and "row 33: invalid_json" in err


def test_parquet_text_that_is_not_utf8_is_a_bad_id_or_user(tmp_path, capsys):
    """Parquet stores any bytes in a string column and Arrow does not check them on reading: such an id
    was selected and then crashed verify-bound. It is a bad_id_type (bad_user_type) row now."""
    ids = pa.array([f"r{i}".encode() for i in range(20)] + [b"r\xff", b"r21"], pa.binary()).view(pa.string())
    users = pa.array([[f"u{i % 3}".encode()] for i in range(21)] + [[b"u\xfe"]], pa.list_(pa.binary()))
    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": ids, "users": users.cast(pa.list_(pa.binary())).view(pa.list_(pa.string()))}), data)
    report, _ = bound_and_verify(capsys, tmp_path, data)
    assert report["rejected"] == {"bad_id_type": 1, "bad_user_type": 1} and report["input_records"] == 20
    assert {r["row"] for r in rejected(tmp_path / "b")} == {20, 21}


@pytest.mark.slow
def test_rows_nested_too_deep_are_invalid_not_a_crash(tmp_path, capsys):
    """A row nested ~30k deep crashed Arrow's reader (exit 139) and made the verifier recurse. Rows
    nesting arrays and objects more than 100 deep are invalid_json; 100 deep is fine, and brackets
    inside strings do not count."""
    data = tmp_path / "d.jsonl"
    deep = b'{"id": 1001, "users": [1], "x": ' + b"[" * 30000 + b"]" * 30000 + b"}"
    at_limit = b'{"id": 1002, "users": [1], "x": ' + b"[" * 99 + b"]" * 99 + b"}"
    over = b'{"id": 1003, "users": [1], "x": ' + b"[" * 100 + b"]" * 100 + b"}"
    quoted = json.dumps({"id": 1004, "users": [1], "text": "[" * 500}).encode()
    data.write_bytes(jsonl(rows(30)) + deep + b"\n" + at_limit + b"\n" + over + b"\n" + quoted + b"\n")
    done = cli_process("bound", data, tmp_path / "b", "-k", "1000", "--on-invalid", "skip", *LOCAL)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["rejected"] == {"invalid_json": 2} and report["input_records"] == 32
    assert sorted(r["row"] for r in rejected(tmp_path / "b")) == [30, 32]
    code, verdict, err = cli(capsys, "verify-bound", data, tmp_path / "b", "-k", "1000")
    assert code == 0 and verdict["ok"] and verdict["distinct_selected"] == 32, verdict or err


def test_the_verifier_keeps_exactly_the_rows_the_engine_keeps(tmp_path, capsys):
    """An id whose other row has no users, or a user beyond 64 bits, is selected (those rows are
    rejected): the verifier counted them and reported the id twice in the input."""
    data = write_records(
        str(tmp_path / "d.jsonl"),
        [*rows(20), {"id": 3, "users": []}, {"id": 4, "users": [2**70]}, {"id": 2**70, "users": [1]}],
    )
    report, _ = bound_and_verify(capsys, tmp_path, data)
    assert report["rejected"] == {"empty_users": 1, "bad_id_type": 1, "bad_user_type": 1}


def test_hidden_and_underscore_directories_are_skipped_by_engine_and_verifier(tmp_path, capsys):
    """`.ipynb_checkpoints/` and Spark's `_temporary/` hold copies of the records: read, every id was a
    duplicate (the verifier skipped only the first, the engine neither)."""
    data = tmp_path / "in"
    (data / "part").mkdir(parents=True)
    write_records(str(data / "part" / "d.jsonl"), rows(50))
    for hidden in (".ipynb_checkpoints", "_temporary/0"):
        (data / "part" / hidden).mkdir(parents=True)
        shutil.copy(data / "part" / "d.jsonl", data / "part" / hidden / "d.jsonl")
    report, _ = bound_and_verify(capsys, tmp_path, data)
    assert report["rejected_total"] == 0 and report["input_records"] == 50


@pytest.mark.slow
def test_a_link_loop_in_an_input_directory_is_an_error_not_a_hang(tmp_path, capsys):
    data = tmp_path / "in"
    (data / "sub").mkdir(parents=True)
    write_records(str(data / "sub" / "d.jsonl"), rows(50))
    assert cli(capsys, "bound", data, tmp_path / "b", "-k", "2", *LOCAL)[0] == 0
    os.symlink("..", data / "sub" / "loop")
    done = cli_process("bound", data, tmp_path / "b2", "-k", "2", *LOCAL, timeout=60)
    assert done.returncode == 2 and "a directory holding it (a loop)" in done.stderr and "loop" in done.stderr
    assert "Traceback" not in done.stderr
    code, verdict, _ = cli(capsys, "verify-bound", data, tmp_path / "b", "-k", "2")
    assert code == 1 and any("loop" in v and "sub/loop" in v for v in verdict["violations"])


def test_an_empty_gzip_file_is_named_like_an_empty_parquet_file(tmp_path, capsys):
    data = tmp_path / "in"
    data.mkdir()
    write_records(str(data / "a.jsonl"), rows(50))
    assert cli(capsys, "bound", data, tmp_path / "b", "-k", "2", *LOCAL)[0] == 0
    (data / "b.jsonl.gz").write_bytes(b"")
    code, _, err = cli(capsys, "bound", data, tmp_path / "b2", "-k", "2", *LOCAL)
    assert code == 2 and "b.jsonl.gz: not a readable gzip file (0 bytes)" in err
    code, verdict, _ = cli(capsys, "verify-bound", data, tmp_path / "b", "-k", "2")
    assert code == 1 and any("b.jsonl.gz: cannot be read" in v for v in verdict["violations"])
    (data / "b.jsonl.gz").write_bytes(gzip.compress(jsonl(rows(3)))[:-6])  # truncated
    code, _, err = cli(capsys, "bound", data, tmp_path / "b2", "-k", "2", *LOCAL)
    assert code == 2 and "b.jsonl.gz: not a readable gzip file" in err


def test_the_verifier_reads_no_file_outside_the_output(tmp_path, capsys):
    """A report naming its selection by an absolute or `..` name: the verifier followed it, read a file
    elsewhere and vouched for it."""
    data = write_records(str(tmp_path / "d.jsonl"), rows(200))
    assert cli(capsys, "bound", data, tmp_path / "b", "-k", "2", *LOCAL)[0] == 0
    report_path = tmp_path / "b" / "report.json"
    report = json.loads(report_path.read_text())
    (shard,) = report["selection_files"]
    elsewhere = tmp_path / "elsewhere.parquet"
    shutil.move(tmp_path / "b" / "selected" / shard["name"], elsewhere)
    for name in (str(elsewhere), "../../elsewhere.parquet"):
        report["selection_files"] = [{**shard, "name": name}]
        report_path.write_text(json.dumps(report))
        code, verdict, _ = cli(capsys, "verify-bound", data, tmp_path / "b", "-k", "2")
        assert code == 1 and any("not a file inside" in v for v in verdict["violations"]), verdict
        code, _, err = cli(
            capsys, "batch", tmp_path / "b", data, tmp_path / "o", "--steps", "3", "--batch-size", "5", *LOCAL
        )
        assert code == 2 and "selection_files is not a list of files" in err


def hostile_jsonl(rng: random.Random) -> bytes:
    """JSON Lines bytes of one-line objects, their record values mostly of one type and sometimes not,
    other columns of changing types; at times with rows Arrow may not read at once."""
    strings = rng.random() < 0.4
    odd = rng.choice([0.0, 0.02, 0.2])
    lines = []
    for i in range(rng.choice([1, 5, 60, 1500])):
        if strings:
            record_id = b'"r%d"' % i
            odd_ids = [b'"r1"', b"null", b'"\\u00e9"', b'""', b"7"]
            users = rng.choice([b'["a@x.org","b"]', b'["c","c"]', b'["Bob <b@y.com>"]'])
        else:
            record_id = b"%d" % i
            odd_ids = [b"null", b"-0", b"1", b"1.5", b"true", b"%d" % 2**63]
            users = rng.choice([b"[%d,%d]" % (i % 7, i % 11), b"[1,1,2]", b"[%d,%d]" % (-(2**63), 2**63 - 1)])
        if rng.random() < odd:
            record_id = rng.choice(odd_ids)
        if rng.random() < odd:
            users = rng.choice([b"[]", b"null", b"[null]", b"[[1]]", b'[1,"a"]', b'"x"', b"[%d]" % 2**64])
        other = rng.choice([b"", b',"x":1', b',"x":"a"', b',"x":{"a":[1]}', b',"x":1,"x":2', b',"t":"\xc3\xa9"'])
        cc = rng.choice([b',"from":"a@b.c","to":["d@e.f"],"cc":[]', b',"from":["q"],"to":[],"cc":[null]', b""])
        line = b'{"id":%s,"users":%s%s%s}' % (record_id, users, other, cc)
        lines.append(line.replace(b'"id":%s,' % record_id, b"") if rng.random() < odd / 4 else line)
    if rng.random() < 0.2:
        hostile = [b"", b" ", b"not json", b'{"id":1} {"id":2}', b'{"id":1,', b"\xff{}", b'{"t":"\\ud800"}', b"[" * 120]
        lines.insert(rng.randrange(len(lines) + 1), rng.choice(hostile))
    return (b"\xef\xbb\xbf" if rng.random() < 0.1 else b"") + b"\n".join(lines) + rng.choice([b"", b"\n", b"\r\n"])


def read_or_error(read, *args) -> object:
    try:
        return read(*args)
    except InputError as error:
        return str(error)


def test_rows_read_at_once_give_the_records_rejects_and_facts_of_rows_read_one_by_one():
    """`read_jsonl` reads a file's record columns at once where Arrow may (`_plain_records`), with the
    types the row-by-row parse gives its leading rows: the same records, rejects (each as read) and
    errors as `read_lines`, which reads the file's rows one by one where Arrow cannot type them."""
    rng = random.Random(3)
    at_once = 0
    for _ in range(150):
        data = hostile_jsonl(rng)
        for columns in (Columns(), Columns(user_ids="email"), Columns(users_columns=("from", "to", "cc"))):
            expected = read_or_error(record_reading.read_lines, record_reading.jsonl_rows(data), "f", 0, columns)
            got = read_or_error(record_reading.read_jsonl, data, "f", 0, columns)
            at_once += record_reading._plain_records(data.removeprefix(b"\xef\xbb\xbf"), "f", columns) is not None
            if isinstance(expected, str):
                assert got == expected, data
                continue
            assert isinstance(got, FileResult), got
            chunk, wanted = got.chunk, {columns.id, *columns.user_sources}
            assert chunk.keys.tolist() == expected.chunk.keys.tolist(), data
            assert chunk.ids.equals(expected.chunk.ids) and chunk.users.equals(expected.chunk.users), data
            assert chunk.offsets.tolist() == expected.chunk.offsets.tolist(), data
            assert vars(got.rejects) == vars(expected.rejects), data
            assert (got.rows_read, got.repeated_users_removed) == (expected.rows_read, expected.repeated_users_removed)
            assert got.facts._replace(columns=None) == expected.facts._replace(columns=None), data
            assert got.facts.columns & wanted == expected.facts.columns & wanted, data  # what check_facts reads
    assert at_once > 50, at_once  # of 450 reads


# --- Section 5: clear errors -------------------------------------------------------------------


class _FullDisk:
    """An output stream whose writes fail as on a full disk, after the file was created."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stream.close()


@pytest.mark.parametrize("failing", ["report.json", ".parquet"])
def test_a_full_disk_is_an_error_naming_the_output_and_leaves_no_report(tmp_path, capsys, monkeypatch, failing):
    data = write_records(str(tmp_path / "d.jsonl"), rows(100))
    real = storage.open_output

    def open_output(path):
        stream = real(path)
        return _FullDisk(stream) if failing in os.path.basename(path) else stream

    monkeypatch.setattr(storage, "open_output", open_output)
    code, _, err = cli(capsys, "bound", data, tmp_path / "b", "-k", "2", *LOCAL)
    assert code == 2 and "cannot write " in err and "No space left on device" in err, err
    assert failing.lstrip(".") in err.split("cannot write ")[1].split(":")[0]
    assert "free space there, or write to another file system" in err and err.rstrip().endswith("run the command again")
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "b" / "report.json").exists()  # never a 0-byte report a consumer would read
    left = [name for _, _, names in os.walk(tmp_path / "b") for name in names if name.endswith(".tmp")]
    assert not left


@pytest.mark.parametrize(
    "text, said",
    [
        ("", "is not a madp bound report (not JSON"),
        ("[1, 2]", "is not a madp bound report (a JSON list"),
        ("{}", "lists no selection_files"),
        ('{"selection_files": [{"name": 3}]}', "selection_files is not a list of files"),
    ],
)
def test_a_malformed_bound_report_is_named_by_its_consumers(tmp_path, capsys, text, said):
    data = write_records(str(tmp_path / "d.jsonl"), rows(100))
    assert cli(capsys, "bound", data, tmp_path / "b", "-k", "2", *LOCAL)[0] == 0
    (tmp_path / "b" / "report.json").write_text(text)
    code, _, err = cli(
        capsys, "batch", tmp_path / "b", data, tmp_path / "o", "--steps", "3", "--batch-size", "5", *LOCAL
    )
    assert code == 2 and said in err, err
    code, verdict, _ = cli(capsys, "verify-bound", data, tmp_path / "b", "-k", "2")
    assert code == 1 and verdict["violations"], verdict


def test_a_bound_report_without_its_figures_is_named_by_batch(tmp_path, capsys):
    data = write_records(str(tmp_path / "d.jsonl"), rows(100))
    assert cli(capsys, "bound", data, tmp_path / "b", "-k", "2", *LOCAL)[0] == 0
    path = tmp_path / "b" / "report.json"
    report = json.loads(path.read_text())
    del report["contribution_bound"]
    path.write_text(json.dumps(report))
    code, _, err = cli(
        capsys, "batch", tmp_path / "b", data, tmp_path / "o", "--steps", "3", "--batch-size", "5", *LOCAL
    )
    assert code == 2 and "lacks ['contribution_bound']" in err, err


@pytest.mark.parametrize("text", ["", "[]", '{"files": "batches-00000-of-00001.tfrecord"}'])
def test_a_malformed_batch_report_is_a_violation_of_verify_batches(tmp_path, capsys, text):
    data = write_records(str(tmp_path / "d.jsonl"), rows(100))
    assert cli(capsys, "bound", data, tmp_path / "b", "-k", "2", *LOCAL)[0] == 0
    batch = ("batch", tmp_path / "b", data, tmp_path / "o", "--steps", "3", "--batch-size", "5", *LOCAL)
    assert cli(capsys, *batch)[0] == 0
    (tmp_path / "o" / "report.json").write_text(text)
    # verify-batches gains --selected and -k (a change beside this one): pass them where it has them
    bound = ["--selected", tmp_path / "b", "-k", "2"] if "selected" in signature(verify_batches).parameters else []
    code, verdict, err = cli(capsys, "verify-batches", tmp_path / "o", data, "--min-sep", "1", *bound)
    assert code == 1 and verdict["violations"] and "report" in verdict["violations"][0] + err, verdict


def test_a_selection_shard_the_report_vouches_for_but_unreadable_is_a_violation(tmp_path, capsys):
    """A tampered shard resealed in the report (a faulty engine): not Parquet, or ids that are not text."""
    data = write_records(str(tmp_path / "d.jsonl"), rows(100))
    assert cli(capsys, "bound", data, tmp_path / "b", "-k", "2", *LOCAL)[0] == 0
    shard = next((tmp_path / "b" / "selected").iterdir())
    shard.write_bytes(b"not parquet")
    reseal_selection(tmp_path / "b")
    code, verdict, _ = cli(capsys, "verify-bound", data, tmp_path / "b", "-k", "2")
    assert code == 1 and any("not a readable selection" in v for v in verdict["violations"])
    ids = pa.array([b"\xff"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"id": ids, "copies": pa.array([1], pa.int64())}), shard)
    reseal_selection(tmp_path / "b")
    code, verdict, _ = cli(capsys, "verify-bound", data, tmp_path / "b", "-k", "2")
    assert code == 1 and any("is not a string or a 64-bit integer" in v for v in verdict["violations"])


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_capacities_with_a_byte_order_mark_read_alike(tmp_path, capsys, suffix):
    """Arrow's CSV reader skipped the mark, the verifier's did not (KeyError 'user')."""
    data = write_records(str(tmp_path / "d.jsonl"), rows(200, users=lambda i: [i % 7]))
    capacities = tmp_path / f"caps{suffix}"
    body = "user,capacity\n3,5\n" if suffix == ".csv" else '{"user": 3, "capacity": 5}\n'
    capacities.write_bytes(b"\xef\xbb\xbf" + body.encode())
    code, report, err = cli(capsys, "bound", data, tmp_path / "b", "-k", "2", "--capacities", capacities, *LOCAL)
    assert code == 0 and report["max_user_contribution"] == 5, err
    code, verdict, err = cli(capsys, "verify-bound", data, tmp_path / "b", "-k", "2", "--capacities", capacities)
    assert code == 0 and verdict["ok"] and verdict["max_user_contribution"] == 5, verdict or err
    capacities.write_bytes(b"\xef\xbb\xbf" + (b"who,capacity\n3,5\n" if suffix == ".csv" else b"[1]\n"))
    code, verdict, _ = cli(capsys, "verify-bound", data, tmp_path / "b", "-k", "2", "--capacities", capacities)
    assert code == 1 and any("not a readable capacities file" in v for v in verdict["violations"])


def test_an_unreadable_input_file_is_named(tmp_path, capsys, monkeypatch):
    """chmod 000 denies nothing to root, who runs these tests: the denial is emulated at `open_input`."""
    data = write_records(str(tmp_path / "d.jsonl"), rows(50))
    real = storage.open_input

    def open_input(path):
        if path.endswith("d.jsonl"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real(path)

    monkeypatch.setattr(storage, "open_input", open_input)
    code, _, err = cli(capsys, "bound", data, tmp_path / "b", "-k", "2", *LOCAL)
    assert code == 2 and "d.jsonl: cannot be read (Permission denied)" in err, err


def test_the_drivers_look_at_a_parquet_file_reads_its_leading_rows_not_its_first_row_group(tmp_path, monkeypatch):
    path = str(tmp_path / "one-group.parquet")
    rows = [{"id": i, "users": [f"u{i % 9}"]} for i in range(5 * record_reading.LEADING_ROWS)]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=len(rows))
    read = record_reading.read_parquet_rows
    seen: list[int] = []
    monkeypatch.setattr(
        record_reading, "read_parquet_rows", lambda table, *a: seen.append(len(table)) or read(table, *a)
    )
    facts = record_reading.leading_facts(path, Columns())
    assert seen == [record_reading.LEADING_ROWS]
    assert (facts.id_type, facts.user_type) == (pa.int64(), pa.string())
    no_groups = str(tmp_path / "no-groups.parquet")
    pq.ParquetWriter(no_groups, pa.Table.from_pylist(rows).schema).close()
    assert pq.ParquetFile(no_groups).num_row_groups == 0
    assert record_reading.leading_facts(no_groups, Columns()).columns == frozenset(["id", "users"])
