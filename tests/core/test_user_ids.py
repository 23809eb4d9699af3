"""String user ids that may name one person under several ids ("a@x; b@y", "Ann <ann@x>", "ANN@X",
"bob@y "): refused by name by every reader (both engines, batch, recommend-k, the verifiers) unless
`--user-ids` says how to read them; `--user-ids email` makes each value's addresses its users, so a
person written every way is one user within K; `--user-ids as-is` reads them as they are."""

from __future__ import annotations

import json
import mailbox
import os
import re
from email.message import EmailMessage

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import write_records

from madp.cli import main
from madp.core.errors import InputError
from madp.core.record_reading import read_file
from madp.core.records import Columns

FROM_TO = ["--users-columns", "from,to"]
BEAM = ["--runner", "DirectRunner", "--direct_running_mode", "in_memory", "--partitions", "3"]
LOCAL = ["--runner", "local"]
K = 3
# Ann's one mailbox, written the ways exports write it.
ANN = ["ann@x.org", "Ann <ann@x.org>", "ANN@X.ORG", "ann@x.org ", '"Smith, Ann" <Ann@X.org>']


def cli(capsys, *args) -> tuple[int, dict | None, str]:
    code = main(["-q", *map(str, args)])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip().startswith("{") else None), err


def export(records: int = 300, seed: int = 0) -> list[dict]:
    """An email export: `from` one address, `to` the recipients as one delimited string ("u1@y.org;
    u7@y.org"). Ann is in every 4th record's `to` and sends every 10th (from 1), each time written
    another of the ANN ways."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(records):
        to = [f"u{u}@y.org" for u in rng.integers(0, 60, int(rng.integers(1, 3)))]
        sender = f"u{int(rng.integers(0, 60))}@y.org"
        if i % 4 == 0:
            to.insert(int(rng.integers(0, len(to) + 1)), ANN[(i // 4) % len(ANN)])
        if i % 10 == 1:
            sender = ANN[(i // 10) % len(ANN)]
        rows.append({"id": i, "from": sender, "to": "; ".join(to), "features": [float(i), 1.0], "label": i % 2})
    return rows


def anns(rows: list[dict]) -> set[int]:
    return {row["id"] for row in rows if "ann@x.org" in (row["from"] + row["to"]).lower()}


def addresses_by_hand(row: dict) -> set[str]:
    """The test's own reading of an export row's users: every lower-cased name@domain in it."""
    return set(re.findall(r"[\w.]+@[\w.]+", (row["from"] + " " + row["to"]).lower()))


def selection(output) -> dict:
    table = pa.concat_tables(pq.read_table(os.path.join(output, "selected", name)) for name in _shards(output))
    return dict(zip(table.column("id").to_pylist(), table.column("copies").to_pylist()))


def _shards(output) -> list[str]:
    return sorted(os.listdir(os.path.join(output, "selected")))


def _bound(capsys, data, output, *options) -> dict:
    code, report, err = cli(capsys, "bound", data, output, "-k", K, *FROM_TO, *options)
    assert code == 0, err
    return report


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_delimited_and_decorated_user_ids_are_refused_by_name(tmp_path, capsys, suffix):
    """Each sign named with its count, file, row, column and value, and both ways out; before anything
    is written, whatever --on-invalid says. A comma alone (an author "Smith, J."), a plain lower-case
    address and integer user ids show none."""
    directory = tmp_path / "export"
    directory.mkdir()
    plain = [{"id": 0, "from": "c@y.org", "to": "Smith, J."}, {"id": 1, "from": "c@y.org", "to": "d@y.org"}]
    write_records(str(directory / f"a{suffix}"), [*plain, {"id": 2, "from": "c@y.org", "to": "a@x.org; b@y.org"}])
    decorated = [{"id": 10 + i, "from": "c@y.org", "to": ann} for i, ann in enumerate(ANN)]
    write_records(str(directory / f"b{suffix}"), decorated)
    a, b = directory / f"a{suffix}", directory / f"b{suffix}"
    for options in ([], ["--on-invalid", "skip"]):
        code, _, err = cli(capsys, "bound", directory, tmp_path / "out", "-k", 1, *FROM_TO, *LOCAL, *options)
        assert code == 2
        assert "several_addresses: 1 (several addresses in one value" in err
        assert f"{a} row 2 column 'to': 'a@x.org; b@y.org'" in err
        assert "display_name: 2 " in err and f"{b} row 1 column 'to': 'Ann <ann@x.org>'" in err
        assert f"{b} row 4 column 'to': '\"Smith, Ann\" <Ann@X.org>'" in err
        assert "surrounding_whitespace: 1 " in err and f"{b} row 3 column 'to': 'ann@x.org '" in err
        assert "upper_case: 1 " in err and f"{b} row 2 column 'to': 'ANN@X.ORG'" in err
        assert "--user-ids email" in err and "--user-ids as-is" in err
        assert not (tmp_path / "out" / "selected").exists() and not (tmp_path / "out" / "report.json").exists()
    code, _, err = cli(
        capsys, "recommend-k", directory, *FROM_TO, *"--epsilon 4 --delta 1e-5 --steps 5 --batch-size 2".split()
    )
    assert code == 2 and "display_name: 2 " in err
    # The verifier re-derives the signs on its own: a bound that took the ids as they are, verified without
    # --user-ids, is a violation naming them (and naming the --user-ids the bound recorded).
    _bound(capsys, directory, tmp_path / "as-is", *LOCAL, "--user-ids", "as-is")
    code, found, _ = cli(capsys, "verify-bound", directory, tmp_path / "as-is", "-k", K, *FROM_TO)
    assert code == 1
    shown = " ".join(found["violations"])
    assert "read the user ids with --user-ids as-is, but verify-bound was given none" in shown
    assert "several_addresses: 1 " in shown and f"{a} row 2 column 'to': 'a@x.org; b@y.org'" in shown
    assert "display_name: 2 " in shown and "surrounding_whitespace: 1 " in shown and "upper_case: 1 " in shown
    # No sign: a comma alone, plain addresses, integer user ids.
    plain_only = write_records(str(tmp_path / f"plain{suffix}"), plain)
    assert _bound(capsys, plain_only, tmp_path / "plain", *LOCAL)["parameters"]["user_ids"] is None
    integers = write_records(str(tmp_path / f"int{suffix}"), [{"id": i, "users": [i, 7]} for i in range(5)])
    code, _, err = cli(capsys, "bound", integers, tmp_path / "int", "-k", 1, *LOCAL, "--user-ids", "email")
    assert code == 0, err


def test_with_user_ids_email_a_person_written_every_way_is_one_user_within_k(tmp_path, capsys):
    rows = export()
    data = write_records(str(tmp_path / "export.jsonl"), rows)
    report = _bound(capsys, data, tmp_path / "email", *LOCAL, "--user-ids", "email")
    assert report["parameters"]["user_ids"] == "email" and report["rejected_total"] == 0
    chosen = selection(tmp_path / "email")
    assert sum(chosen.get(i, 0) for i in anns(rows)) <= K < len(anns(rows))
    counts: dict = {}
    for row in rows:  # every user, by the test's own reading of the addresses
        for user in addresses_by_hand(row):
            counts[user] = counts.get(user, 0) + chosen.get(row["id"], 0)
    assert max(counts.values()) <= K and report["max_user_contribution"] == max(counts.values())
    assert report["input_users"] == len({u for row in rows for u in addresses_by_hand(row)})
    code, checked, _ = cli(capsys, "verify-bound", data, tmp_path / "email", "-k", K, *FROM_TO, "--user-ids", "email")
    assert code == 0 and checked["ok"], checked
    # Taken as they are, Ann's ways are distinct users (a whole "to" string one of them): she keeps more than K.
    _bound(capsys, data, tmp_path / "as-is", *LOCAL, "--user-ids", "as-is")
    kept = sum(selection(tmp_path / "as-is").get(i, 0) for i in anns(rows))
    assert kept > K
    code, found, _ = cli(capsys, "verify-bound", data, tmp_path / "as-is", "-k", K, *FROM_TO, "--user-ids", "email")
    assert code == 1 and f"user 'ann@x.org' contributes {kept} records, bound {K}" in found["violations"]


# Ann's address written other ways than ANN's, each read under --user-ids email as the addresses given.
OTHER_WAYS = {
    "ann@x.org\u200b": ["ann@x.org"],  # a zero-width space (Unicode Cf), invisible when printed
    "mailto:ann@x.org": ["ann@x.org"],
    "ann@x.org (Ann Smith)": ["ann@x.org"],
    "ann@x.org;": ["ann@x.org"],
    "ann@x.org.": ["ann@x.org"],
    '"ann"@x.org': ["ann@x.org"],
    "Ann Smith ann@x.org": ["ann@x.org"],
    "ann@x.org b@y.org": ["ann@x.org", "b@y.org"],
    "ann@x.org|b@y.org": ["ann@x.org", "b@y.org"],
    "ann+news@x.org": ["ann@x.org"],  # a subaddress of Ann's mailbox
    "'ann'@x.org": ["ann@x.org"],
    # Invisible and not Cf, among Unicode's other default-ignorable code points: a combining grapheme joiner
    # (Mn), a variation selector (Mn), a Hangul filler (Lo)
    "ann\u034f@x.org": ["ann@x.org"],
    "ann@x.org\ufe0f": ["ann@x.org"],
    "ann\u3164@x.org": ["ann@x.org"],
    "\ufeffANN@x.org": ["ann@x.org"],  # a byte order mark, and upper case
}
# Values holding '@' from which no address can be read: their rows are bad_address under --user-ids email.
UNREADABLE = ['"ann smith"@x.org', "ann@x.org\u200bb@y.org", "ann@x.org (a) b@y.org", "ann@", "ann@x-.org", "+a@x.org"]


def test_an_address_written_any_other_way_is_refused_and_read_as_its_address(tmp_path, capsys):
    """Beside the four named signs, any id holding '@' that is not a plain lower-case address is a sign
    (shown in its repr, so that an invisible character shows); ids without '@' are not. Under --user-ids
    email each way reads as the addresses it holds, so Ann keeps K records in all; a value from which no
    address can be read is a bad_address. The verifier finds the same on its own."""
    ways = ["ann@x.org", *OTHER_WAYS, "Smith, J."]
    rows = [{"id": i, "from": f"u{i}@y.org", "to": way} for i, way in enumerate(ways)]
    data = write_records(str(tmp_path / "ways.jsonl"), rows)
    code, _, err = cli(capsys, "bound", data, tmp_path / "refused", "-k", K, *FROM_TO, *LOCAL)
    assert code == 2 and "Traceback" not in err
    assert f"not_a_plain_address: {len(OTHER_WAYS) - 1} (an id holding '@' that is no plain lower-case address" in err
    assert f"{data} row 1 column 'to': 'ann@x.org\\u200b'" in err  # the zero-width space shown
    assert f"{data} row 2 column 'to': 'mailto:ann@x.org'" in err
    assert "upper_case: 1 " in err and "Smith, J." not in err
    assert not (tmp_path / "refused" / "selected").exists()
    _bound(capsys, data, tmp_path / "as-is", *LOCAL, "--user-ids", "as-is")
    assert sum(selection(tmp_path / "as-is").get(i, 0) for i in range(len(ways) - 1)) > K  # Ann's ways: distinct
    code, found, _ = cli(capsys, "verify-bound", data, tmp_path / "as-is", "-k", K, *FROM_TO)
    shown = " ".join(found["violations"])
    assert code == 1 and f"not_a_plain_address: {len(OTHER_WAYS) - 1} " in shown
    assert f"{data} row 1 column 'to': 'ann@x.org\\u200b'" in shown

    code, _, err = cli(capsys, "bound", data, tmp_path / "email", "-k", K, *FROM_TO, *LOCAL, "--user-ids", "email")
    assert code == 2 and f"{data}: row {len(ways) - 1}: bad_address" in err  # "Smith, J." holds no address
    report = _bound(capsys, data, tmp_path / "email", *LOCAL, "--user-ids", "email", "--on-invalid", "skip")
    assert report["rejected"] == {"bad_address": 1}
    assert report["input_users"] == len(ways) - 1 + 2  # the senders, ann@x.org and b@y.org
    assert sum(selection(tmp_path / "email").get(i, 0) for i in range(len(ways) - 1)) == K
    read = read_file(data, 0, Columns(users_columns=("from", "to"), user_ids="email"))
    offsets, users = read.chunk.offsets.tolist(), read.chunk.users.to_pylist()
    assert [users[a:b] for a, b in zip(offsets, offsets[1:])] == [
        [f"u{i}@y.org", *addresses] for i, addresses in enumerate([["ann@x.org"], *OTHER_WAYS.values()])
    ]
    code, checked, _ = cli(capsys, "verify-bound", data, tmp_path / "email", "-k", K, *FROM_TO, "--user-ids", "email")
    assert code == 0 and checked["ok"], checked

    bad = [{"id": i, "from": "c@y.org", "to": value} for i, value in enumerate(UNREADABLE)]
    unreadable = write_records(str(tmp_path / "unreadable.jsonl"), bad)
    report = _bound(capsys, unreadable, tmp_path / "bad", *LOCAL, "--user-ids", "email", "--on-invalid", "skip")
    assert report["rejected"] == {"bad_address": len(UNREADABLE)}


def test_a_value_holding_no_address_is_a_bad_address_and_repeats_are_removed(tmp_path, capsys):
    rows = [
        {"id": 1, "from": "Ann <ann@x.org>", "to": "ANN@x.org, b@y.org"},  # ann twice: a repeated user
        {"id": 2, "from": "c@y.org", "to": "Smith, J."},  # no '@': no address
        {"id": 3, "from": "Undisclosed <>", "to": "b@y.org"},
        {"id": 4, "from": "c@y.org", "to": '"Smith; Ann" <ann@x.org>; d@y.org'},  # ';' inside quotes: one name
    ]
    data = write_records(str(tmp_path / "r.jsonl"), rows)
    code, _, err = cli(capsys, "bound", data, tmp_path / "out", "-k", K, *FROM_TO, *LOCAL, "--user-ids", "email")
    assert code == 2 and f"{data}: row 1: bad_address" in err and f"{data}: row 2: bad_address" in err
    report = _bound(capsys, data, tmp_path / "out", *LOCAL, "--user-ids", "email", "--on-invalid", "skip")
    assert report["rejected"] == {"bad_address": 2} and report["repeated_users_removed"] == 1
    assert report["input_users"] == 4  # ann@x.org, b@y.org, c@y.org, d@y.org
    rejected = [json.loads(line) for line in open(tmp_path / "out" / "rejected" / "rejected.jsonl")]
    assert [(r["row"], r["reason"], r["record"]["id"]) for r in rejected] == [
        (1, "bad_address", 2),
        (2, "bad_address", 3),
    ]
    read = read_file(data, 0, Columns(users_columns=("from", "to"), user_ids="email"))
    offsets = read.chunk.offsets.tolist()
    users = read.chunk.users.to_pylist()
    assert [users[a:b] for a, b in zip(offsets, offsets[1:])] == [
        ["ann@x.org", "b@y.org"],
        ["c@y.org", "ann@x.org", "d@y.org"],
    ]


def test_as_is_reads_every_id_as_it_is(tmp_path, capsys):
    """--user-ids as-is: the users are the values as written, and the selection is the one the same graph
    with clean ids gets; on ids without a sign it writes what reading without --user-ids writes."""
    rows = export(200, seed=1)
    data = write_records(str(tmp_path / "export.jsonl"), rows)
    read = read_file(data, 0, Columns(users_columns=("from", "to"), user_ids="as-is"))
    assert read.chunk.users.to_pylist() == [value for row in rows for value in dict.fromkeys([row["from"], row["to"]])]
    names: dict = {}
    renamed = [
        {
            **row,
            "from": names.setdefault(row["from"], f"user-{len(names)}"),
            "to": names.setdefault(row["to"], f"user-{len(names)}"),
        }
        for row in rows
    ]
    clean = write_records(str(tmp_path / "clean.jsonl"), renamed)
    _bound(capsys, data, tmp_path / "as-is", *LOCAL, "--user-ids", "as-is")
    default = _bound(capsys, clean, tmp_path / "default", *LOCAL)
    clean_as_is = _bound(capsys, clean, tmp_path / "clean-as-is", *LOCAL, "--user-ids", "as-is")
    for output in ("as-is", "clean-as-is"):
        for name in _shards(tmp_path / "default"):
            assert (tmp_path / output / "selected" / name).read_bytes() == (
                tmp_path / "default" / "selected" / name
            ).read_bytes()
    ignored = ("wall_time_s", "parameters")
    assert {k: v for k, v in default.items() if k not in ignored} == {
        k: v for k, v in clean_as_is.items() if k not in ignored
    }
    assert {**default["parameters"], "user_ids": "as-is"} == clean_as_is["parameters"]


def test_batch_reads_user_ids_as_the_bound_did_and_verify_batches_re_derives_them(tmp_path, capsys):
    rows = export(240, seed=2)
    data = write_records(str(tmp_path / "export.jsonl"), rows)
    _bound(capsys, data, tmp_path / "bound", *LOCAL, "--user-ids", "email")
    batch = ["--steps", "30", "--batch-size", "4", "--min-sep", "2", "--seed", "3", *LOCAL]
    for name, given in (("batches", []), ("repeated", ["--user-ids", "email"])):
        code, _, err = cli(capsys, "batch", tmp_path / "bound", data, tmp_path / name, *batch, *FROM_TO, *given)
        assert code == 0, err
    assert (tmp_path / "batches" / "batches-00000-of-00001.tfrecord").read_bytes() == (
        tmp_path / "repeated" / "batches-00000-of-00001.tfrecord"
    ).read_bytes()
    code, _, err = cli(
        capsys, "batch", tmp_path / "bound", data, tmp_path / "o", *batch, *FROM_TO, "--user-ids", "as-is"
    )
    assert code == 2 and "--user-ids as-is: " in err and "read the user ids with --user-ids email" in err
    verify = ["verify-batches", tmp_path / "batches", data, "--min-sep", "2", "--selected", tmp_path / "bound", "-k", K]
    code, checked, _ = cli(capsys, *verify, *FROM_TO, "--user-ids", "email")
    assert code == 0 and checked["ok"] and checked["max_user_contribution"] <= K, checked
    code, found, _ = cli(capsys, *verify, *FROM_TO)
    assert code == 1 and found["violations"] == [
        f"{tmp_path / 'bound'} read the user ids with --user-ids email, but verify-batches was given none: pass "
        f"the --user-ids the bound read them with"
    ]
    # A report that records no user_ids (an older madp's): the verifier finds the signs in DATA itself.
    report = json.load(open(tmp_path / "bound" / "report.json"))
    del report["parameters"]["user_ids"]
    json.dump(report, open(tmp_path / "bound" / "report.json", "w"))
    code, found, _ = cli(capsys, *verify, *FROM_TO)
    shown = " ".join(found["violations"])
    assert code == 1 and "several_addresses: " in shown and f"{data} row 0 column 'to': " in shown


def test_a_run_config_reads_every_stage_with_the_bounds_user_ids(tmp_path, capsys):
    from madp.jobs.run_config import RunConfig
    from madp.jobs.run_plan import stages_of

    data = write_records(str(tmp_path / "export.jsonl"), export(200, seed=4))
    config = {
        "run_dir": str(tmp_path / "run"),
        "input": data,
        "bound": {"max_contributions": K, "users_columns": ["from", "to"], "user_ids": "email", "runner": "local"},
        "batch": {"steps": 20, "batch_size": 4, "min_sep": 2, "seed": 1, "runner": "local"},
    }
    stages = {stage.name: stage.command for stage in stages_of(RunConfig.from_json(json.loads(json.dumps(config))))}
    for name in ("bound", "verify-bound", "batch", "verify-batches"):
        assert stages[name][stages[name].index("--user-ids") + 1] == "email", name
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    code, summary, err = cli(capsys, "run", tmp_path / "job.yaml")
    assert code == 0, err
    assert [s["stage"] for s in summary["stages"]] == ["bound", "verify-bound", "batch", "verify-batches"]
    assert json.load(open(tmp_path / "run" / "bound" / "report.json"))["parameters"]["user_ids"] == "email"
    for batch, message in (
        ({"user_ids": "as-is"}, r"config batch.user_ids: differs from the bound's \('email'\)"),
        ({"user_ids": "email"}, None),
    ):
        changed = {**config, "batch": {**config["batch"], **batch}}
        if message is None:
            stages_of(RunConfig.from_json(changed))
        else:
            with pytest.raises(InputError, match=message):
                stages_of(RunConfig.from_json(changed))
    unbound = {**config, "bound": {k: v for k, v in config["bound"].items() if k != "user_ids"}}
    with pytest.raises(InputError, match="config batch.user_ids: the bound section says how user ids are read"):
        stages_of(RunConfig.from_json({**unbound, "batch": {**config["batch"], "user_ids": "email"}}))
    with pytest.raises(InputError, match="config bound.user_ids: one of email, as-is, got 'lower'"):
        stages_of(RunConfig.from_json({**config, "bound": {**config["bound"], "user_ids": "lower"}}))
    # Without user_ids the run stops at the bound, naming the signs.
    (tmp_path / "unbound.yaml").write_text(yaml.safe_dump({**unbound, "run_dir": str(tmp_path / "run2")}))
    code, _, err = cli(capsys, "run", tmp_path / "unbound.yaml")
    assert code == 2 and "several_addresses: " in err


@pytest.mark.slow
def test_recommend_k_sweeps_the_graph_of_the_addresses_and_writes_user_ids(tmp_path, capsys):
    data = write_records(str(tmp_path / "export.jsonl"), export(200, seed=5))
    sweep = ["recommend-k", data, *FROM_TO, *"--epsilon 4 --delta 1e-5 --steps 10 --batch-size 4 --k 2,3".split()]
    code, _, err = cli(capsys, *sweep)
    assert code == 2 and "display_name: " in err
    config = tmp_path / "job.yaml"
    code, found, err = cli(
        capsys, *sweep, "--user-ids", "email", "--write-config", config, "--run-dir", tmp_path / "run"
    )
    assert code == 0, err
    assert found["input"]["users"] == len({u for row in export(200, seed=5) for u in addresses_by_hand(row)})
    assert yaml.safe_load(config.read_text())["bound"]["user_ids"] == "email"


def test_import_mbox_writes_user_ids_that_show_no_sign(tmp_path, capsys):
    """import-mbox parses the headers' addresses itself: bare and lower-cased, they pass the check."""
    box = mailbox.mbox(str(tmp_path / "mail.mbox"))
    for i, (sender, to) in enumerate(
        [
            ("Ann <ANN@X.org>", "bob@y.org ; Carl <carl@z.org>"),
            ('"Smith, Ann" <ann@x.org>', "BOB@Y.ORG, carl@z.org"),
            (" bob@y.org ", "Ann Smith <Ann@x.org>"),
        ]
    ):
        mail = EmailMessage()
        mail["From"], mail["To"], mail["Subject"], mail["Message-ID"] = sender, to, "hi", f"<m{i}@x.org>"
        mail.set_content("text")
        box.add(mail)
    box.flush()
    code, _, err = cli(capsys, "import-mbox", tmp_path / "mail.mbox", tmp_path / "mbox")
    assert code == 0, err
    records = tmp_path / "mbox" / "records"
    assert {u for r in pq.read_table(str(records)).to_pylist() for u in r["users"]} == {
        "ann@x.org",
        "bob@y.org",
        "carl@z.org",
    }
    code, report, err = cli(capsys, "bound", records, tmp_path / "bound", "-k", 1, *LOCAL)
    assert code == 0 and report["input_users"] == 3, err
    code, checked, _ = cli(capsys, "verify-bound", records, tmp_path / "bound", "-k", 1)
    assert code == 0 and checked["ok"]


