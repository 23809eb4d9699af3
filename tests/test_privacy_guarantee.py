"""The released guarantee end to end: secret sampling and noise keys (fresh per run, never written,
reproducible only from an explicit testing seed), the contribution bound the accountant really
uses, truncation's delta, and an attacker who reads every published output of a default run."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re

import numpy as np
import pytest
import yaml
from conftest import write_records
from reference import reference_siphash24
from scipy.stats import binom

from madp.cli import main
from madp.core import randomness
from madp.core.errors import InputError
from madp.core.hashing import siphash24
from madp.core.randomness import FIXED_SEED, SECRET, SecretKey
from madp.core.selection import BoundOptions
from madp.engines.batch_local import run_local as batch_local
from madp.engines.batching import BatchOptions
from madp.engines.local_engine import run_local as bound_local
from madp.tools.synthetic import GraphSpec, generate, to_table

pytestmark = [pytest.mark.beam, pytest.mark.tf]

BEAM = ["--runner", "DirectRunner", "--direct_running_mode", "multi_processing"]


def batch_bytes(output) -> dict[str, bytes]:
    return {
        n: open(os.path.join(output, n), "rb").read() for n in sorted(os.listdir(output)) if n.endswith(".tfrecord")
    }


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    directory = tmp_path_factory.mktemp("guarantee")
    rows = to_table(generate(GraphSpec(records=3000, graph="skewed", features=4, seed=4))).to_pylist()
    data = write_records(str(directory / "records.jsonl"), rows)
    bound_local(data, str(directory / "bounded"), BoundOptions(max_contributions=2))
    return directory, data


# --- the keyed PRF and the keys -------------------------------------------------------------------


def test_siphash_matches_the_reference_vector_and_a_scalar_implementation():
    key = (int.from_bytes(bytes(range(8)), "little"), int.from_bytes(bytes(range(8, 16)), "little"))
    message = int.from_bytes(bytes(range(8)), "little")
    # SipHash-2-4 reference test vector for key 00..0f and the 8-byte message 00..07.
    assert int(siphash24(key, np.array([message], np.uint64))[0]) == 0x93F5F5799A932462
    words = np.random.default_rng(0).integers(0, 2**63, 50, dtype=np.int64).view(np.uint64)
    assert [int(v) for v in siphash24((12345, 67890), words)] == [
        reference_siphash24((12345, 67890), int(w).to_bytes(8, "little")) for w in words
    ]


def test_keys_are_fresh_unless_seeded_and_never_shown():
    a, b = SecretKey.fresh(), SecretKey.fresh()
    assert a.words != b.words and a.status == SECRET and a.seed is None
    seeded = SecretKey.from_seed(3, "batch sampling")
    assert seeded == SecretKey.from_seed(3, "batch sampling") and seeded.status == FIXED_SEED
    assert seeded.words != SecretKey.from_seed(3, "training noise").words, "one seed, independent keys per purpose"
    assert str(a.words[0]) not in repr(a) and str(a.words[1]) not in repr(a)


# --- batch sampling ---------------------------------------------------------------------------------


def test_default_batches_differ_per_run_and_a_seed_reproduces_them(bounded, tmp_path, caplog):
    directory, data = bounded
    selected = str(directory / "bounded")
    reports = [
        batch_local(selected, data, str(tmp_path / f"default{i}"), BatchOptions(steps=30, batch_size=40, min_sep=2))
        for i in (1, 2)
    ]
    assert batch_bytes(tmp_path / "default1") != batch_bytes(tmp_path / "default2")
    assert [r["sampling"] for r in reports] == [SECRET, SECRET]
    assert all(r["parameters"]["seed"] is None for r in reports)
    with caplog.at_level("WARNING"):
        seeded = [
            batch_local(
                selected, data, str(tmp_path / f"seeded{i}"), BatchOptions(steps=30, batch_size=40, min_sep=2, seed=7)
            )
            for i in (1, 2)
        ]
    assert "NOT private" in caplog.text
    assert batch_bytes(tmp_path / "seeded1") == batch_bytes(tmp_path / "seeded2")
    assert seeded[0]["sampling"] == FIXED_SEED and seeded[0]["parameters"]["seed"] == 7


def test_one_secret_key_gives_the_same_batches_on_both_engines_and_any_worker_count(bounded, tmp_path):
    """The driver draws the key once and hands it to the Beam workers with the pipeline."""
    from madp.beam.batch import run_beam

    directory, data = bounded
    selected = str(directory / "bounded")
    options = BatchOptions(steps=30, batch_size=40, min_sep=3, max_batch_size=50, output_shards=2)
    assert options.seed is None
    batch_local(selected, data, str(tmp_path / "local"), options)
    run_beam(selected, data, str(tmp_path / "beam"), options, [*BEAM, "--partitions=3"])
    assert batch_bytes(tmp_path / "local") == batch_bytes(tmp_path / "beam")


def test_user_sampling_is_keyed_too(tmp_path):
    rows = [{"id": i, "users": [i % 50], "x": [float(i)], "label": i % 2} for i in range(500)]
    data = write_records(str(tmp_path / "single.jsonl"), rows)
    bound_local(data, str(tmp_path / "bounded"), BoundOptions(max_contributions=3))
    for name in ("a", "b"):
        batch_local(
            str(tmp_path / "bounded"), data, str(tmp_path / name), BatchOptions(steps=20, batch_size=5, sampler="users")
        )
    assert batch_bytes(tmp_path / "a") != batch_bytes(tmp_path / "b")


def test_greedy_batches_say_they_need_no_secret(bounded, tmp_path):
    directory, data = bounded
    report = batch_local(
        str(directory / "bounded"),
        data,
        str(tmp_path / "greedy"),
        BatchOptions(steps=20, batch_size=30, sampler="minsep-greedy", min_sep=3),
    )
    assert report["sampling"] == randomness.DETERMINISTIC


# --- the contribution bound -------------------------------------------------------------------------


def test_the_accountant_uses_the_largest_capacity_and_refuses_a_smaller_k(tmp_path, caplog):
    pytest.importorskip("tensorflow")
    from madp.training.batches import open_batches
    from madp.training.options import TrainOptions
    from madp.training.plan import privacy_plan

    rows = [{"id": i, "users": [i % 200], "features": [0.1, 0.2], "label": i % 2} for i in range(1400)]
    data = write_records(str(tmp_path / "records.jsonl"), rows)
    capacities = tmp_path / "capacities.csv"
    capacities.write_text("user,capacity\n3,7\n")
    report = bound_local(data, str(tmp_path / "bounded"), BoundOptions(max_contributions=1, capacities=str(capacities)))
    assert report["contribution_bound"] == 7 and report["max_user_contribution"] == 7
    batch_local(
        str(tmp_path / "bounded"), data, str(tmp_path / "batches"), BatchOptions(steps=50, batch_size=40, seed=1)
    )
    batches = open_batches(str(tmp_path / "batches"))
    plan = privacy_plan(batches, TrainOptions(epsilon=2.0, delta=1e-5))
    assert plan.contribution_bound == 7 and plan.parameters.max_contributions == 7
    with pytest.raises(InputError, match="--max-contributions 1 is below"):
        privacy_plan(batches, TrainOptions(epsilon=2.0, delta=1e-5, max_contributions=1))
    assert privacy_plan(batches, TrainOptions(epsilon=2.0, delta=1e-5, max_contributions=9)).contribution_bound == 9
    with caplog.at_level("WARNING"):
        privacy_plan(batches, TrainOptions(epsilon=2.0, delta=0.01))
    assert "delta 0.01 exceeds 1/200 users" in caplog.text


def test_a_selection_rebounded_after_batching_is_refused(bounded, tmp_path):
    pytest.importorskip("tensorflow")
    from madp.training.batches import open_batches
    from madp.training.options import TrainOptions
    from madp.training.plan import privacy_plan

    directory, data = bounded
    selected = str(tmp_path / "bounded")
    bound_local(data, selected, BoundOptions(max_contributions=3))
    batch_local(selected, data, str(tmp_path / "batches"), BatchOptions(steps=20, batch_size=30, seed=1))
    batches = open_batches(str(tmp_path / "batches"))
    assert privacy_plan(batches, TrainOptions(epsilon=4.0, bands=1)).contribution_bound == 3
    bound_local(data, selected, BoundOptions(max_contributions=1))  # the same SELECTED, now K = 1
    with pytest.raises(InputError, match="changed since"):
        privacy_plan(batches, TrainOptions(epsilon=4.0, bands=1))


# --- truncation -------------------------------------------------------------------------------------


def test_truncation_of_poisson_batches_is_accounted_in_delta(bounded, tmp_path):
    pytest.importorskip("tensorflow")
    from madp.training.batches import open_batches
    from madp.training.options import TrainOptions
    from madp.training.plan import privacy_plan

    directory, data = bounded
    report = batch_local(
        str(directory / "bounded"),
        data,
        str(tmp_path / "batches"),
        BatchOptions(steps=40, batch_size=50, max_batch_size=100, seed=2),
    )
    batches = open_batches(str(tmp_path / "batches"))
    plan = privacy_plan(batches, TrainOptions(epsilon=3.0, delta=1e-5))
    rho = 40 * binom.sf(100, report["units"], report["sampling_probability"])  # independent of the plan's code
    assert plan.mechanism == "dpsgd" and plan.truncation_delta == pytest.approx(rho * (1 + np.exp(plan.epsilon)))
    assert 0 < plan.truncation_delta < 1e-5 and plan.delta == 1e-5
    from madp.accounting.calibrate import epsilon
    from madp.accounting.mechanisms import DpSgd

    mechanism = DpSgd(report["sampling_probability"], 40, 2)
    assert epsilon(mechanism, plan.noise_multiplier, 1e-5 - plan.truncation_delta) <= 3.0
    batch_local(
        str(directory / "bounded"),
        data,
        str(tmp_path / "tight"),
        BatchOptions(steps=40, batch_size=50, max_batch_size=52, seed=2),
    )
    with pytest.raises(InputError, match="truncation at --max-batch-size costs delta"):
        privacy_plan(open_batches(str(tmp_path / "tight")), TrainOptions(epsilon=3.0, delta=1e-5))
    unamplified = privacy_plan(
        open_batches(str(tmp_path / "tight")), TrainOptions(epsilon=3.0, delta=1e-5, bands=1, mechanism="bandmf")
    )
    assert unamplified.truncation_delta == 0 and unamplified.relies_on_secret_sampling is False


# --- the attacker who reads every published output ---------------------------------------------------


INTERNAL = (  # README: threat model
    "audit",
    "baseline",
    "batches",
    os.path.join("bound", "trainings.jsonl"),
    "internal-report.html",
    "internal-results.json",
    os.path.join("train", "internal"),
)


def _published_text(run_dir, internal: tuple[str, ...] = INTERNAL) -> str:
    """Every output a user may publish or share: the model, metrics, reports, privacy.json, report.html;
    not what the README's threat model calls internal (`internal`: the audit's second model and its
    data, the non-private baseline, the batches and their report, the trainings ledger, the internal
    page and results) nor rejected/ folders."""
    chunks = []
    hidden = {os.path.join(str(run_dir), i) for i in internal}
    for root, directories, files in os.walk(run_dir):
        directories[:] = [d for d in directories if os.path.join(root, d) not in hidden and d != "rejected"]
        for name in files:
            if name.endswith((".tfrecord", ".parquet")) or "/." in root or os.path.join(root, name) in hidden:
                continue  # the data and the batches themselves are never published
            content = open(os.path.join(root, name), "rb").read()
            chunks.append(content.decode("latin-1"))
    return "\n".join(chunks)


def _encodings(words: tuple[int, int]) -> list[str]:
    raw = b"".join(w.to_bytes(8, "little") for w in words)
    signed = [w - (1 << 64) if w >= 1 << 63 else w for w in words]
    return [
        *(str(w) for w in (*words, *signed)),
        *(f"{w:x}" for w in words),
        raw.hex(),
        base64.b64encode(raw).decode(),
        int.from_bytes(raw, "little").__str__(),
    ]


def test_an_attacker_with_every_published_output_cannot_regenerate_sampling_or_noise(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tensorflow")
    drawn = []
    real_fresh = SecretKey.fresh.__func__

    def recording_fresh(cls):
        key = real_fresh(cls)
        drawn.append(key)
        return key

    monkeypatch.setattr(SecretKey, "fresh", classmethod(recording_fresh))
    config = {
        "run_dir": str(tmp_path / "run"),
        "generate": {"records": 2000, "features": 4, "seed": 3, "holdout": True},
        "bound": {"max_contributions": 2, "runner": "local"},
        "batch": {"steps": 20, "batch_size": 40, "min_sep": 1, "runner": "local"},
        "calibrate": {"noise_multiplier": 1.5, "delta": 1e-5},  # one PLD evaluation, not a search
        "train": {"model": "logreg", "eval_every": 10, "baseline": True},
        "audit": {"canaries": 20},
        "report": True,
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    assert main(["-q", "run", str(tmp_path / "job.yaml")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert "mean_batch_size" not in summary["results"]["batch"] and summary["results"]["privacy"]["private"] is True
    assert not {"baseline", "private_over_non_private"} & set(summary["results"]), (
        "the non-private baseline is not covered by the guarantee: internal only"
    )
    internal = json.load(open(tmp_path / "run" / "internal-results.json"))
    assert "accuracy" in internal["baseline"] and "internal-results.json" in summary["internal"]
    assert len(drawn) >= 2, "sampling and noise keys drawn fresh (validating the config draws one more)"
    privacy = json.load(open(tmp_path / "run" / "train" / "privacy.json"))
    assert privacy["sampling"] == SECRET and privacy["noise"] == SECRET and privacy["private"] is True
    assert privacy["privacy_unit"].startswith("a user") and "zero-out" in privacy["neighbouring_relation"]

    page = open(tmp_path / "run" / "report.html").read()
    assert "Batch sizes" not in page and "mean realized batch size" not in page, (
        "the realized sampling of an amplified mechanism stays off the published page"
    )
    assert "records per user the accountant assumes (k)</td><td>2<" in page and "zero-out" in page
    assert "Privacy audit" in page and "composition of both trainings" in page, (
        "the audit is a second release of the records, and the page says so"
    )
    assert json.load(open(tmp_path / "run" / "audit" / "audit.json"))["inclusion"] == SECRET
    assert "non-private baseline is left out" in page and "non-private (internal)" not in page
    assert "baseline/ metrics.json" not in page and "privacy-utility gap" not in page
    assert "non-private (internal) eval accuracy" in open(tmp_path / "run" / "internal-report.html").read()
    published = _published_text(tmp_path / "run")
    assert '"baseline"' not in published and "private_over_non_private" not in published
    # Wall times depend on the realized sampling and the content: in no published file nor the summary
    for timing in ("wall_time_s", "steps_per_s"):
        assert timing not in published and timing not in json.dumps(summary), timing
    ran = {stage["stage"] for stage in summary["stages"] if stage["status"] == "ran"}
    assert set(internal["wall_time_s"]) == ran | {"total"} and "train" in ran
    assert set(json.load(open(tmp_path / "run" / "train" / "internal" / "timing.json"))) == {
        "wall_time_s",
        "steps_per_s",
    }
    # The held-out records are not declared public (--eval-data-public): the evaluations on them, computed
    # without noise, stay internal, in no published file, log or page.
    evaluated = json.load(open(tmp_path / "run" / "train" / "internal" / "evaluation.json"))
    assert [point["step"] for point in evaluated["eval"]] == [10, 20] and "train" not in summary["results"]
    for point in evaluated["eval"]:
        assert repr(point["loss"]) not in published and repr(point["accuracy"]) not in published
    assert "eval/" not in published and "eval accuracy" not in page and "evaluations are left out" in page
    assert internal["train"]["accuracy"] == evaluated["final"]["accuracy"]
    # No content digest: no SHA-256 of a batch file or of a file of records or held-out content.
    content_files = [
        os.path.join(root, name)
        for root, _, files in os.walk(tmp_path / "run")
        for name in files
        if name.endswith(".tfrecord") or (name.endswith(".parquet") and os.sep + "selected" not in root)
    ]
    assert any(f.endswith(".tfrecord") for f in content_files) and any("records" in f for f in content_files)
    for path in content_files:
        assert hashlib.sha256(open(path, "rb").read()).hexdigest() not in published, f"digest of {path} published"
    everything = published + _published_text(tmp_path / "run", internal=())
    for key in drawn:
        for text in _encodings(key.words):
            assert text not in everything, "a secret key was written to an output"
    # The attacker knows the code: try the default seed and every number in the published outputs
    # as the seed of the sampling and of the noise. None of them is the key that was used.
    candidates = {0, 1, 3} | {int(n) for n in re.findall(r"-?\d+", published) if abs(int(n)) < 2**63}
    guessed = {
        SecretKey.from_seed(candidate, purpose).words
        for candidate in candidates
        for purpose in ("batch sampling", "training noise", "audit canaries")
    }
    assert not guessed & {key.words for key in drawn}
    # And the batches made from the default seed, the old public default, are not the batches trained on.
    run = tmp_path / "run"
    batch_local(
        str(run / "bound"), str(run / "records"), str(tmp_path / "guess"), BatchOptions(steps=20, batch_size=40, seed=0)
    )
    assert batch_bytes(tmp_path / "guess") != batch_bytes(run / "batches")


def test_a_noise_seed_reproduces_training_and_marks_it_not_private(bounded, tmp_path):
    pytest.importorskip("tensorflow")
    from madp.training.options import TrainOptions
    from madp.training.trainer import tf_keras, train

    directory, data = bounded
    batch_local(
        str(directory / "bounded"), data, str(tmp_path / "batches"), BatchOptions(steps=15, batch_size=40, seed=1)
    )

    def weights(name: str, **options):
        privacy = train(
            str(tmp_path / "batches"),
            str(tmp_path / name),
            TrainOptions(noise_multiplier=1.0, features="features", **options),
        )["privacy"]
        model = tf_keras.models.load_model(str(tmp_path / name / "model.keras"), compile=False)
        return privacy, [w.copy() for w in model.get_weights()]

    (p1, w1), (_, w2) = weights("fresh1"), weights("fresh2")
    assert p1["noise"] == SECRET and not all(np.array_equal(a, b) for a, b in zip(w1, w2)), "noise differs per run"
    assert p1["private"] is False, "these batches came from a fixed --seed"
    (s1, v1), (_, v2) = weights("seeded1", noise_seed=5), weights("seeded2", noise_seed=5)
    assert s1["noise"] == FIXED_SEED and s1["private"] is False
    assert all(np.array_equal(a, b) for a, b in zip(v1, v2))
