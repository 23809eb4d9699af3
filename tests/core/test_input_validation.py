"""Invalid rows stop the run with a clear error, or are skipped, written out and counted."""

from __future__ import annotations

import json
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import write_records

from madp.core.errors import InputError, OptionError
from madp.core.options import flag_of
from madp.core.record_reading import read_file
from madp.core.records import Columns, list_input_files
from madp.core.selection import BoundOptions
from madp.engines.local_engine import run_local

BAD_JSONL = """{"id": 1, "users": [1, 2], "text": "kept"}
{"id": 2, "users": [2, 2, 3]}
{"id": null, "users": [1]}
{"users": [1]}
{"id": 3, "users": []}
{"id": 4}
{"id": 5, "users": [1, null]}
{"id": 6, "users": [[1], 2]}
{"id": 7, "users": [{"name": "x"}]}
{"id": 10, "users": [4]}
{"id": 10, "users": [5]}
this is not json
{"id": 7.5, "users": [1]}

{"id": 8, "users": "alice"}
{"id": 9, "users": [6]}
{"id": 123456789012345678901234567890, "users": [1]}
{"id": 11, "users": [1.5]}
{"id": 12, "users": [true]}
{"id": 13, "users": [99999999999999999999999]}
"""
EXPECTED = {
    "missing_id": 2,
    "empty_users": 1,
    "missing_users": 1,
    "null_user": 1,
    "non_scalar_user": 3,
    "bad_user_type": 3,
    "duplicate_id": 2,
    "invalid_json": 1,
    "bad_id_type": 2,
}


@pytest.fixture
def bad_input(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(BAD_JSONL)
    return str(path)


def test_error_names_file_row_reason_and_totals(tmp_path, bad_input):
    with pytest.raises(InputError) as error:
        run_local(bad_input, str(tmp_path / "out"), BoundOptions(max_contributions=1))
    message = str(error.value)
    assert "16 invalid input rows" in message
    assert f"{bad_input}: row 2: missing_id" in message
    assert "non_scalar_user: 3" in message and "--on-invalid skip" in message
    assert not (tmp_path / "out" / "selected").exists(), "a failed run writes no selection"


def test_skip_writes_and_counts_every_rejected_row(tmp_path, bad_input):
    report = run_local(bad_input, str(tmp_path / "out"), BoundOptions(max_contributions=1, on_invalid="skip"))
    assert report.rejected == EXPECTED and report.rejected_total == 16
    assert report.input_rows == 19 and report.input_records == 3
    assert report.repeated_users_removed == 1
    rejected = [json.loads(line) for line in open(tmp_path / "out" / "rejected" / "rejected.jsonl")]
    assert len(rejected) == 16 and {r["file"] for r in rejected} == {bad_input}
    by_row = {r["row"]: r for r in rejected}
    assert by_row[11]["reason"] == "invalid_json" and by_row[11]["record"] == "this is not json"
    assert by_row[9]["reason"] == by_row[10]["reason"] == "duplicate_id", "no occurrence of a duplicated id is kept"
    assert by_row[13]["record"] == {"id": 8, "users": "alice"}


def test_repeated_users_are_deduplicated(tmp_path):
    path = write_records(str(tmp_path / "r.jsonl"), [{"id": "a", "users": ["x", "x", "y", "x"]}])
    result = read_file(path, 0, Columns())
    assert result.repeated_users_removed == 2 and result.chunk.users.to_pylist() == ["x", "y"]


def test_parquet_nulls_and_custom_columns(tmp_path):
    table = pa.table(
        {
            "doc": pa.array([1, 2, None, 4]),
            "authors": pa.array([[1], None, [2], [3, None]]),
            "content": ["a", "b", "c", "d"],
        }
    )
    pq.write_table(table, tmp_path / "p.parquet")
    options = BoundOptions(max_contributions=1, on_invalid="skip", id_column="doc", users_column="authors")
    report = run_local(str(tmp_path / "p.parquet"), str(tmp_path / "out"), options)
    assert report.rejected == {"missing_id": 1, "missing_users": 1, "null_user": 1}
    assert report.selected_records == 1
    with pytest.raises(InputError, match=r"no column \['id', 'users'\] in any row"):
        run_local(str(tmp_path / "p.parquet"), str(tmp_path / "o2"), BoundOptions(max_contributions=1))
    write_records(str(tmp_path / "j.jsonl"), [{"doc": 1, "authors": [1]}])
    with pytest.raises(InputError, match=r"no column \['id', 'users'\] in any row.*--id-column"):
        run_local(str(tmp_path / "j.jsonl"), str(tmp_path / "o3"), BoundOptions(max_contributions=1))


def test_mixed_id_types_across_files_are_an_error(tmp_path):
    write_records(str(tmp_path / "a.jsonl"), [{"id": 1, "users": [1]}])
    write_records(str(tmp_path / "b.jsonl"), [{"id": "two", "users": [1]}])
    with pytest.raises(InputError, match="mix integers and strings"):
        run_local(str(tmp_path), str(tmp_path / "out"), BoundOptions(max_contributions=1))


def test_missing_and_unsupported_inputs(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        list_input_files(str(tmp_path / "nope"))
    (tmp_path / "x.csv").write_text("id,users\n")
    with pytest.raises(InputError, match="unsupported input format"):
        list_input_files(str(tmp_path / "x.csv"))
    with pytest.raises(InputError, match="holds no .jsonl, .jsonl.gz, .parquet files"):
        list_input_files(str(tmp_path))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_contributions": 0}, "^max_contributions must be at least 1"),
        ({"max_contributions": 1, "order": "weight"}, "^order weight needs weight_column"),
        ({"max_contributions": 1, "max_rounds": 0}, "^max_rounds must be at least 1"),
        ({"max_contributions": 1, "on_invalid": "ignore"}, "^on_invalid must be one of error, skip"),
    ],
)
def test_bad_options(kwargs, message):
    with pytest.raises(InputError, match=message):
        BoundOptions(**kwargs)