def test_audit_canaries_are_addresses_where_user_ids_are(tmp_path):
    """Under --user-ids email a canary user that is no address would make its records bad_address."""
    from madp.jobs.audit import plant
    from madp.tools.planning.audit_config import AuditOptions

    rng = np.random.default_rng(0)
    rows = [
        {
            "id": i,
            "from": f"U{i % 20}@y.org",
            "to": f"u{(i + 1) % 20}@y.org",
            "features": rng.normal(size=4).tolist(),
            "label": i % 2,
        }
        for i in range(60)
    ]
    data = write_records(str(tmp_path / "r.parquet"), rows)
    columns = Columns(users_columns=("from", "to"), user_ids="email")
    canaries = plant([data], columns, "features", "label", AuditOptions(canaries=6), np.random.default_rng(1))
    pq.write_table(canaries.table, tmp_path / "canaries.parquet")
    read = read_file(str(tmp_path / "canaries.parquet"), 1, columns)
    assert len(read.chunk) == len(canaries.record_ids) and not read.rejects.reason
    assert set(read.chunk.users.to_pylist()) == set(canaries.users)
    assert all(user.endswith("@canary.invalid") for user in canaries.users)


def test_a_file_read_in_splits_is_refused_and_read_as_whole():
    """The signs of every split, their facts judged in any order, make the refusal of the whole file
    (counts, and the first examples in row order); under --user-ids email the splits' users are the whole's."""
    from test_input_splits import read_in_splits, whole

    data = "".join(json.dumps(row) + "\n" for row in export(120, seed=8)).encode()
    checked = Columns(users_columns=("from", "to"))
    refusals = []
    for read in (lambda: whole(data, checked), lambda: read_in_splits(data, 700, checked)):
        with pytest.raises(InputError) as refused:
            read()
        refusals.append(str(refused.value))
    assert refusals[0] == refusals[1] and "f.jsonl row 0 column 'to'" in refusals[0]
    email = Columns(users_columns=("from", "to"), user_ids="email")
    results, _ = read_in_splits(data, 700, email)
    assert len(results) > 5
    assert [u for r in results for u in r.chunk.users.to_pylist()] == whole(data, email)[0].chunk.users.to_pylist()


