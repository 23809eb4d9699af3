"""The released guarantee end to end: secret sampling and noise keys (fresh per run, never written,
reproducible only from an explicit testing seed), the contribution bound the accountant really
uses, truncation's delta, and an attacker who reads every published output of a default run."""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import io
import json
import os
import re
import socket
import time
import zipfile

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
from madp.core.options import flag_of
from madp.core.randomness import FIXED_SEED, SECRET, SecretKey
from madp.core.selection import BoundOptions
from madp.engines.batch_local import run_local as batch_local
from madp.engines.batching import BatchOptions
from madp.engines.local_engine import run_local as bound_local
from madp.jobs.reference import LAID_OUT_AS, OUTPUTS
from madp.tools.data.synthetic import GraphSpec, generate, to_table

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
    assert [r.sampling for r in reports] == [SECRET, SECRET]
    assert all(r.parameters.seed is None for r in reports)
    with caplog.at_level("WARNING"):
        seeded = [
            batch_local(
                selected, data, str(tmp_path / f"seeded{i}"), BatchOptions(steps=30, batch_size=40, min_sep=2, seed=7)
            )
            for i in (1, 2)
        ]
    assert "NOT private" in caplog.text
    assert batch_bytes(tmp_path / "seeded1") == batch_bytes(tmp_path / "seeded2")
    assert seeded[0].sampling == FIXED_SEED and seeded[0].parameters.seed == 7


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
    assert report.sampling == randomness.DETERMINISTIC


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
    assert report.contribution_bound == 7 and report.max_user_contribution == 7
    batch_local(
        str(tmp_path / "bounded"), data, str(tmp_path / "batches"), BatchOptions(steps=50, batch_size=40, seed=1)
    )
    batches = open_batches(str(tmp_path / "batches"))
    sigma = 5.0  # a given sigma: one PLD evaluation each (calibrating k = 7 to an epsilon is seconds per sigma tried)
    plan = privacy_plan(batches, TrainOptions(noise_multiplier=sigma, delta=1e-5))
    assert plan.contribution_bound == 7 and plan.parameters.max_contributions == 7
    with pytest.raises(InputError, match="^max_contributions 1 is below") as refused:
        privacy_plan(batches, TrainOptions(noise_multiplier=sigma, delta=1e-5, max_contributions=1))
    assert refused.value.named(flag_of).startswith("--max-contributions 1 is below")  # as the command line says it
    nine = privacy_plan(batches, TrainOptions(noise_multiplier=sigma, delta=1e-5, max_contributions=9))
    assert nine.contribution_bound == 9 and nine.epsilon > plan.epsilon
    with caplog.at_level("WARNING"):
        privacy_plan(batches, TrainOptions(noise_multiplier=sigma, delta=0.01))
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
    options = TrainOptions(noise_multiplier=3.0, bands=1)  # a given sigma: one PLD evaluation, not a search
    assert privacy_plan(batches, options).contribution_bound == 3
    bound_local(data, selected, BoundOptions(max_contributions=1))  # the same SELECTED, now K = 1
    with pytest.raises(InputError, match="changed since"):
        privacy_plan(batches, options)


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
    rho = 40 * binom.sf(100, report.units, report.sampling_probability)  # independent of the plan's code
    assert plan.mechanism == "dpsgd" and plan.truncation_delta == pytest.approx(rho * (1 + np.exp(plan.epsilon)))
    assert 0 < plan.truncation_delta < 1e-5 and plan.delta == 1e-5
    from madp.accounting.calibrate import epsilon
    from madp.accounting.mechanisms import DpSgd

    mechanism = DpSgd(report.sampling_probability, 40, 2)
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


INTERNAL = (  # docs/privacy.md: the threat model
    "audit",
    "baseline",
    "batches",
    "bound",
    "internal-report.html",
    "internal-results.json",
    os.path.join("train", "internal"),
)


