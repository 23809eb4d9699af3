"""`madp audit`: the one-run auditing analysis against an independent exact computation, the zero-out
neighbour in training, and audits of an auditable job: the non-private model is caught memorizing,
DP-SGD stays below its claim, and a broken noise is refuted."""

import hashlib
import json
import math
import os
import re

import numpy as np
import pytest

from madp import cli
from madp.accounting.auditing import epsilon_lower_bound, guess_plans, guesses, one_run_audit, p_value
from madp.core.errors import InputError
from madp.core.reports import AuditReport

pytestmark = [pytest.mark.tf]

# --- the analysis ---------------------------------------------------------------------------------


def reference_p_value(m, r, v, epsilon, delta):
    """The one-run audit p-value term by term in plain Python (no scipy)."""
    q = 1 / (1 + math.exp(-epsilon))
    pmf = [math.comb(r, k) * q**k * (1 - q) ** (r - k) for k in range(r + 1)]
    tail = math.fsum(pmf[v:])
    slack = max((math.fsum(pmf[v - i : v]) / i for i in range(1, v + 1)), default=0.0)
    return min(tail + 2 * m * delta * slack, 1.0)


def is_the_largest_refuted(bound, m, r, v, delta, confidence, tolerance=1e-3):
    """`bound` is the largest epsilon whose p-value is below 1 - confidence (to `tolerance`)."""
    level = 1 - confidence
    if bound == 0:
        return reference_p_value(m, r, v, 0.0, delta) >= level
    return (
        reference_p_value(m, r, v, bound - tolerance, delta)
        < level
        <= reference_p_value(m, r, v, bound + tolerance, delta)
    )


@pytest.mark.parametrize(
    "m,r,v,delta",
    [(100, 40, 38, 1e-5), (1000, 60, 55, 1e-5), (50, 50, 50, 0.0), (200, 30, 21, 1e-3), (1000, 80, 80, 1e-5)],
)
def test_p_value_matches_an_exact_computation(m, r, v, delta):
    for epsilon in (0.0, 0.5, 1.0, 2.0, 4.0):
        assert p_value(m, r, v, epsilon, delta) == pytest.approx(
            reference_p_value(m, r, v, epsilon, delta), rel=1e-9, abs=1e-14
        )


def test_lower_bound_table():
    """A table of (m, r, v, delta) -> epsilon at 95%: each bound is the largest epsilon the independent
    p-value refutes, perfect guesses without delta have the closed form log(q / (1 - q)) with q = 0.05^(1/r), and
    the bound grows with the correct guesses and shrinks with delta."""
    table = [(100, 40, 38, 1e-5), (1000, 60, 55, 1e-5), (200, 30, 21, 1e-3), (1000, 80, 80, 1e-5), (100, 20, 11, 0)]
    for m, r, v, delta in table:
        assert is_the_largest_refuted(epsilon_lower_bound(m, r, v, delta, 0.95), m, r, v, delta, 0.95)
    for r in (10, 100, 1000):
        q = 0.05 ** (1 / r)
        assert epsilon_lower_bound(r, r, r, 0.0, 0.95) == pytest.approx(math.log(q / (1 - q)), abs=1e-9)
    assert epsilon_lower_bound(100, 100, 100, 0.0, 0.95) == pytest.approx(3.4929, abs=1e-4)
    bounds = [epsilon_lower_bound(1000, 100, v, 1e-5, 0.95) for v in (60, 70, 80, 90, 100)]
    assert bounds == sorted(bounds) and bounds[0] > 0
    assert epsilon_lower_bound(1000, 100, 90, 1e-3, 0.95) < epsilon_lower_bound(1000, 100, 90, 1e-6, 0.95)
    assert epsilon_lower_bound(1000, 100, 50, 1e-5, 0.95) == 0.0  # chance level refutes nothing


def test_bad_counts_are_refused():
    with pytest.raises(InputError, match="correct"):
        p_value(10, 5, 6, 1.0, 1e-5)
    with pytest.raises(InputError, match="confidence"):
        epsilon_lower_bound(10, 5, 5, 1e-5, 1.0)


def test_guesses_take_the_extremes():
    scores = np.array([0.1, 0.9, 0.5, 0.3, 0.7])
    assert guesses(scores, 2, 1).tolist() == [-1, 1, 0, 0, 1]
    assert guesses(scores, 0, 5).tolist() == [-1] * 5
    with pytest.raises(InputError):
        guesses(scores, 3, 3)
    assert all(plus + minus <= 100 for plus, minus in guess_plans(100))


