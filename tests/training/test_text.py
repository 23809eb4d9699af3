"""Text workloads: text through bound and batch into the trainer, n-gram hashing stable across
processes, the embedding-bag and language-model clipping against a per-example reference, both
models training under DP-SGD and BandMF, the evaluation metrics, and bad text input."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("tensorflow")

from conftest import ROOT

from madp.core.batch_files import Feature  # noqa: E402
from madp.core.errors import InputError  # noqa: E402
from madp.core.options import error_text  # noqa: E402
from madp.core.selection import BoundOptions  # noqa: E402
from madp.engines.batch_local import run_local as batch_local  # noqa: E402
from madp.engines.batching import BatchOptions  # noqa: E402
from madp.engines.local_engine import run_local as bound_local  # noqa: E402
from madp.tools.data.synthetic import GraphSpec, generate, to_table, write_dataset  # noqa: E402
from madp.tools.data.synthetic_text import personal_words  # noqa: E402
from madp.training import text  # noqa: E402
from madp.training.batches import open_batches  # noqa: E402
from madp.training.clipping import per_example_gradients  # noqa: E402
from madp.training.data import step_batches  # noqa: E402
from madp.training.ghost_clipping import _is_dense_stack, ghost_clipped_sum, unsupported_layers  # noqa: E402
from madp.training.options import TrainOptions  # noqa: E402
from madp.training.outputs import evaluation_of  # noqa: E402
from madp.training.preparation import tf_keras  # noqa: E402
from madp.training.queries import clip_and_sum  # noqa: E402
from madp.training.trainer import tf, train  # noqa: E402

pytestmark = [pytest.mark.tf]
LABELS = ("business", "science", "sports", "travel")


def reference_clipped_sum(model, loss_fn, x, y, weight, clip: float) -> list[np.ndarray]:
    """One tape per example, each gradient clipped by its global norm, then summed: no shared code
    with the vectorized or ghost paths."""
    total = None
    for i in range(len(weight)):
        with tf.GradientTape() as tape:
            row = tf.nest.map_structure(lambda a, i=i: a[i : i + 1], x)
            loss = loss_fn(y[i : i + 1], model(row))[0] * weight[i]
        gradient = [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]
        norm = math.sqrt(sum(float(tf.reduce_sum(g * g)) for g in gradient))
        scaled = [g.numpy() * min(1.0, clip / max(norm, 1e-30)) for g in gradient]
        total = scaled if total is None else [a + b for a, b in zip(total, scaled)]
    return total


def test_embedding_bag_ghost_clipping_equals_a_per_example_reference():
    rng = np.random.default_rng(0)
    # Few words and buckets: repeated n-grams in a row and hash collisions, both counted by the norm.
    texts = [" ".join(f"w{rng.integers(12)}" for _ in range(rng.integers(1, 20))).encode() for _ in range(12)]
    x = text.hashed_ngrams(texts, 32, 24, 2, prefix=0)
    assert any(len(set(row[row > 0])) < (row > 0).sum() for row in x)
    y = rng.integers(0, 3, 12).astype(np.int32)
    weight = np.where(np.arange(12) == 5, 0.0, rng.random(12)).astype(np.float32)  # one padding row
    for classes in (3, 40):  # fewer and more units than the bag's width: both scatter forms
        tf_keras.utils.set_random_seed(1)
        model, loss = text.text_classifier(32, 8, 24, classes)
        for clip in (1e-3, 0.05, 100.0):
            ghost = ghost_clipped_sum(model, loss, tf.constant(x), tf.constant(y), tf.constant(weight), clip)
            reference = reference_clipped_sum(model, loss, x, y, weight, clip)
            for a, b in zip(ghost, reference):
                np.testing.assert_allclose(np.asarray(a), b, rtol=2e-4, atol=1e-7)


def test_the_classifier_beside_a_pretrained_feature_is_ghost_clipped_as_the_per_example_reference():
    rng = np.random.default_rng(5)
    texts = [" ".join(f"w{rng.integers(12)}" for _ in range(rng.integers(1, 20))).encode() for _ in range(10)]
    features = rng.normal(size=(10, 6)).astype(np.float32)
    features /= np.linalg.norm(features, axis=1, keepdims=True)
    x = {text.NGRAMS: text.hashed_ngrams(texts, 32, 24, 2, prefix=0), text.PRETRAINED: features}
    y = rng.integers(0, 3, 10).astype(np.int32)
    weight = np.where(np.arange(10) == 2, 0.0, rng.random(10)).astype(np.float32)
    tf_keras.utils.set_random_seed(6)
    model, loss = text.text_classifier(32, 8, 24, 3, pretrained_width=6)
    assert len(model.trainable_variables) == 3  # the bag, the softmax layer's kernel and bias: the feature is frozen
    assert not unsupported_layers(model, on_tpu=False)
    for clip in (1e-3, 0.05, 100.0):
        ghost = ghost_clipped_sum(
            model, loss, tf.nest.map_structure(tf.constant, x), tf.constant(y), tf.constant(weight), clip
        )
        for a, b in zip(ghost, reference_clipped_sum(model, loss, x, y, weight, clip)):
            np.testing.assert_allclose(np.asarray(a), b, rtol=2e-4, atol=1e-7)


def test_language_model_clipping_equals_a_per_example_reference():
    rng = np.random.default_rng(1)
    texts = ["héllo wörld"[: rng.integers(1, 12)].encode() for _ in range(6)]
    x, y = text.byte_sequences(texts, 10)
    weight = np.array([1, 1, 0, 1, 1, 1], np.float32)
    tf_keras.utils.set_random_seed(2)
    model, loss = text.byte_lm(10, 8, 1, 2)
    for clip in (1e-3, 100.0):
        vectorized = clip_and_sum(
            clip, per_example_gradients(model, loss, tf.constant(x), tf.constant(y), tf.constant(weight))
        )
        reference = reference_clipped_sum(model, loss, x, y, weight, clip)
        for a, b in zip(vectorized, reference):
            np.testing.assert_allclose(np.asarray(a), b, rtol=2e-4, atol=2e-7)


def test_text_models_under_mixed_precision_clip_as_the_per_example_reference():
    """--mixed-precision: the classifier (its dense stack in float32) and the byte LM (LayerNorm,
    attention and Dense layers in bfloat16) clip to the per-example reference of the same model, to
    bfloat16's precision, and the clipped sums are float32."""
    from madp.training.steps import compute_precision, float32_outputs

    rng = np.random.default_rng(3)
    texts = [" ".join(f"w{rng.integers(12)}" for _ in range(rng.integers(1, 20))).encode() for _ in range(8)]
    weight = np.array([1, 1, 0, 0.5, 1, 1, 2, 1], np.float32)
    tf_keras.utils.set_random_seed(4)
    with compute_precision(True):
        classifier, classifier_loss = text.text_classifier(32, 8, 24, 3)
        lm, lm_loss = text.byte_lm(10, 8, 1, 2)
    assert lm.layers[-1].compute_dtype == "bfloat16" == classifier.layers[0].compute_dtype
    cases = [
        (
            classifier,
            classifier_loss,
            text.hashed_ngrams(texts, 32, 24, 2, prefix=0),
            rng.integers(0, 3, 8).astype(np.int32),
        ),
        (lm, lm_loss, *text.byte_sequences(texts, 10)),
    ]
    for model, loss, x, y in cases:
        loss = float32_outputs(loss)
        reference = reference_clipped_sum(model, loss, x, y, weight, 0.05)
        ghost = ghost_clipped_sum(model, loss, tf.constant(x), tf.constant(y), tf.constant(weight), 0.05)
        # bfloat16 keeps 8 bits: the two computations round differently, by up to ~2^-8 of the terms
        # summed, so a variable whose gradient nearly cancels is compared at the scale of the whole sum
        scale = max(np.abs(b).max() for b in reference)
        for a, b in zip(ghost, reference, strict=True):
            assert a.dtype == tf.float32
            np.testing.assert_allclose(np.asarray(a), b, rtol=3e-2, atol=3e-3 * scale)
        # each row's clipped gradient formed from that row alone: the sum of the rows' taken one by one
        alone = [ghost_clipped_sum(model, loss, tf.constant(x), tf.constant(y), tf.constant(np.where(
            np.arange(8) == j, weight, 0).astype(np.float32)), 0.05) for j in range(8)]  # fmt: skip
        for a, *rows in zip(ghost, *alone, strict=True):
            total = sum(np.asarray(r, np.float64) for r in rows)
            np.testing.assert_allclose(np.asarray(a), total, rtol=1e-5, atol=1e-6 * np.abs(total).max())