def _published_files(run_dir, internal: tuple[str, ...] = INTERNAL) -> list[str]:
    """Every output a user may publish or share: the model, metrics, reports, privacy.json, report.html,
    the TensorBoard logs; not what the threat model (docs/privacy.md) calls internal (`internal`: the audit's
    second model and its data, the non-private baseline, the batches and their report, the trainings
    ledger, the internal page and results) nor rejected/ folders."""
    found = []
    hidden = {os.path.join(str(run_dir), i) for i in internal}
    for root, directories, files in os.walk(run_dir):
        directories[:] = [d for d in directories if os.path.join(root, d) not in hidden and d != "rejected"]
        for name in files:
            if name.endswith((".tfrecord", ".parquet")) or "/." in root or os.path.join(root, name) in hidden:
                continue  # the data and the batches themselves are never published
            found.append(os.path.join(root, name))
    return found


def declared_published(stage: str, relative: str) -> bool | None:
    """Whether docs/reference/outputs.md (`madp.jobs.reference.OUTPUTS`) declares the file at `relative` below
    `stage`'s output published; None where it declares no such file."""
    for each in OUTPUTS:
        if each.stage != stage:
            continue
        if each.path.endswith("/") and relative.startswith(each.path):
            inner = True if each.output_of is None else declared_published(each.output_of, relative[len(each.path) :])
        elif each.output_of is not None and relative == each.path:
            inner = declared_published(each.output_of, "")  # the stage's output is this file
        elif each.output_of is None and fnmatch.fnmatchcase(relative, each.path):
            inner = True
        else:
            continue
        return None if inner is None else each.published and inner
    return declared_published(LAID_OUT_AS[stage], relative) if stage in LAID_OUT_AS else None


def assert_the_outputs_reference_declares_every_file(run_dir) -> None:
    """Every file of the run is in the outputs reference, which calls published exactly the files the threat
    model (docs/privacy.md, `_published_files`) does."""
    found = {
        os.path.relpath(os.path.join(root, name), run_dir) for root, _, files in os.walk(run_dir) for name in files
    }
    declared = {relative: declared_published("run", relative.replace(os.sep, "/")) for relative in found}
    assert not [relative for relative, published in declared.items() if published is None], declared
    published = {os.path.relpath(path, run_dir) for path in _published_files(run_dir)}
    assert {relative for relative, is_published in declared.items() if is_published} == published


def _published_text(run_dir, internal: tuple[str, ...] = INTERNAL) -> str:
    return "\n".join(open(path, "rb").read().decode("latin-1") for path in _published_files(run_dir, internal))


# What batches/report.json says of the realized sampling (docs/privacy.md: internal, like the batches)
REALIZED_SAMPLING = {
    "batch_sizes",
    "written_batch_sizes",
    "warm_up_batch_sizes",
    "users_per_step",
    "relative_error_to_target",
    "truncated_rows",
    "padding_rows",
    "records_never_written",
    "participation",
    "mean_batch_size",
}


def _keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {key for item in value.values() for key in _keys(item)}
    return {key for item in value for key in _keys(item)} if isinstance(value, list) else set()


def _clock_times(started: float, ended: float) -> set[str]:
    """How a time within the run would be written: dates with hours and minutes (Keras' "date_saved",
    ISO 8601), and each second as HH:MM:SS, in local time and in UTC."""
    written = set()
    for second in range(int(started) - 2, int(ended) + 3):
        for moment in (time.localtime(second), time.gmtime(second)):
            written.add(time.strftime("%H:%M:%S", moment))
            written.update(time.strftime(f"%Y-%m-%d{sep}%H:%M", moment) for sep in ("@", "T", " "))
    return written