def test_scores_unrelated_to_inclusion_rarely_refute_anything():
    """The type-I error of the whole procedure (every guess plan, Bonferroni): with scores independent of
    inclusion a positive bound at 95% confidence must be rare (at most 5% in expectation)."""
    rng = np.random.default_rng(3)
    positive = sum(
        one_run_audit(rng.normal(size=100), rng.random(100) < 0.5, 1e-5, 0.95).epsilon_lower_bound > 0
        for _ in range(200)
    )
    assert positive <= 12  # 5% of 200 is 10; 12 leaves room for sampling error (P[Bin(200, .05) > 12] ~ 0.2)


def test_a_perfect_auditor_reaches_the_measurable_bound():
    rng = np.random.default_rng(0)
    included = rng.permutation(200) < 100  # half: the even split of all 200 guesses can be all right
    result = one_run_audit(included + rng.normal(0, 0.01, 200), included, 1e-5, 0.95)
    assert result.correct == result.guesses == 200
    assert result.epsilon_lower_bound == pytest.approx(result.measurable)


# --- audits of an auditable job ---------------------------------------------------------------------

AUDITABLE = """run_dir: {run_dir}
input: {records}
bound: {{max_contributions: 3, runner: local}}
batch: {{steps: 500, batch_size: 50, min_sep: 1, runner: local}}
calibrate: {{epsilon: {epsilon}, delta: 1.0e-5}}
train: {{model: logreg, eval_every: 500, eval_data: {holdout}}}
report: true
"""


@pytest.fixture(scope="module")
def auditable_records(tmp_path_factory):
    """A small high-dimensional task: 1000 records of 1024 features, where a linear model can hold canaries."""
    directory = tmp_path_factory.mktemp("auditable")
    assert (
        cli.main(
            [
                "-q",
                "generate",
                str(directory / "records"),
                "--records",
                "1000",
                "--features",
                "1024",
                "--seed",
                "1",
                "--holdout",
                str(directory / "test.parquet"),
            ]
        )
        == 0
    )
    return directory


def _config(tmp_path, records, epsilon=1.0):
    path = tmp_path / "job.yaml"
    path.write_text(
        AUDITABLE.format(
            run_dir=tmp_path / "run", epsilon=epsilon, records=records / "records", holdout=records / "test.parquet"
        )
    )
    return str(path)


def _audit(capsys, config, *flags):
    code = cli.main(["-q", "audit", config, "--canaries", "100", "--seed", "1", *flags])
    printed = capsys.readouterr()
    return code, json.loads(printed.out), printed.err


def _digests(directory):
    found = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as handle:
                found[os.path.relpath(path, directory)] = hashlib.sha256(handle.read()).hexdigest()
    return found


def test_the_non_private_model_is_caught_memorizing(tmp_path, capsys, auditable_records):
    code, result, _ = _audit(capsys, _config(tmp_path, auditable_records), "--non-private")
    assert code == 0 and result["claimed_epsilon"] is None and result["mechanism"] == "none"
    assert result["epsilon_lower_bound"] > 1.0  # of at most 2.79 measurable with 100 canaries
    audit = json.loads((tmp_path / "run" / "audit" / "audit.json").read_text())
    assert len(audit["per_canary"]) == 100 and audit["shared_records"] == 25
    assert sum(c["included"] for c in audit["per_canary"]) == audit["included"]
    # audit.json read back as written; what the command printed is it without the canaries' scores
    typed = AuditReport.from_json(audit, "audit.json")
    assert typed.to_json() == audit and audit["format_version"] == 1 and typed.summary() == result
    with pytest.raises(InputError, match="audit.json: format_version 2 is not one"):
        AuditReport.from_json({**audit, "format_version": 2}, "audit.json")
    _excluded_canaries_keep_their_place_in_the_graph_with_zero_gradient(tmp_path / "run" / "audit", auditable_records)


def _excluded_canaries_keep_their_place_in_the_graph_with_zero_gradient(directory, auditable_records):
    import pyarrow.parquet as pq

    canaries = pq.read_table(directory / "input" / "canaries.parquet").to_pydict()
    audit = json.loads((directory / "audit.json").read_text())
    included = {c["user"]: c["included"] for c in audit["per_canary"]}
    zeroed = set(json.loads((directory / "zero-out.json").read_text()))
    for record, users in zip(canaries["id"], canaries["users"]):
        assert (record in zeroed) == (not all(included[u] for u in users))
    real = pq.read_table(auditable_records / "records").num_rows
    bound = json.loads((directory / "bound" / "report.json").read_text())
    assert bound["input_records"] == real + len(canaries["id"])  # included or not, every canary record is bounded