def test_the_readers_and_the_verifier_find_the_same_signs_and_addresses():
    """The vectorized kernels and the verifier's plain Python agree value by value, on the values of the
    README's examples and on random strings of the characters that matter (Unicode whitespace, the
    separators, brackets, quotes, upper case); and a bare address, taken without a parse, is what the
    parse would find."""
    from madp.core import user_ids
    from madp.core.verify.user_ids import _addresses, _signs_of

    rng = np.random.default_rng(7)
    alphabet = list("aZ9@<>,;. \t\"()|:+'-") + ["\u00a0", "\u2003", "\x1c", "\u00c4", "\u0130", "\u200b", "\uff21"]
    alphabet += ["\u034f", "\ufe0f", "\U000e0100", "\u3164"]  # default-ignorable, not Cf
    values = [*ANN, "a@x; b@y", "a@x, b@y", "Smith, J.", "Smith, Ann <ann@x>", "bob", "<ann@x>", "", "A.B-c+d@Ex-1.ORG"]
    values += [*OTHER_WAYS, *UNREADABLE, "MAILTO:Ann <ann@x>", "j\u00f6rg@b\u00fccher.de", "\uff41nn@x"]
    values += ["".join(rng.choice(alphabet, size=int(rng.integers(1, 12)))) for _ in range(3000)]
    around = ["", " ", "mailto:", "Ann <", ">", "(c) ", " (c)", "\u200b", '"', ";", "|", ".", ",", " b@y", "b@y|"]
    around += ["'", "+", "\u034f", "\ufe0f"]
    words = ["ann", "Ann.Lee", "x|y", "a+b", "'a'", "o'b", "a+"]
    values += [
        f"{rng.choice(around)}{rng.choice(words)}{rng.choice(around)}@"
        f"{rng.choice(['x.org', 'X', 'x-1.y', 'x-.y', '-x.y'])}{rng.choice(around)}"
        for _ in range(1000)
    ]
    values += [
        f"{word}@{domain}"
        for word in ("Ann.Lee", "a..b", ".a", "a.", "a'b{c}", "x|y")
        for domain in ("X.org", "x", "-y.z")
    ]
    found = user_ids.signs(pa.array(values))
    for i, value in enumerate(values):
        assert [sign for sign in user_ids.SIGNS if found[sign][i]] == _signs_of(value), value
    normalized, no_address = user_ids.email_users(pa.array([[v] for v in values], pa.list_(pa.string())))
    for i, value in enumerate(values):
        assert normalized[i].as_py() == user_ids.email_addresses(value) == _addresses(value), value
        assert no_address[i] == (not _addresses(value))
    assert sum(bool(_signs_of(v)) for v in values) > 1000 and sum(not _addresses(v) for v in values) > 1000
    # What --user-ids email reads is what shows no sign (or, non-ASCII, an internationalized address).
    read = {address for value in values for address in _addresses(value) if address.isascii()}
    assert len(read) > 20 and not any(_signs_of(address) for address in read)
    for value, addresses in OTHER_WAYS.items():
        assert _addresses(value) == addresses and _signs_of(value), value
    assert not any(_addresses(value) for value in UNREADABLE)