def assert_nothing_published_times_the_run_or_shows_its_sampling(run_dir, summary: dict, started: float, ended: float):
    """An attacker who reads every published output of a run (and its printed summary) finds no clock time
    of the run, no figure of the realized sampling, and no content digest of a batch or record file.

    Clock times: none in a file name (epoch seconds, the host name, the process id, as tf.summary's
    event files carry them), in a TensorBoard event (wall_time: tf.summary's holds the time each
    scalar was written), in a number (epoch seconds or milliseconds) or a date-and-time of any text or
    binary output, in a zip entry's time or an HDF5 object's times (model.keras holds both)."""
    import h5py
    from tensorflow.compat.v1.train import summary_iterator

    run_dir = str(run_dir)
    files = _published_files(run_dir)
    contents = {path: open(path, "rb").read() for path in files}
    texts = [data.decode("latin-1") for data in contents.values()] + [json.dumps(summary)]
    images = [base64.b64decode(png) for text in texts for png in re.findall(r"data:image/png;base64,([\w+/=]+)", text)]
    assert images, "report.html's plots are read too (their PNG metadata)"
    texts += [image.decode("latin-1") for image in images]
    low, high = started - 2, ended + 2

    def is_clock(number: float) -> bool:
        return low <= number <= high or low * 1000 <= number <= high * 1000

    for path in files:
        name = os.path.relpath(path, run_dir)
        assert not any(is_clock(int(n)) for n in re.findall(r"\d+", name)), name
        assert not {socket.gethostname(), str(os.getpid())} & set(re.split(r"[./]", name)), name
    events = [path for path in files if "tfevents" in os.path.basename(path)]
    assert events, "the published logs are among the outputs"
    for path in events:
        for event in summary_iterator(path):
            assert not is_clock(event.wall_time) and (event.wall_time == event.step or event.file_version), path
    for text in texts:
        assert not any(is_clock(float(n)) for n in re.findall(r"\d{9,13}(?:\.\d+)?", text))
    times = _clock_times(started, ended)
    for text in texts:
        assert not [t for t in times if t in text], "a clock time of the run is in a published output"
    archives = [path for path in files if zipfile.is_zipfile(path)]
    assert archives, "model.keras is among the outputs"
    for path in archives:
        with zipfile.ZipFile(path) as archive:
            for entry in archive.infolist():
                assert not is_clock(time.mktime((*entry.date_time, 0, 0, -1))), (path, entry.filename)
                content = archive.read(entry)
                times_in = [t for t in times if t in content.decode("latin-1")]
                assert not times_in, (path, entry.filename, times_in)
                if content.startswith(b"\x89HDF"):
                    with h5py.File(io.BytesIO(content), "r") as weights:
                        objects = [weights] + [weights[name] for name in _h5_names(weights)]
                        for item in objects:
                            info = h5py.h5o.get_info(item.id)
                            stamps = (info.atime, info.mtime, info.ctime, info.btime)
                            assert not any(map(is_clock, stamps)), (path, item.name)

    # The realized sampling: batches/report.json's figures, under their names or as their values
    batches = json.load(open(os.path.join(run_dir, "batches", "report.json")))
    published_json = [json.loads(data) for path, data in contents.items() if path.endswith(".json")] + [summary]
    assert not REALIZED_SAMPLING & {key for value in published_json for key in _keys(value)}
    sizes = batches["batch_sizes"]["per_step"]
    assert len(set(sizes)) > 1, "a run whose batch sizes vary, so that their sequence is recognizable"
    for rendering in (", ".join(map(str, sizes)), " ".join(map(str, sizes)), json.dumps(sizes)):
        assert all(rendering not in text for text in texts), rendering
    mean = batches["batch_sizes"]["mean"]
    if mean != batches["expected_batch_size"]:
        for text in texts:
            assert not re.search(rf"(?<![\d.]){re.escape(f'{mean:.2f}')}(?!\d)", text), mean

    # No content digest: no SHA-256 of a batch, selection or record file (or held-out content), and not the
    # bound's graph digest (bound/ is internal: unkeyed, the digest confirms a guessed graph)
    content_files = [
        os.path.join(root, name)
        for root, _, names in os.walk(run_dir)
        for name in names
        if name.endswith((".tfrecord", ".parquet"))
    ]
    assert any(f.endswith(".tfrecord") for f in content_files) and any("records" in f for f in content_files)
    assert any(os.sep + "selected" + os.sep in f for f in content_files)
    graph = json.load(open(os.path.join(run_dir, "bound", "report.json")))["graph_digest"]["digest"]
    assert all(graph not in text for text in texts)
    for path in content_files:
        digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
        assert all(digest not in text for text in texts), f"digest of {path} published"