def test_dp_sgd_stays_below_its_claim_as_a_stage_of_the_job_and_leaves_the_job_untouched(
    tmp_path, capsys, auditable_records
):
    config = _config(tmp_path, auditable_records)
    assert cli.main(["-q", "run", config]) == 0
    capsys.readouterr()
    before = _digests(tmp_path / "run")
    assert cli.main(["-q", "run", config, "--set", "audit.canaries=100", "--set", "audit.seed=1"]) == 0
    summary = json.loads(capsys.readouterr().out)
    ran = [stage["stage"] for stage in summary["stages"] if stage["status"] == "ran"]
    assert ran == ["audit", "report", "internal-report"]  # the job's own stages are up to date
    result = json.loads((tmp_path / "run" / "audit" / "audit.json").read_text())
    assert result["ok"] and result["mechanism"] == "dpsgd" and summary["results"]["audit"]["canaries"] == 100
    assert result["epsilon_lower_bound"] < result["claimed_epsilon"] <= 1.0
    assert result["can_refute_claim"]  # 1 is within what 100 canaries can measure, so this check has teeth
    page = (tmp_path / "run" / "report.html").read_text()
    assert "Privacy audit" in page and "composition of both trainings" in page
    # Published beside the model, the audit's figures cost its training too: the summary and the page's
    # headline state the two composed, not the model's epsilon alone
    model = json.loads((tmp_path / "run" / "train" / "privacy.json").read_text())
    together = summary["results"]["audit"]["published_with_the_model"]
    assert together["epsilon"] == model["epsilon"] + result["claimed_epsilon"] > model["epsilon"]
    assert together["delta"] == model["delta"] + result["delta"]
    cells = dict(re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td></tr>", page))
    headline = next(iter(cells.items()))
    assert headline == (
        "(epsilon, delta) of this page: model and audit",
        f"({together['epsilon']:.4g}, {together['delta']:g})",
    )
    assert cells["(epsilon, delta) of the model alone"] == f"({model['epsilon']:.4g}, {model['delta']:g})"
    changed = {k for k, v in _digests(tmp_path / "run").items() if before.get(k) != v}
    pages = {"report.html", "internal-report.html", os.path.join(".madp", "report.json")}
    pages.add("internal-results.json")  # this invocation's internal figures: the wall times of its stages
    assert changed == pages | {os.path.join(".madp", "internal-report.json")} | {
        k for k in changed if k.startswith("audit" + os.sep) or k == os.path.join(".madp", "audit.json")
    }


def test_a_claim_beyond_the_audits_reach_is_said_so(tmp_path, capsys, caplog, auditable_records):
    code, result, _ = _audit(capsys, _config(tmp_path, auditable_records, epsilon=8.0))
    assert code == 0 and result["epsilon_lower_bound"] < result["claimed_epsilon"]
    assert result["largest_measurable_epsilon"] < 8 and not result["can_refute_claim"]
    assert "cannot refute epsilon 8" in caplog.text


def test_a_broken_noise_is_refuted(tmp_path, capsys, auditable_records):
    # The batches and the noise are drawn fresh, so the lower bound varies between runs: a claim of 0.3
    # leaves a nearly noiseless model's (the non-private model's test asks for more than 1) a wide margin.
    config = _config(tmp_path, auditable_records, epsilon=0.3)
    code, result, err = _audit(capsys, config, "--testing-only-noise-scale", "0.01")
    assert code == 1 and result["ok"] is False
    assert result["epsilon_lower_bound"] > result["claimed_epsilon"]
    assert "refutes the claimed guarantee" in err
    privacy = json.loads((tmp_path / "run" / "audit" / "train" / "privacy.json").read_text())
    assert privacy["private"] is False and "testing" in privacy["noise"]


def test_string_ids_in_json_lines_get_string_canaries_and_a_clash_is_named(tmp_path, capsys):
    rng = np.random.default_rng(0)
    rows = [
        {
            "id": f"mail-{i}",
            "users": [f"u{j}" for j in rng.choice(60, size=2, replace=False)],
            "features": rng.normal(size=32).round(4).tolist(),
            "label": int(rng.random() < 0.5),
        }
        for i in range(300)
    ]
    records = tmp_path / "mail.jsonl"
    records.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = tmp_path / "job.yaml"
    config.write_text(f"""run_dir: {tmp_path / "run"}
input: {records}
bound: {{max_contributions: 8, runner: local}}
batch: {{steps: 40, batch_size: 30, min_sep: 1, runner: local}}
calibrate: {{epsilon: 4, delta: 1.0e-4}}
train: {{model: logreg}}
""")
    code, result, _ = _audit(capsys, str(config), "--canaries", "20", "--non-private")
    assert code == 0 and result["canaries"] == 20
    canaries = json.loads((tmp_path / "run" / "audit" / "audit.json").read_text())["per_canary"]
    assert all(c["user"].startswith("madp-canary-user-") for c in canaries)
    rows[5]["id"] = "madp-canary-record-3"
    records.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert cli.main(["-q", "audit", str(config), "--canaries", "20", "--seed", "1"]) == 2
    assert "already use the canary id 'madp-canary-record-3'" in capsys.readouterr().err


def test_bad_audit_options_are_named(tmp_path, capsys, auditable_records):
    config = _config(tmp_path, auditable_records)
    assert cli.main(["-q", "audit", config, "--canaries", "1"]) == 2
    assert "--canaries must be at least 2" in capsys.readouterr().err
    assert cli.main(["-q", "run", config, "--set", "audit.canaris=5"]) == 2
    assert "config audit: unknown key(s) canaris" in capsys.readouterr().err
    assert cli.main(["-q", "audit", config, "--output", str(tmp_path / "run" / "bound")]) == 2
    assert "inside or around run_dir" in capsys.readouterr().err
    assert cli.main(["-q", "run", config, "--set", "audit.canaries=many"]) == 2
    assert "config audit.canaries: expected int, got 'many'" in capsys.readouterr().err
    for text_model in ("text-classifier", "causal-lm"):  # refused before any stage runs
        assert cli.main(["-q", "audit", config, "--set", f"train.model={text_model}"]) == 2
        assert "text models cannot be audited yet" in capsys.readouterr().err
    # float32 features of this norm square to inf: clipping would silently drop every canary
    assert cli.main(["-q", "audit", config, "--canary-norm", "1e40"]) == 2
    assert "--canary-norm 1e+40: canary features of norm" in capsys.readouterr().err


KERAS3_LOGREG = """
import keras


def build(schema):
    model = keras.Sequential([keras.Input(shape=schema.inputs[0].shape), keras.layers.Dense(1)])

    def loss(labels, logits):  # one loss per row
        return keras.losses.binary_crossentropy(keras.ops.reshape(labels, (-1, 1)), logits, from_logits=True)

    return model, loss
"""


def test_a_keras3_module_model_is_audited_with_its_trained_weights(tmp_path, capsys, auditable_records):
    """The audit rebuilds a `module:function` model in its own Keras and loads what training saved:
    a model left at its initialization would score canaries by chance, and measure about 0."""
    (tmp_path / "k3.py").write_text(KERAS3_LOGREG)
    config = _config(tmp_path, auditable_records)
    extra = ["--set", "train.model=k3:build", "--set", f"train.model_path={tmp_path}"]
    code = cli.main(["-q", "audit", config, "--canaries", "100", "--seed", "1", "--non-private", *extra])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["epsilon_lower_bound"] > 1.0


def test_a_model_of_several_inputs_is_refused_by_name(tmp_path, capsys, auditable_records):
    config = _config(tmp_path, auditable_records)
    code = cli.main(["-q", "audit", config, "--set", "train.inputs=features,other"])
    assert code != 0 and "cannot be audited" in capsys.readouterr().err


def test_canaries_are_not_scaled_by_a_median_of_broken_features(tmp_path, auditable_records):
    """A NaN among the real records' features makes their median norm NaN: named as the data's
    fault, not as a --canary-norm too large."""
    import glob

    import pyarrow as pa
    import pyarrow.parquet as pq

    from madp.core.records import Columns
    from madp.jobs.audit import plant
    from madp.tools.planning.audit_config import AuditOptions

    source = sorted(glob.glob(str(auditable_records / "records" / "*.parquet")))[0]
    table = pq.read_table(source)
    features = table.column("features").to_pylist()
    features[0] = [float("nan")] * len(features[0])
    broken = table.set_column(
        table.schema.get_field_index("features"),
        "features",
        pa.array(features, type=table.schema.field("features").type),
    )
    pq.write_table(broken, tmp_path / "broken.parquet")
    with pytest.raises(InputError, match="'features' column holds NaN or infinite values"):
        plant(
            [str(tmp_path / "broken.parquet")], Columns(), "features", "label", AuditOptions(), np.random.default_rng(1)
        )