def test_the_privacy_plan_states_how_user_ids_were_read():
    from madp.core.reports import BatchParameters, BatchReport, BoundParameters, BoundRecord, Participation, SizeSummary
    from madp.training.plan import assumptions

    sizes = SizeSummary(1.0, 0.0, 1, 1, (1,))
    parameters = BatchParameters(1, 1.0, 1, "records", 0, None, None, 1, "error", ())
    participation = Participation(1, 1, 1, None, 0, {})

    def stated(user_ids) -> list[str]:
        bound = BoundRecord(K, K, 1, BoundParameters(K, user_ids=user_ids), (), None, {})
        report = BatchReport(
            "local", "s", "d", "minsep", bound, parameters, None, 0.5, 1.0, 1, 1, 1, sizes, 0.0, sizes, (), 0, 0, 0,
            participation, {}, 0, (), 0.0,
        )  # fmt: skip
        return assumptions(report, "dpsgd", K)

    assert any("user ids were read as e-mail addresses" in s for s in stated("email"))
    assert any("user ids were taken as they are (--user-ids as-is" in s for s in stated("as-is"))
    assert not any("user ids were" in s for s in stated(None))


@pytest.mark.beam
def test_local_and_beam_refuse_and_select_alike(tmp_path, capsys):
    """A file read in several splits on Beam: the same refusal (counts and first examples over the
    splits, in row order), and under --user-ids email the same selection, graph and batches."""
    rows = export(400, seed=6)
    data = write_records(str(tmp_path / "export.jsonl"), rows)
    assert os.path.getsize(data) > 3 * 8000  # read in several splits
    refusals = []
    for engine in (LOCAL, [*BEAM, "--input-split-bytes", "8000"]):
        code, _, err = cli(capsys, "bound", data, tmp_path / "refused", "-k", K, *FROM_TO, *engine)
        assert code == 2
        refusals.append(err.split("error: ", 1)[1])
    assert refusals[0] == refusals[1] and "several_addresses: " in refusals[0]
    local = _bound(capsys, data, tmp_path / "local", *LOCAL, "--user-ids", "email")
    beam = _bound(capsys, data, tmp_path / "beam", *BEAM, "--input-split-bytes", "8000", "--user-ids", "email")
    assert beam["graph_digest"] == local["graph_digest"] and beam["input_users"] == local["input_users"]
    for name in _shards(tmp_path / "local"):
        assert (tmp_path / "local" / "selected" / name).read_bytes() == (
            tmp_path / "beam" / "selected" / name
        ).read_bytes()
    assert sum(selection(tmp_path / "beam").get(i, 0) for i in anns(rows)) <= K
    batch = ["--steps", "30", "--batch-size", "4", "--min-sep", "2", "--seed", "3", *FROM_TO]
    for name, engine in (("local-batches", LOCAL), ("beam-batches", BEAM)):
        code, _, err = cli(capsys, "batch", tmp_path / "beam", data, tmp_path / name, *batch, *engine)
        assert code == 0, err
        code, checked, _ = cli(
            capsys, "verify-batches", tmp_path / name, data, "--min-sep", "2", "--selected", tmp_path / "beam",
            "-k", K, *FROM_TO, "--user-ids", "email",
        )  # fmt: skip
        assert code == 0 and checked["ok"], checked
    assert (tmp_path / "local-batches" / "batches-00000-of-00001.tfrecord").read_bytes() == (
        tmp_path / "beam-batches" / "batches-00000-of-00001.tfrecord"
    ).read_bytes()