def _h5_names(group) -> list[str]:
    names: list[str] = []
    group.visit(names.append)
    return names


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
    started = time.time()
    assert main(["-q", "run", str(tmp_path / "job.yaml")]) == 0
    ended = time.time()
    summary = json.loads(capsys.readouterr().out)
    assert_nothing_published_times_the_run_or_shows_its_sampling(tmp_path / "run", summary, started, ended)
    assert_the_outputs_reference_declares_every_file(tmp_path / "run")
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


def test_an_attacker_finds_no_clock_time_sampling_figure_or_digest_in_a_run_with_a_pretrained_model(tmp_path, capsys):
    """A default `madp run` fine-tuning a pretrained model (a small GGUF file) beside a non-private
    baseline: the published outputs hold no clock time, no realized sampling and no content digest. (The
    audit plants its canaries in a numeric features vector, so it runs beside a numeric model: the test
    above reads that run's outputs the same way.)"""
    pytest.importorskip("gguf")
    from test_pretrained import write_tiny_gguf

    config = {
        "run_dir": str(tmp_path / "run"),
        "generate": {"records": 400, "task": "text", "seed": 3, "holdout": True},
        "bound": {"max_contributions": 2, "runner": "local"},
        "batch": {"steps": 6, "batch_size": 8, "min_sep": 1, "runner": "local"},
        "calibrate": {"noise_multiplier": 1.0, "delta": 1e-5},
        "train": {
            "model": "causal-lm",
            "pretrained": write_tiny_gguf(str(tmp_path / "tiny.gguf")),
            "max_length": 16,
            "lora_rank": 2,
            "eval_every": 3,
            "baseline": True,
        },
        "report": True,
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    started = time.time()
    assert main(["-q", "run", str(tmp_path / "job.yaml")]) == 0
    ended = time.time()
    summary = json.loads(capsys.readouterr().out)
    assert summary["results"]["privacy"]["private"] is True and "baseline" not in summary["results"]
    assert "pretrained" in json.load(open(tmp_path / "run" / "train" / "privacy.json"))["assumptions"][-1]
    assert_nothing_published_times_the_run_or_shows_its_sampling(tmp_path / "run", summary, started, ended)


def test_a_noise_seed_reproduces_training_and_marks_it_not_private(bounded, tmp_path):
    pytest.importorskip("tensorflow")
    from madp.training.options import TrainOptions
    from madp.training.preparation import tf_keras
    from madp.training.trainer import train

    directory, data = bounded
    batch_local(
        str(directory / "bounded"), data, str(tmp_path / "batches"), BatchOptions(steps=15, batch_size=40, seed=1)
    )

    def weights(name: str, **options):
        privacy = train(
            str(tmp_path / "batches"),
            str(tmp_path / name),
            TrainOptions(noise_multiplier=1.0, features="features", **options),
        ).privacy
        model = tf_keras.models.load_model(str(tmp_path / name / "model.keras"), compile=False)
        return privacy, [w.copy() for w in model.get_weights()]

    (p1, w1), (_, w2) = weights("fresh1"), weights("fresh2")
    assert p1["noise"] == SECRET and not all(np.array_equal(a, b) for a, b in zip(w1, w2)), "noise differs per run"
    assert p1["private"] is False, "these batches came from a fixed --seed"
    (s1, v1), (_, v2) = weights("seeded1", noise_seed=5), weights("seeded2", noise_seed=5)
    assert s1["noise"] == FIXED_SEED and s1["private"] is False
    assert all(np.array_equal(a, b) for a, b in zip(v1, v2))