def test_ngram_hashing_is_stable_across_processes_and_ignores_case_and_punctuation():
    texts = [b"Hello, World!", "Grüße aus Köln".encode(), b"a b a b"]
    here = text.hashed_ngrams(texts, 1 << 20, 8, 2, prefix=0)
    script = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from madp.training import text; "
        "print(json.dumps(text.hashed_ngrams([b'Hello, World!', 'Grüße aus Köln'.encode(), b'a b a b'], "
        "1 << 20, 8, 2, prefix=0).tolist()))"
    )
    other = subprocess.run([sys.executable, "-c", script, ROOT], capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr[-2000:]
    np.testing.assert_array_equal(here, json.loads(other.stdout.strip().splitlines()[-1]))
    np.testing.assert_array_equal(here[0], text.hashed_ngrams([b"hello world"], 1 << 20, 8, 2, prefix=0)[0])
    assert (here[0] > 0).sum() == 3 and (here[1] > 0).sum() == 5  # 2 words + 1 bigram; 3 + 2
    assert here[2][0] == here[2][2] and here[2][4] == here[2][6]  # "a", "a"; "a b", "a b"
    words, trigrams = (text.hashed_ngrams(texts, 1 << 20, 8, order, prefix=0) for order in (1, 3))
    for row, count in enumerate((2, 3, 4)):  # the words alone, then padding
        assert words[row].tolist() == here[row].tolist()[:count] + [0] * (8 - count)
    assert (trigrams[1] > 0).sum() == 6  # + "grüße aus köln"
    assert trigrams[2].tolist()[:7] == here[2].tolist()[:7] and trigrams[2][7] > 0  # + "a b a", cut at 8
    # FarmHash Fingerprint64 is fixed: a changed tokenizer or hash would silently change every model
    assert here[0][:3].tolist() == [int(v) for v in PINNED_HELLO_WORLD]
    # a prefix of 4 characters (of letters, not bytes: "grüß"): "hello world" and "hell worl" hash alike
    cut = text.hashed_ngrams([b"Hello, World!", b"hell worl", "Grüße Grüß".encode()], 1 << 20, 8, 2, prefix=4)
    assert cut[0].tolist() == cut[1].tolist() == text.hashed_ngrams([b"hell worl"], 1 << 20, 8, 2, prefix=0)[0].tolist()
    assert cut[2][0] == cut[2][1] and cut[0][0] != here[0][0]


PINNED_HELLO_WORLD = (469997, 66749, 243862)  # "hello", "world", "hello world" into 2^20 buckets


def test_megabytes_of_extra_text_cost_the_ngram_hashing_no_more_work(monkeypatch):
    """TensorFlow's string ops get at most max_tokens x GRAM_BYTES bytes of a text (cut between
    characters), whatever follows: a text with megabytes of extra words, or one endless word, costs what
    one of max_tokens words does, and gives the n-grams of its first words."""
    read: list[int] = []
    lower = tf.strings.lower

    def reading(texts, *args, **kwargs):
        read.append(max(len(t) for t in texts.numpy()))
        return lower(texts, *args, **kwargs)

    monkeypatch.setattr(tf.strings, "lower", reading)
    words = " ".join(f"Wörd{i}" for i in range(40)).encode()  # 40 words: the 16 n-grams are its first 16
    for rest in (b" and more words", b"x", "ü".encode(), b"!"):
        for size in (1_000_000, 4_000_000):
            read.clear()
            longer = text.hashed_ngrams([words, words + rest * (size // len(rest))], 1 << 20, 16, 2, prefix=0)
            assert longer[1].tolist() == longer[0].tolist(), rest
            assert read[0] < size // 100, (rest, read)  # the text's prefix, not its megabytes
            assert read[0] <= 16 * text.GRAM_BYTES
    with pytest.raises(UnicodeEncodeError):  # a str is read as its UTF-8, as before (a lone surrogate is none)
        text.hashed_ngrams(["\ud800"], 16, 4, 1, prefix=0)
    assert text.utf8_prefix("Grüße".encode(), 3) == b"Gr" and text.utf8_prefix("Grüße", 4) == "Grü".encode()


def test_classification_and_byte_metrics():
    labels = np.array([0, 0, 1, 1, 2, 2])
    predicted = np.array([0, 1, 1, 1, 0, 2])
    metrics = text.classification_metrics(labels, predicted, ["a", "b", "c", "d"])
    # F1: a 2*1/(2+1+1) = 0.5, b 2*2/(4+1) = 0.8, c 2*1/(2+0+1) = 2/3; d never present nor predicted
    assert metrics["accuracy"] == round(4 / 6, 6)
    assert metrics["macro_f1"] == round((0.5 + 0.8 + 2 / 3) / 3, 6)
    assert metrics["per_class"]["b"] == {"precision": round(2 / 3, 6), "recall": 1.0, "f1": 0.8, "support": 2}
    assert metrics["per_class"]["d"]["f1"] is None
    assert text.byte_metrics(math.log(2) * 10, 10) == {
        "loss": round(math.log(2), 6),
        "bits_per_byte": 1.0,
        "perplexity": 2.0,
    }


def test_text_problems_name_non_utf8_and_empty_texts():
    problems = text.text_problems(np.array([b"fine", b"\xff\xfe", b"  ...  ", "ok é".encode(), b""], dtype=object))
    assert problems.tolist() == ["", text.NOT_UTF8, text.EMPTY_TEXT, "", text.EMPTY_TEXT]


def test_generated_text_has_topics_and_words_only_its_users_write(tmp_path):
    spec = GraphSpec(records=600, task="text", seed=3)
    data = generate(spec)
    again = generate(spec)
    assert data.texts == again.texts and set(data.labels) == set(LABELS)
    names, phrases = personal_words(np.unique(data.users), 3)
    assert len(set(phrases)) > 0.99 * len(phrases)  # personal: (almost) no two users share a catchphrase
    user = int(np.bincount(data.users).argmax())
    phrase = personal_words(np.array([user]), 3)[1][0]
    mine = {i for i in range(len(data.texts)) if user in data.users[data.offsets[i] : data.offsets[i + 1]]}
    assert {i for i, t in enumerate(data.texts) if phrase in t} == mine
    summary = write_dataset(data, spec, str(tmp_path / "records.parquet"), 1)
    assert sum(summary["labels"].values()) == 600
    assert pq.read_table(tmp_path / "records.parquet").column_names == ["id", "users", "text", "label"]


# --- through the pipeline -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_batches(tmp_path_factory):
    """Generated documents (some with non-ASCII text) bounded, batched; and held-out records."""
    directory = tmp_path_factory.mktemp("text")
    spec = GraphSpec(records=3000, task="text", seed=5)
    table = to_table(generate(spec))
    texts = table.column("text").to_pylist()
    texts = [("Grüße from Köln: 漢字 and emoji 🚀 " if i % 7 == 1 else "") + t for i, t in enumerate(texts)]
    table = table.set_column(2, "text", pa.array(texts))
    held_out = np.arange(len(table)) % 10 == 0
    data, evaluation = str(directory / "records.parquet"), str(directory / "test.parquet")
    pq.write_table(table.filter(pa.array(~held_out)), data)
    pq.write_table(table.filter(pa.array(held_out)), evaluation)
    bound_local(data, str(directory / "bounded"), BoundOptions(max_contributions=4))
    batches = str(directory / "batches")
    batch_local(str(directory / "bounded"), data, batches, BatchOptions(seed=0, steps=80, batch_size=256))
    options = BatchOptions(seed=0, steps=120, batch_size=128, min_sep=2)  # BandMF with 2 bands
    batch_local(str(directory / "bounded"), data, str(directory / "minsep"), options)
    return directory, data, evaluation, batches


@pytest.mark.beam
def test_text_columns_round_trip_through_batch_files(text_batches):
    directory, data, _, batches = text_batches
    written = open_batches(batches)
    assert written.schema.features["text"] == Feature("text", "bytes", ())
    source = pq.read_table(data).to_pydict()
    by_id = {i: (t, label) for i, t, label in zip(source["id"], source["text"], source["label"])}
    seen = set()
    for _, rows in step_batches(written, ["text", "label", "id"]):
        for record, body, label, weight in zip(rows["id"], rows["text"], rows["label"], rows["weight"]):
            if weight > 0:
                assert (body.decode("utf-8"), label.decode("utf-8")) == by_id[int(record)]
                seen.add(int(record))
    assert len(seen) > 1000 and sum("漢字" in by_id[i][0] for i in seen) > 100
    from madp.beam.batch import run_beam

    beam = str(directory / "beam-batches")
    options = BatchOptions(seed=0, steps=80, batch_size=256)
    run_beam(
        str(directory / "bounded"),
        data,
        beam,
        options,
        ["--runner", "DirectRunner", "--direct_running_mode", "in_memory"],
    )
    for name in os.listdir(batches):
        if name.endswith(".tfrecord"):
            assert open(os.path.join(beam, name), "rb").read() == open(os.path.join(batches, name), "rb").read()


@pytest.mark.slow
@pytest.mark.parametrize("bands", [1, 2])
def test_text_classifier_learns_with_dpsgd_and_bandmf(text_batches, bands):
    directory, _, evaluation, batches = text_batches
    options = TrainOptions(
        model="text-classifier",
        labels=LABELS,
        noise_multiplier=0.5,
        bands=bands,
        mechanism="dpsgd" if bands == 1 else "bandmf",
        buckets=4096,  # the default optimizer and learning rate
        eval_data=evaluation,
        eval_every=20,
        noise_seed=1,
    )
    batches = batches if bands == 1 else str(directory / "minsep")
    result = train(batches, str(directory / f"classifier-{bands}"), options)
    evaluated = evaluation_of(str(directory / f"classifier-{bands}"), internal=True)["eval"]
    first, last = evaluated[0], evaluated[-1]
    assert result.privacy["mechanism"] == ("dpsgd" if bands == 1 else "bandmf")
    assert last["loss"] < first["loss"] and last["accuracy"] > 0.5 and last["macro_f1"] > 0.5  # chance: 0.25
    assert set(last["per_class"]) == set(LABELS) and result.metrics.settings["labels"] == list(LABELS)


@pytest.mark.slow
@pytest.mark.parametrize("bands", [1, 2])
def test_byte_language_model_learns_with_dpsgd_and_bandmf(text_batches, bands):
    directory, _, evaluation, batches = text_batches
    options = TrainOptions(
        model="text-lm",
        noise_multiplier=0.5,
        bands=bands,
        mechanism="dpsgd" if bands == 1 else "bandmf",
        optimizer="adam",
        learning_rate=0.01,
        max_length=32,
        width=16,
        layers=1,
        heads=2,
        eval_data=evaluation,
        eval_every=40,
        noise_seed=1,
    )
    batches = batches if bands == 1 else str(directory / "minsep")
    train(batches, str(directory / f"lm-{bands}"), options)
    untrained = math.log(text.BYTE_VOCABULARY) / math.log(2)  # uniform over the vocabulary: 8.01 bits
    last = evaluation_of(str(directory / f"lm-{bands}"), internal=True)["eval"][-1]
    assert last["bits_per_byte"] < untrained - 2 and last["perplexity"] == pytest.approx(
        2 ** last["bits_per_byte"], rel=1e-3
    )


def test_labels_read_from_the_data_are_a_warned_disclosure(text_batches, caplog):
    directory, _, _, batches = text_batches
    options = TrainOptions(model="text-classifier", mechanism="none", buckets=256, learning_rate=0.1)
    result = train(batches, str(directory / "labels-from-data"), options)
    assert result.metrics.settings["labels"] == sorted(LABELS)
    assert "label set was taken from the data" in caplog.text
    amplified = dataclasses.replace(options, mechanism="auto", noise_multiplier=1.0)  # DP-SGD on Poisson batches
    with pytest.raises(InputError, match="would reveal which records were sampled: give the public label set"):
        train(batches, str(directory / "labels-from-sampled-rows"), amplified)
    unamplified = dataclasses.replace(amplified, bands=2)  # BandMF without amplification: the schedule is public
    privacy = train(str(directory / "minsep"), str(directory / "labels-from-data-private"), unamplified).privacy
    assert any(str(sorted(LABELS)) in a and "treated as public" in a for a in privacy["assumptions"]), (
        "a label set read from the data is part of what the guarantee assumes"
    )


# --- bad text input -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_text(tmp_path_factory):
    """Records whose text is bytes: one not UTF-8, one without words, one with an unknown label,
    and one null text."""
    directory = tmp_path_factory.mktemp("bad-text")
    rows = [
        {"id": i, "users": [i], "text": f"note number {i}".encode(), "label": "a" if i % 2 else "b"} for i in range(40)
    ]
    rows[3]["text"] = b"caf\xe9 latin-1"
    rows[4]["text"] = b" -- "
    rows[5]["label"] = "c"
    rows[6]["text"] = None
    data = str(directory / "records.parquet")
    pq.write_table(pa.Table.from_pylist(rows), data)
    bound_local(data, str(directory / "bounded"), BoundOptions(max_contributions=1))
    options = BatchOptions(seed=0, steps=4, batch_size=20, on_invalid="skip")
    report = batch_local(str(directory / "bounded"), data, str(directory / "batches"), options)
    return directory, data, report


def test_null_text_is_a_batch_error_or_skipped_and_written_out(bad_text):
    directory, data, report = bad_text
    with pytest.raises(InputError, match="'text' is null for selected record 6.*--on-invalid skip"):
        batch_local(
            str(directory / "bounded"), data, str(directory / "refused"), BatchOptions(seed=0, steps=4, batch_size=20)
        )
    assert report.rejected == {"null_content": 1}
    rejected = [json.loads(line) for line in open(directory / "batches" / "rejected" / "rejected.jsonl")]
    assert [(r["record"]["id"], r["record"]["column"], r["reason"]) for r in rejected] == [(6, "text", "null_content")]


def test_a_long_record_costs_each_training_step_what_max_length_keeps(tmp_path, monkeypatch):
    """A record of megabytes that most steps sample: its text is judged (UTF-8, a letter or a digit
    anywhere: all of it is read) once for the whole training, and each step's n-grams read at most
    --max-length x GRAM_BYTES bytes of it."""
    rows = [{"id": i, "users": [i], "text": f"note {i} on travel", "label": "ab"[i % 2]} for i in range(30)]
    rows[7]["text"] = "a long note " * 200_000  # 2.4 MB
    data = str(tmp_path / "records.parquet")
    pq.write_table(pa.Table.from_pylist(rows), data)
    bound_local(data, str(tmp_path / "bounded"), BoundOptions(max_contributions=1))
    batches = str(tmp_path / "batches")
    batch_local(str(tmp_path / "bounded"), data, batches, BatchOptions(seed=0, steps=6, batch_size=25))
    texts = {}
    for _, step in step_batches(open_batches(batches), ["id", "text"]):
        texts.update(zip(step["id"].tolist(), step["text"].tolist()))
    sampled = sum(7 in step["id"].tolist() for _, step in step_batches(open_batches(batches), ["id"]))
    assert sampled >= 3, "the long record is in several steps"
    judged, read = [], []
    problems, lower = text.text_problems, tf.strings.lower
    monkeypatch.setattr(text, "text_problems", lambda values: judged.append(sum(map(len, values))) or problems(values))
    monkeypatch.setattr(
        tf.strings, "lower", lambda values, **kw: read.append(max(map(len, values.numpy()))) or lower(values, **kw)
    )
    options = TrainOptions(model="text-classifier", labels=("a", "b"), mechanism="none", buckets=64, max_length=8)
    train(batches, str(tmp_path / "out"), options)
    assert sum(judged) == sum(map(len, texts.values())), "each record's text judged once"
    assert len(read) == 6 and max(read) < 100_000, "each step's n-grams read the long text's prefix"
    assert max(read) <= 8 * text.GRAM_BYTES


def test_unusable_text_stops_training_or_trains_with_weight_zero(bad_text, caplog):
    directory, _, _ = bad_text
    batches = str(directory / "batches")
    options = dict(model="text-classifier", labels=("a", "b"), mechanism="none", buckets=64, max_length=8)
    with pytest.raises(InputError) as refused:
        train(batches, str(directory / "refused-train"), TrainOptions(**options))
    message = str(refused.value)
    for record, reason in ((3, text.NOT_UTF8), (4, text.EMPTY_TEXT), (5, text.UNKNOWN_LABEL)):
        assert f"record {record} " in message and reason in message
    assert "pass on_invalid skip" in message
    out = directory / "skipped-train"
    train(batches, str(out), TrainOptions(on_invalid="skip", **options))
    counts = json.load(open(out / "rejected" / "counts.json"))
    assert counts["records"] == {text.EMPTY_TEXT: 1, text.UNKNOWN_LABEL: 1, text.NOT_UTF8: 1}
    metrics = json.load(open(out / "metrics.json"))
    assert "skipped" not in metrics, "which records were skipped is internal"
    optimizer = ("adam", 0.01, 1e-7, 3e-4)
    assert (metrics["optimizer"], metrics["learning_rate"], metrics["adam_epsilon"], metrics["l2"]) == optimizer
    assert metrics["text_features"] == {"ngrams": 1, "buckets": 64, "max_length": 8, "word_prefix": 6}
    rejected = [json.loads(line) for line in open(out / "rejected" / "rejected.jsonl")]
    assert sorted((r["id"], r["reason"]) for r in rejected) == [
        (3, text.NOT_UTF8),
        (4, text.EMPTY_TEXT),
        (5, text.UNKNOWN_LABEL),
    ]
    assert all(r["rows"] >= 1 for r in rejected)


# --- real inputs and jobs -----------------------------------------------------------------------


def test_imported_mail_trains_a_language_model_on_its_bodies(tmp_path, capsys):
    import mailbox

    from test_mbox import message

    from madp.cli import main

    box = mailbox.mbox(str(tmp_path / "mail.mbox"))
    # 60 people, each in two messages: k = 2 keeps every message, and DP-SGD's mixture of k + 1 Gaussians is
    # accounted in seconds (at k = 10 its one PLD took most of this test)
    people = [f"{name}{j}@example.com" for j in range(15) for name in ("ann", "ben", "cyd", "dee")]
    for i in range(60):
        body = f"Hallo {people[(i + 1) % 60].split('@')[0]}, Grüße zum Treffen Nummer {i}."
        box.add(message(people[i], people[(i + 1) % 60], body=body, message_id=f"<m{i}@example.com>"))
    box.flush()
    mail, bounded, batches, out = (str(tmp_path / name) for name in ("mail", "bounded", "batches", "lm"))
    assert main(["-q", "import-mbox", str(tmp_path / "mail.mbox"), mail]) == 0
    assert main(["-q", "bound", f"{mail}/records", bounded, "-k", "2", "--runner", "local"]) == 0
    assert (
        main(
            [
                "-q",
                "batch",
                bounded,
                f"{mail}/records",
                batches,
                "--steps",
                "8",
                "--batch-size",
                "8",
                "--runner",
                "local",
            ]
        )
        == 0
    )
    capsys.readouterr()
    lm = ["--model", "text-lm", "--text-column", "body", "--max-length", "24", "--width", "8", "--heads", "2"]
    assert main(["-q", "train", batches, out, "--noise-multiplier", "1.0", *lm, "--eval-data", f"{mail}/records"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["privacy"]["mechanism"] == "dpsgd" and "final" not in result  # its eval data is not public
    assert 0 < evaluation_of(out, internal=True)["final"]["bits_per_byte"] < 9


@pytest.mark.parametrize("name", ["text-classifier", "text-lm"])
def test_example_text_jobs_are_valid_configs(name, tmp_path):
    import yaml

    from madp.jobs.run_config import RunConfig
    from madp.jobs.run_plan import stages_of

    config = yaml.safe_load(open(os.path.join(ROOT, "examples", f"{name}.yaml")))
    config["run_dir"] = str(tmp_path)
    stages = {stage.name: stage.command for stage in stages_of(RunConfig.from_json(config))}
    assert {"generate", "bound", "batch", "calibrate", "train", "baseline", "report"} <= set(stages)
    assert stages["generate"][stages["generate"].index("--task") + 1] == "text"
    assert stages["train"][stages["train"].index("--model") + 1] == name
    if name == "text-classifier":  # a pretrained model replaced in place re-runs the trainings that read it
        config["train"]["pretrained"] = str(tmp_path / "model.gguf")
        inputs = {stage.name: stage.inputs for stage in stages_of(RunConfig.from_json(config))}
        assert str(tmp_path / "model.gguf") in inputs["train"] and str(tmp_path / "model.gguf") in inputs["baseline"]


def test_string_and_integer_labels_map_to_the_given_label_set():
    from madp.training.tasks import TextClassifierTask

    schema = {"text": Feature("text", "bytes", ()), "label": Feature("label", "int64", ())}
    task = TextClassifierTask(TrainOptions(model="text-classifier", mechanism="none"), schema, ["0", "1", "7"])
    assert task.label_indices(np.array([7, 0, 3, 1])).tolist() == [2, 0, -1, 1]
    named = TextClassifierTask(TrainOptions(model="text-classifier", mechanism="none"), schema, ["spam", "ham"])
    assert named.label_indices(np.array([b"ham", b"spam", b"eggs"], dtype=object)).tolist() == [1, 0, -1]
    rows = {"text": np.array([b"buy now", b"hello"], dtype=object), "label": np.array([b"spam", b"eggs"], dtype=object)}
    assert named.problems(rows).tolist() == ["", text.UNKNOWN_LABEL]
    with pytest.raises(InputError, match="text_column 'body' must name a text feature") as refused:
        TextClassifierTask(TrainOptions(model="text-classifier", mechanism="none", text_column="body"), schema, ["a"])
    assert error_text(refused.value).startswith("--text-column 'body' must name")  # as the command line says it


def test_text_models_default_to_the_optimizer_they_learn_with():
    """The text models default to Adam (on CPython's changelog, benchmarks/text_defaults.py, Adam at
    0.01 came within a point of a linear model, SGD at 0.5 2.4 points below) at Keras' epsilon, the
    classifier without a pretrained feature with an L2 penalty of 3e-4 and, without privacy only, a
    cosine decay of its rate; numeric models keep SGD, no penalty and a constant rate; given flags
    always win, --adam-epsilon in the optimizer built."""
    from madp.training.options import training_defaults
    from madp.training.tasks import default_optimizer

    def defaults(mechanism="none", **given):
        privacy = {} if mechanism == "none" else {"noise_multiplier": 1.0}
        return tuple(training_defaults(TrainOptions(mechanism=mechanism, **privacy, **given)))

    assert defaults(model="text-classifier") == ("adam", 0.01, 1e-7, 3e-4, "cosine")
    assert defaults("auto", model="text-classifier") == ("adam", 0.01, 1e-7, 3e-4, "constant")
    assert defaults("auto", model="text-classifier", lr_schedule="cosine")[4] == "cosine"
    assert defaults(model="text-classifier", lr_schedule="constant")[4] == "constant"
    assert defaults(model="text-classifier", l2=0.0) == ("adam", 0.01, 1e-7, 0.0, "cosine")
    assert defaults(model="text-lm") == ("adam", 0.003, 1e-7, 0.0, "constant")
    assert defaults(model="text-classifier", pretrained="model.gguf") == ("adam", 0.03, 1e-7, 0.0, "constant")
    assert defaults(model="mlp") == ("sgd", 0.5, None, 0.0, "constant")
    assert defaults(model="mlp", optimizer="adam", l2=1e-3) == ("adam", 0.01, 1e-7, 1e-3, "constant")
    assert defaults(model="text-classifier", optimizer="sgd", learning_rate=2.0) == ("sgd", 2.0, None, 3e-4, "cosine")
    given = TrainOptions(model="text-classifier", mechanism="none", adam_epsilon=3e-3)
    assert tuple(training_defaults(given)) == ("adam", 0.01, 3e-3, 3e-4, "cosine")
    built = default_optimizer(text.text_classifier(64, 4, 8, 2)[0], given)
    assert float(built.epsilon) == pytest.approx(3e-3) and float(built.learning_rate) == pytest.approx(0.01)
    words = TrainOptions(model="text-classifier", mechanism="none")
    assert (words.ngram_order, dataclasses.replace(words, pretrained="model.gguf").ngram_order) == (1, 2)
    assert dataclasses.replace(words, ngrams=3, pretrained="model.gguf").ngram_order == 3
    for wrong in (0, 129):  # above --max-length (128): never kept, only slow to hash
        with pytest.raises(InputError, match=r"^ngrams must be between 1 \(words\) and max_length \(128\)"):
            dataclasses.replace(words, ngrams=wrong)
    beside = dataclasses.replace(words, pretrained="model.gguf")
    assert (words.word_prefix_length, beside.word_prefix_length) == (6, 0)  # 6 characters; whole beside it
    assert dataclasses.replace(words, word_prefix=0).word_prefix_length == 0
    assert dataclasses.replace(beside, word_prefix=5).word_prefix_length == 5
    with pytest.raises(InputError, match="^word_prefix must be at least 0"):
        dataclasses.replace(words, word_prefix=-1)
    refused = ({"adam_epsilon": 0.0}, "must be positive"), ({"optimizer": "sgd"}, "uses SGD: drop it")
    refused += (({"model": "mlp"}, "uses SGD: drop it"),)  # SGD by default: the flag would be ignored
    for wrong, message in refused:
        with pytest.raises(InputError, match=message):
            TrainOptions(**{"model": "text-classifier", "mechanism": "none", "adam_epsilon": 1e-3, **wrong})


def test_the_embedding_bag_weighs_a_texts_ngrams_by_its_l2_normalized_presence():
    """sqrt (the default): E's rows against the row's presence vector divided by its L2 norm, as the
    linear model of benchmarks/text_defaults.py sees the n-grams; mean: divided by their number. A
    model saved before the option (its config without it) loads with the mean it was trained with."""
    ids = np.array([[3, 5, 0, 0], [1, 2, 3, 4]], np.int32)
    for normalization, scale in (("sqrt", np.sqrt), ("mean", lambda n: n)):
        bag = text.EmbeddingBag(6, 2, normalization)
        bagged = bag(ids).numpy()
        table = bag.embeddings.numpy()
        expected = [table[[3, 5]].sum(0) / scale(2), table[[1, 2, 3, 4]].sum(0) / scale(4)]
        np.testing.assert_allclose(bagged, expected, rtol=1e-6)
    config = text.EmbeddingBag(6, 2).get_config()
    assert config["normalization"] == "sqrt"
    del config["normalization"]
    assert text.EmbeddingBag.from_config(config).normalization == "mean"


def test_the_classifiers_softmax_layer_outputs_densely_and_its_gradient_counts_its_scale(tmp_path):
    """ScaledGradientDense: Dense's output and s times Dense's gradients (one tape per example, no
    madp clipping code), in the text classifier at CLASSIFIER_HEAD_GRADIENT_SCALE and kept through
    a save and load; the clipped sums of both fast paths against that reference are
    `test_embedding_bag_ghost_clipping_equals_a_per_example_reference` and
    test_clipping_layers' `test_a_scaled_gradient_dense_layer_in_a_functional_model`."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(4, 5)).astype(np.float32)
    y = np.array([0, 2, 1, 2], np.int32)
    scaled = text.ScaledGradientDense(3, gradient_scale=0.25, activation="tanh")
    plain = tf_keras.layers.Dense(3, activation="tanh")
    scaled.build((None, 5)), plain.build((None, 5))
    plain.set_weights(scaled.get_weights())
    np.testing.assert_array_equal(scaled(x).numpy(), plain(x).numpy())
    for i in range(4):
        gradients = []
        for layer in (scaled, plain):
            with tf.GradientTape() as tape:
                loss = text.softmax_loss(y[i : i + 1], layer(x[i : i + 1]))[0]
            gradients.append(tape.gradient(loss, layer.trainable_variables))
        for s, p in zip(*gradients, strict=True):
            np.testing.assert_allclose(s.numpy(), 0.25 * p.numpy(), rtol=1e-6)
    model, _ = text.text_classifier(32, 8, 24, 3)
    assert type(model.layers[-1]) is text.ScaledGradientDense
    assert model.layers[-1].gradient_scale == text.CLASSIFIER_HEAD_GRADIENT_SCALE
    assert _is_dense_stack(model)  # the classifier keeps its path of layers run one by one
    model.save(tmp_path / "model.keras")
    loaded = tf_keras.models.load_model(tmp_path / "model.keras", compile=False)
    assert loaded.layers[-1].gradient_scale == text.CLASSIFIER_HEAD_GRADIENT_SCALE
    ids = text.hashed_ngrams([b"one two three", b"four"], 32, 24, 1, prefix=0)
    np.testing.assert_array_equal(loaded(ids).numpy(), model(ids).numpy())
    with pytest.raises(AttributeError):  # read-only: the clipping takes it as checked here
        scaled.gradient_scale = 1e38
    for wrong in (0.0, -1.0, float("nan"), 1.5, float("inf")):
        with pytest.raises(ValueError, match=r"gradient_scale must be in \(0, 1\]"):
            text.ScaledGradientDense(3, gradient_scale=wrong)