@pytest.mark.beam
def test_ones_own_rows_are_read_as_their_extractors_user_ids_say():
    import apache_beam as beam
    from apache_beam.testing.test_pipeline import TestPipeline
    from apache_beam.testing.util import assert_that, equal_to

    from madp.beam.pipeline import pipeline_options
    from madp.beam.record_chunks import RecordExtractors, RecordsFromRows

    def pipeline() -> TestPipeline:
        return TestPipeline(options=pipeline_options(["--direct_running_mode=in_memory", "--direct_num_workers=1"]))

    rows = [{"message": 1, "people": ["Ann <ann@x.org>"]}, {"message": 2, "people": ["ANN@X.org", "bob@y.org"]}]
    extractors = RecordExtractors(lambda row: row["message"], lambda row: row["people"])
    with pytest.raises(Exception, match="display_name: 1 .*upper_case: 1 "):
        with pipeline() as p:
            _ = p | beam.Create(rows) | RecordsFromRows(extractors, chunks=1)
    with pipeline() as p:
        chunks, _, _ = p | beam.Create(rows) | RecordsFromRows(extractors._replace(user_ids="email"), chunks=1)
        users = chunks | beam.FlatMapTuple(lambda _, chunk: chunk.users.to_pylist())
        assert_that(users, equal_to(["ann@x.org", "ann@x.org", "bob@y.org"]))