def test_bad_capacities_file(tmp_path, small_graph):
    input_path = write_records(str(tmp_path / "in.parquet"), small_graph)
    capacities = tmp_path / "caps.csv"
    capacities.write_text("user,capacity\n1,2\n1,3\n2,-1\n")
    with pytest.raises(InputError, match="row 0: user listed twice.*row 2: missing or negative capacity"):
        run_local(input_path, str(tmp_path / "out"), BoundOptions(max_contributions=1, capacities=str(capacities)))


def test_unsigned_ids_beyond_int64_are_a_clear_error(tmp_path):
    pq.write_table(pa.table({"id": pa.array([1, 2**64 - 1], pa.uint64()), "users": [[1], [2]]}), tmp_path / "u.parquet")
    with pytest.raises(InputError, match="ids do not fit int64"):
        read_file(str(tmp_path / "u.parquet"), 0, Columns())


def test_capacities_file_problems(tmp_path):
    from madp.core.selection import read_capacities

    with pytest.raises(InputError, match="no such capacities file"):
        read_capacities(str(tmp_path / "none.csv"), 1)
    (tmp_path / "nulls.jsonl").write_text(
        '{"user": null, "capacity": 1}\n{"user": 4, "capacity": null}\n{"user": 4, "capacity": 2}\n'
    )
    with pytest.raises(
        InputError,
        match="row 0: missing user; row 1: missing or negative capacity; row 1: user "
        "listed twice; row 2: user listed twice",
    ):
        read_capacities(str(tmp_path / "nulls.jsonl"), 1)
    (tmp_path / "good.jsonl").write_text('{"user": "a", "capacity": 0}\n{"user": "b", "capacity": 5}\n')
    capacities = read_capacities(str(tmp_path / "good.jsonl"), 2)
    assert capacities.lookup(pa.array(["b", "z", "a"])).tolist() == [5, 2, 0]


@pytest.mark.parametrize("number", ["inf", "nan"])
def test_numbers_that_are_not_finite_are_refused_by_name(number, capsys):
    """argparse and YAML read "inf" and "nan" as floats: the accountant crashed on an infinite sigma,
    and training ran to NaN weights at an infinite clip norm or learning rate."""
    from madp.cli import main
    from madp.tools.planning.recommend import Sweep
    from madp.training.options import TrainOptions

    accounted = ["epsilon", "--mechanism", "dpsgd", "--delta", "1e-6", "--steps", "100", "--sampling-prob", "0.01"]
    assert main([*accounted, "--noise-multiplier", number]) == 2
    error = capsys.readouterr().err
    assert "--noise-multiplier must be positive and finite" in error and "Traceback" not in error
    for field in ("learning_rate", "adam_epsilon", "clip_norm", "noise_multiplier", "testing_only_noise_scale"):
        with pytest.raises(OptionError, match=f"^{field} must be positive and finite") as refused:
            TrainOptions(model="text-classifier", epsilon=8.0, **{field: float(number)})
        assert refused.value.named(flag_of).startswith(f"{flag_of(field)} must be positive and finite")
    with pytest.raises(InputError, match="^l2 must be 0 or above and finite"):
        TrainOptions(model="text-classifier", epsilon=8.0, l2=float(number))
    with pytest.raises(InputError, match="^l2 must be 0 or above and finite"):
        TrainOptions(model="text-classifier", epsilon=8.0, l2=-1e-4)
    with pytest.raises(InputError, match="--clip-norm must be positive and finite"):
        Sweep(epsilon=8.0, delta=1e-6, steps=10, batch_size=4.0, clip_norm=float(number))


def test_an_option_error_that_wraps_another_names_its_parameters_alike():
    """An OptionError holding the error it wraps as a value (a calibration file's bad bands) renders that
    error's parameters as it renders its own: names for a Python caller, flags on the command line, also
    after travelling pickled from a worker."""
    inner = OptionError("{bands} must be an integer in [1, {steps}], got {0}", 11)
    outer = OptionError("{calibration} {0}: {1}", "plan.json", inner)
    assert str(outer) == "calibration plan.json: bands must be an integer in [1, steps], got 11"
    said = "--calibration plan.json: --bands must be an integer in [1, --steps], got 11"
    assert outer.named(flag_of) == said and pickle.loads(pickle.dumps(outer)).named(flag_of) == said
