"""DP training: clipping against independent gradients, padding, noise scale and BandMF noise
covariance, BandMF with one band equal to DP-SGD bit for bit, and the privacy report against an
independent `madp epsilon` call."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from conftest import write_records  # noqa: E402

from madp.cli import main  # noqa: E402
from madp.core.errors import InputError  # noqa: E402
from madp.core.randomness import SecretKey  # noqa: E402
from madp.core.selection import BoundOptions  # noqa: E402
from madp.engines.batch_local import run_local as batch_local
from madp.engines.batching import BatchOptions  # noqa: E402
from madp.engines.local_engine import run_local as bound_local  # noqa: E402
from madp.tools.data.synthetic import GraphSpec, generate, to_table  # noqa: E402
from madp.training.options import TrainOptions  # noqa: E402
from madp.training.outputs import evaluation_of  # noqa: E402
from madp.training.preparation import tf_keras  # noqa: E402
from madp.training.queries import (  # noqa: E402
    BandMfQuery,
    DpSgdQuery,
    key_tensor,
    stateless_noise,
    variable_stream,
)
from madp.training.steps import PrivateStep  # noqa: E402
from madp.training.tasks import build_model  # noqa: E402
from madp.training.trainer import tf, train  # noqa: E402

pytestmark = [pytest.mark.tf]


def noise_key(seed: int) -> SecretKey:
    return SecretKey.from_seed(seed, "training noise")


def logreg(dim: int, seed: int = 1):
    tf_keras.utils.set_random_seed(seed)
    model, loss = build_model("logreg", dim)
    model.layers[0].kernel.assign(np.random.default_rng(seed).normal(size=(dim, 1)).astype(np.float32))
    return model, loss


def privatized(query, model, loss, x, y, weight, expected=1.0, fast=True):
    step = PrivateStep(model, loss, tf_keras.optimizers.SGD(0.0), query, expected, fast=fast)
    gradient = step.privatized_gradient(tf.constant(x), tf.constant(y), tf.constant(weight))
    return [g.numpy() for g in gradient]


def test_every_example_is_clipped_and_padding_changes_nothing():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype(np.float32) * 3
    y = (rng.random(40) < 0.5).astype(np.float32)
    model, loss = logreg(3)
    kernel, bias = (v.numpy() for v in model.trainable_variables)
    # Independent per-example gradients of the logistic loss: (sigmoid(w.x + b) - y) [x, 1].
    residual = 1 / (1 + np.exp(-(x @ kernel[:, 0] + bias[0]))) - y
    per_example = np.concatenate([residual[:, None] * x, residual[:, None]], axis=1)
    norms = np.linalg.norm(per_example, axis=1)
    clip = 0.5
    assert (norms > clip).any() and (norms < clip).any()
    expected = (per_example * np.minimum(1, clip / norms)[:, None]).sum(axis=0)
    query = DpSgdQuery(clip, 0.0, noise_key(3))
    for fast in (True, False):
        got = privatized(query, model, loss, x, y, np.ones(40, np.float32), fast=fast)
        np.testing.assert_allclose(np.concatenate([got[0][:, 0], got[1]]), expected, rtol=1e-5)
    padded = privatized(
        query,
        model,
        loss,
        np.concatenate([x, rng.normal(size=(9, 3)).astype(np.float32)]),
        np.concatenate([y, np.ones(9, np.float32)]),
        np.concatenate([np.ones(40), np.zeros(9)]).astype(np.float32),
    )
    for a, b in zip(got, padded):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_ghost_clipping_equals_per_example_clipping_on_an_mlp():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(64, 6)).astype(np.float32) * 2
    y = (rng.random(64) < 0.5).astype(np.float32)
    weight = (rng.random(64) < 0.8).astype(np.float32)
    tf_keras.utils.set_random_seed(4)
    model, loss = build_model("mlp", 6)
    query = DpSgdQuery(0.3, 0.0, noise_key(1))
    fast = privatized(query, model, loss, x, y, weight, fast=True)
    slow = privatized(query, model, loss, x, y, weight, fast=False)
    for a, b in zip(fast, slow):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_noise_scale_is_sigma_clip_over_expected_batch_size():
    model, loss = logreg(4000)
    x, y, weight = np.zeros((5, 4000), np.float32), np.zeros(5, np.float32), np.zeros(5, np.float32)
    got = privatized(DpSgdQuery(2.0, 1.5, noise_key(4)), model, loss, x, y, weight, expected=10.0)
    assert np.std(got[0]) == pytest.approx(1.5 * 2.0 / 10.0, rel=0.05)


def test_bandmf_noise_has_the_covariance_of_c_inverse():
    coefficients = (0.8, 0.5, 0.33)
    template = [tf.TensorSpec((200000,), tf.float32)]
    query = BandMfQuery(1.0, 1.0, noise_key(5), coefficients=coefficients, template=template)
    state = query.initial_global_state()
    noises = []
    for _ in range(8):
        result, state, _ = query.get_noised_result([tf.zeros(200000)], state)
        noises.append(result[0].numpy())
    w = np.stack(noises)  # steps x independent coordinates
    steps = len(w)
    c = np.zeros((steps, steps))
    for lag, band in enumerate(coefficients):
        c += band * np.eye(steps, k=-lag)
    c_inverse = np.linalg.inv(c)
    np.testing.assert_allclose(np.cov(w), c_inverse @ c_inverse.T, atol=0.05)
    # Exactly C w = z for the z of the stateless generator.
    z = np.stack(
        [stateless_noise([tf.zeros(200000)], 1.0, key_tensor(noise_key(5)), t)[0].numpy() for t in range(steps)]
    )
    np.testing.assert_allclose(c @ w, z, atol=1e-4)


def test_every_bit_of_the_noise_key_counts_and_each_step_and_variable_has_a_stream_of_its_own():
    """The noise of a (step, variable) depends on all 128 bits of the key, inside an XLA program too
    (TensorFlow's seeded ops keep 32 bits of each int64 seed word there), and each (step, variable)
    draws from a Philox stream of 128 derived bits (an int32 seed, which `stateless_fold_in` with an
    int index gives, repeats a variable's noise across T steps with probability about T^2 / 2^33)."""
    key = key_tensor(noise_key(3))
    words = key.numpy().view(np.uint64)

    def draw(k, t):
        return stateless_noise([tf.zeros(64), tf.zeros(8)], 1.0, k, t)

    for traced in (tf.function(draw), tf.function(draw, jit_compile=True)):

        def compiled(k, t, traced=traced):
            return [z.numpy() for z in traced(k, t)]

        base = compiled(key, tf.constant(5, tf.int64))
        for word in (0, 1):
            for bit in (0, 31, 32, 63):
                flipped = words.copy()
                flipped[word] ^= np.uint64(1) << np.uint64(bit)
                other = compiled(tf.constant(flipped.view(np.int64)), tf.constant(5, tf.int64))
                assert not np.allclose(other[0], base[0]) and not np.allclose(other[1], base[1]), (word, bit)
        later = compiled(key, tf.constant(6, tf.int64))
        assert not np.allclose(later[0], base[0]) and not np.allclose(base[1], base[0][:8])
    streams = [np.concatenate([k.numpy(), c.numpy()]) for t in range(20) for i in range(20) for k, c in
               [variable_stream(key, t, i)]]  # fmt: skip
    assert len({tuple(s) for s in streams}) == 400
    derived = np.array([[s[0], s[2]] for s in streams])  # the stream's key and counter word (64 bits each)
    assert (derived >= np.uint64(1 << 32)).mean() > 0.95


def test_bandmf_with_one_band_is_dpsgd_bit_for_bit():
    rng = np.random.default_rng(1)
    data = [(rng.normal(size=(30, 5)).astype(np.float32), (rng.random(30) < 0.5).astype(np.float32)) for _ in range(6)]
    weights = []
    for make_query in (
        lambda template: DpSgdQuery(1.0, 0.7, noise_key(9)),
        lambda template: BandMfQuery(1.0, 0.7, noise_key(9), coefficients=(1.0,), template=template),
    ):
        model, loss = logreg(5)
        template = [tf.TensorSpec(v.shape, v.dtype) for v in model.trainable_variables]
        step = PrivateStep(model, loss, tf_keras.optimizers.SGD(0.1), make_query(template), 30.0)
        for x, y in data:
            step(tf.constant(x), tf.constant(y), tf.ones(30))
        weights.append([v.numpy() for v in model.trainable_variables])
    for a, b in zip(*weights):
        assert np.array_equal(a, b)


def test_the_l2_penalty_adds_l2_times_the_weights_after_clipping_and_noise():
    """One SGD step at rate lr moves w by -lr (g + l2 w): g the clipped mean gradient (private, no
    noise) or the mean gradient (non-private), both derived here by hand from the logistic loss, and
    l2 w unclipped (a function of the weights alone). A negative or NaN penalty is refused by name."""
    from madp.training.steps import NonPrivateStep

    rng = np.random.default_rng(4)
    x = (rng.normal(size=(20, 3)) * 3).astype(np.float32)
    y = (rng.random(20) < 0.5).astype(np.float32)
    lr, l2, clip = 0.1, 0.05, 0.5
    for private in (True, False):
        model, loss = logreg(3)
        w = np.concatenate([v.numpy().reshape(-1) for v in model.trainable_variables])
        per_example = (1 / (1 + np.exp(-(x @ w[:3] + w[3]))) - y)[:, None] * np.c_[x, np.ones(20)]
        if private:
            norms = np.linalg.norm(per_example, axis=1)
            per_example *= np.minimum(1, clip / norms)[:, None]
            step = PrivateStep(
                model, loss, tf_keras.optimizers.SGD(lr), DpSgdQuery(clip, 0.0, noise_key(5)), 20.0, l2=l2
            )
        else:
            step = NonPrivateStep(model, loss, tf_keras.optimizers.SGD(lr), l2=l2)
        step(tf.constant(x), tf.constant(y), tf.ones(20))
        moved = np.concatenate([v.numpy().reshape(-1) for v in model.trainable_variables])
        np.testing.assert_allclose(moved, w - lr * (per_example.mean(axis=0) + l2 * w), rtol=1e-5, atol=1e-6)
    for wrong in (-0.1, float("nan")):
        with pytest.raises(InputError, match="the L2 penalty must be 0 or above and finite"):
            NonPrivateStep(model, loss, tf_keras.optimizers.SGD(lr), l2=wrong)


def test_a_keras_regularizer_the_steps_do_not_apply_is_named(caplog):
    """The steps train on the loss alone: a layer's regularizers (which Keras adds to model.losses)
    are named in a warning that points to l2, in tf_keras and in Keras 3, and a model without any
    gets no warning."""
    import keras

    from madp.training.steps import NonPrivateStep

    query = DpSgdQuery(1.0, 0.0, noise_key(1))
    regularized = tf_keras.Sequential(
        [tf_keras.Input((3,)), tf_keras.layers.Dense(2, kernel_regularizer="l2", activity_regularizer="l1", name="d")]
    )
    keras3 = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, bias_regularizer="l2", name="e")])
    for make, model, optimizer, named in (
        (
            lambda m, o: PrivateStep(m, None, o, query, 10.0),
            regularized,
            tf_keras.optimizers.SGD(0.1),
            "d.activity_regularizer, d.kernel_regularizer are not applied",
        ),
        (lambda m, o: NonPrivateStep(m, None, o), keras3, keras.optimizers.SGD(0.1), "e.bias_regularizer are not"),
    ):
        caplog.clear()
        make(model, optimizer)
        assert named in caplog.text and "--l2" in caplog.text
    caplog.clear()
    PrivateStep(logreg(3)[0], None, tf_keras.optimizers.SGD(0.1), query, 10.0)
    assert "regularizers" not in caplog.text


@pytest.fixture(scope="module")
def pipeline_data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("train")
    spec = GraphSpec(records=4000, graph="skewed", features=8, seed=2)
    rows = to_table(generate(spec)).to_pylist()
    data = write_records(str(directory / "records.jsonl"), rows)
    bound_local(data, str(directory / "bounded"), BoundOptions(max_contributions=2))
    return directory, data


def test_trains_on_poisson_batches_and_reports_the_guarantee(pipeline_data, capsys):
    directory, data = pipeline_data
    batches = str(directory / "poisson")
    batch_local(
        str(directory / "bounded"), data, batches, BatchOptions(seed=0, steps=60, batch_size=64, max_batch_size=130)
    )
    out = str(directory / "dpsgd")
    result = train(batches, out, TrainOptions(noise_multiplier=1.2, delta=1e-5, eval_data=data, eval_every=20))
    privacy = json.load(open(os.path.join(out, "privacy.json")))
    assert privacy["mechanism"] == "dpsgd" and privacy["contribution_bound"] == 2
    assert privacy["accounted_batches"]["steps"] == 60 and "sha256" not in json.dumps(privacy)  # no content digest
    assert (
        main(
            [
                "-q",
                "epsilon",
                "--mechanism",
                "dpsgd",
                "--noise-multiplier",
                "1.2",
                "--delta",
                "1e-5",
                "--steps",
                "60",
                "--sampling-prob",
                str(privacy["parameters"]["sampling_prob"]),
                "-k",
                "2",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["epsilon"] == pytest.approx(privacy["epsilon"], rel=1e-12)
    evaluated = evaluation_of(out, internal=True)  # its eval data was not declared public
    assert result.metrics.evaluations is None and result.metrics.evaluation.startswith(os.path.join(out, "internal"))
    assert [m["step"] for m in evaluated["eval"]] == [20, 40, 60] and evaluated["final"]["accuracy"] > 0.6
    assert os.path.exists(os.path.join(out, "model.keras")) and os.listdir(os.path.join(out, "logs"))


def _event_bytes(directory: str) -> bytes:
    return b"".join(open(os.path.join(directory, name), "rb").read() for name in os.listdir(directory))


def test_evaluations_are_published_only_on_eval_data_declared_public_and_not_the_trained_records(
    pipeline_data, tmp_path
):
    directory, data = pipeline_data
    batches = str(tmp_path / "batches")
    batch_local(str(directory / "bounded"), data, batches, BatchOptions(seed=0, steps=4, batch_size=32))
    options = TrainOptions(mechanism="none", eval_data=data, eval_every=2)
    out = str(tmp_path / "internal")
    result = train(batches, out, options)
    metrics = json.load(open(os.path.join(out, "metrics.json")))
    assert not {"eval", "final"} & set(metrics) and "--eval-data-public" in metrics["evaluation"]
    kept = json.load(open(os.path.join(out, "internal", "evaluation.json")))
    assert result.metrics.evaluations is None and [m["step"] for m in kept["eval"]] == [2, 4]
    assert b"eval/" not in _event_bytes(os.path.join(out, "logs"))
    assert b"eval/loss" in _event_bytes(os.path.join(out, "internal", "logs"))

    public = dataclasses.replace(options, eval_data_public=True)
    with pytest.raises(InputError, match="overlaps the records the batches were made from"):
        train(batches, str(tmp_path / "refused"), public)
    rows = [json.loads(line) for line in open(data)]
    copy = write_records(str(tmp_path / "copy.jsonl"), rows)  # the trained records under another name
    with pytest.raises(InputError, match=r"holds \d+ record\(s\) the bound selected"):
        train(batches, str(tmp_path / "refused"), dataclasses.replace(public, eval_data=copy))
    assert not os.path.exists(tmp_path / "refused"), "refused before anything is written"
    unseen = write_records(str(tmp_path / "unseen.jsonl"), [{**row, "id": row["id"] + 10**9} for row in rows])
    out = str(tmp_path / "public")
    result = train(batches, out, dataclasses.replace(public, eval_data=unseen))
    metrics = json.load(open(os.path.join(out, "metrics.json")))
    assert metrics["final"] == result.metrics.evaluations.final and "evaluation" not in metrics
    assert b"eval/loss" in _event_bytes(os.path.join(out, "logs"))
    assert not os.path.exists(os.path.join(out, "internal", "evaluation.json"))


def test_trains_bandmf_on_greedy_batches_with_the_greedys_k(pipeline_data, capsys):
    directory, data = pipeline_data
    batches = str(directory / "greedy")
    report = batch_local(
        str(directory / "bounded"),
        data,
        batches,
        BatchOptions(seed=0, steps=40, batch_size=50, sampler="minsep-greedy", min_sep=4),
    )
    out = str(directory / "bandmf")
    train(batches, out, TrainOptions(noise_multiplier=2.0, bands=4, eval_data=data))
    privacy = json.load(open(os.path.join(out, "privacy.json")))
    assert privacy["mechanism"] == "bandmf" and privacy["parameters"]["max_participations"] == report.k
    assert len(privacy["bands"]) == 4
    assert (
        main(
            [
                "-q",
                "epsilon",
                "--mechanism",
                "bandmf",
                "--noise-multiplier",
                "2.0",
                "--delta",
                "1e-5",
                "--steps",
                "40",
                "--bands",
                "4",
                "--min-sep",
                "4",
                "--max-participations",
                str(report.k),
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["epsilon"] == pytest.approx(privacy["epsilon"], rel=1e-12)


def test_bandmf_on_poisson_minsep_batches_counts_k_records_per_step(pipeline_data):
    directory, data = pipeline_data
    batches = str(directory / "minsep")
    batch_local(str(directory / "bounded"), data, batches, BatchOptions(seed=0, steps=30, batch_size=40, min_sep=3))
    privacy = train(batches, str(directory / "minsep-train"), TrainOptions(noise_multiplier=3.0, bands=3)).privacy
    assert privacy["parameters"]["records_per_step"] == 2 and privacy["parameters"]["max_participations"] == 10


def test_calibrated_sigma_meets_the_target(pipeline_data):
    """On a selection no private training used yet (this module's others would compose with it)."""
    directory, data = pipeline_data
    selection, batches = str(directory / "calibrated-bounded"), str(directory / "calibrated")
    shutil.copytree(str(directory / "bounded"), selection, ignore=shutil.ignore_patterns("trainings.jsonl"))
    batch_local(selection, data, batches, BatchOptions(seed=0, steps=10, batch_size=200, min_sep=2))
    privacy = train(batches, str(directory / "calibrated-train"), TrainOptions(epsilon=2.0, bands=2)).privacy
    assert "composition" not in privacy and privacy["epsilon"] <= 2.0 and privacy["epsilon"] > 1.99


def test_cli_train_refuses_bad_options(pipeline_data, capsys):
    directory, _ = pipeline_data
    assert main(["-q", "train", str(directory / "missing"), str(directory / "x"), "--epsilon", "1"]) == 2
    assert "not a `madp batch` output" in capsys.readouterr().err
    assert main(["-q", "train", str(directory / "poisson"), str(directory / "x")]) == 2
    assert "--epsilon" in capsys.readouterr().err
    fixed_sigma = ["-q", "train", str(directory / "poisson"), str(directory / "x"), "--noise-multiplier", "1.2"]
    assert (
        main([*fixed_sigma, "--max-contributions", "1"]) == 2
    )  # the plan's refusal, by its flag (Python: by its name)
    assert "--max-contributions 1 is below what the batches were made from" in capsys.readouterr().err
    # a plan and "no privacy" at once: which was meant is not for madp to guess
    plan = str(directory / "plan.json")
    args = ["-q", "train", str(directory / "poisson"), str(directory / "x"), "--calibration", plan]
    assert main([*args, "--mechanism", "none"]) == 2
    assert "--mechanism none trains without privacy, --calibration with the plan's" in capsys.readouterr().err


def test_user_level_clipping_clips_each_users_average_gradient():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(30, 3)).astype(np.float32) * 3
    y = (rng.random(30) < 0.5).astype(np.float32)
    weight = (rng.random(30) < 0.8).astype(np.float32)
    users = rng.integers(0, 7, 30)
    model, loss = logreg(3)
    kernel, bias = (v.numpy() for v in model.trainable_variables)
    residual = 1 / (1 + np.exp(-(x @ kernel[:, 0] + bias[0]))) - y
    per_example = np.concatenate([residual[:, None] * x, residual[:, None]], axis=1) * weight[:, None]
    clip, expected = 0.4, np.zeros(4)
    for user in np.unique(users):
        mine = users == user
        average = per_example[mine].sum(axis=0) / max(weight[mine].sum(), 1.0)
        expected += average * min(1.0, clip / max(np.linalg.norm(average), 1e-30))
    step = PrivateStep(
        model, loss, tf_keras.optimizers.SGD(0.0), DpSgdQuery(clip, 0.0, noise_key(0)), 1.0, user_level=True
    )
    got = step.privatized_gradient(tf.constant(x), tf.constant(y), tf.constant(weight), tf.constant(users))
    np.testing.assert_allclose(np.concatenate([got[0].numpy()[:, 0], got[1].numpy()]), expected, rtol=1e-5, atol=1e-7)


def test_user_sampled_batches_train_with_uls(tmp_path, capsys):
    rng = np.random.default_rng(6)
    rows = [
        {"id": i, "users": [int(i % 150)], "features": rng.normal(size=4).tolist(), "label": int(i % 2)}
        for i in range(900)
    ]
    data = write_records(str(tmp_path / "single.jsonl"), rows)
    bound_local(data, str(tmp_path / "bounded"), BoundOptions(max_contributions=4))
    report = batch_local(
        str(tmp_path / "bounded"),
        data,
        str(tmp_path / "batches"),
        BatchOptions(seed=0, steps=400, batch_size=15, sampler="users"),
    )
    assert report.sampling_probability == pytest.approx(0.1)
    assert abs(report.users_per_step.mean / 15 - 1) < 0.05
    # A sampled user brings all its (4) records.
    assert report.batch_sizes.mean == pytest.approx(4 * report.users_per_step.mean)
    privacy = train(str(tmp_path / "batches"), str(tmp_path / "uls"), TrainOptions(noise_multiplier=1.5)).privacy
    assert privacy["mechanism"] == "dpsgd-uls" and privacy["expected_batch_size"] == 15
    assert (
        main(
            [
                "-q",
                "epsilon",
                "--mechanism",
                "dpsgd-uls",
                "--noise-multiplier",
                "1.5",
                "--delta",
                "1e-5",
                "--steps",
                "400",
                "--user-sampling-prob",
                str(privacy["parameters"]["user_sampling_prob"]),
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["epsilon"] == pytest.approx(privacy["epsilon"], rel=1e-12)


def test_user_sampler_refuses_multi_user_records(pipeline_data):
    directory, data = pipeline_data
    with pytest.raises(Exception, match="single-attribution"):
        batch_local(
            str(directory / "bounded"),
            data,
            str(directory / "users"),
            BatchOptions(seed=0, steps=5, batch_size=5, sampler="users"),
        )


def test_shard_step_keeps_a_users_rows_on_one_replica_and_pads_with_zero_weight():
    from madp.training.steps import shard_step

    rng = np.random.default_rng(8)
    x, y = rng.normal(size=(23, 3)).astype(np.float32), rng.random(23).astype(np.float32)
    weight, users = np.ones(23, np.float32), rng.integers(100, 110, 23)
    shards = shard_step(x, y, weight, users, replicas=3, rows_per_replica=20)
    assert [len(s[0]) for s in shards] == [20, 20, 20]
    seen = []
    for sx, sy, sw, groups in shards:
        real = sw > 0
        assert not sx[~real].any() and not sy[~real].any()
        mine = [tuple(row) for row in sx[real]]
        owners = {int(users[[tuple(r) for r in x].index(row)]) for row in mine}
        seen.append(owners)
        # groups index the replica's users; padding rows are groups of their own
        assert len(set(groups[real])) == len(owners) and len(set(groups)) == len(owners) + int((~real).sum())
    assert sum(len(s) for s in seen) == len(set(users)) and set().union(*seen) == set(users.tolist())
    per_example = shard_step(x, y, weight, None, replicas=2, rows_per_replica=None)
    assert [len(s[2]) for s in per_example] == [12, 11] and list(per_example[0][3]) == list(range(12))
    with pytest.raises(Exception, match="more than the 5 planned"):
        shard_step(x, y, weight, None, replicas=2, rows_per_replica=5)


def _train_cli(batches: str, out: str, *options: str) -> dict:
    import subprocess
    import sys

    command = [sys.executable, "-m", "madp.cli", "-q", "train", batches, out, *options]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    return json.loads(finished.stdout)


def test_mirrored_strategy_on_two_cpu_replicas_trains_the_same_model(pipeline_data):
    """Each replica clips and sums its half, the sums are all-reduced and both add the same noise:
    the model equals the one-device model up to float summation order."""
    directory, data = pipeline_data
    batches = str(directory / "mirrored-batches")
    batch_local(
        str(directory / "bounded"),
        data,
        batches,
        BatchOptions(seed=0, steps=25, batch_size=60, min_sep=2, max_batch_size=75),
    )
    options = ["--noise-multiplier", "1.5", "--bands", "2", "--model", "mlp", "--seed", "3", "--noise-seed", "3"]
    one = _train_cli(batches, str(directory / "one-device"), *options)
    two = _train_cli(
        batches, str(directory / "two-replicas"), *options, "--distribution", "mirrored", "--cpu-replicas", "2"
    )
    assert (one["replicas"], two["replicas"]) == (1, 2)
    weights = [
        tf_keras.models.load_model(str(directory / name / "model.keras"), compile=False).get_weights()
        for name in ("one-device", "two-replicas")
    ]
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert not np.allclose(weights[0][0], build_model("mlp", 8)[0].get_weights()[0])  # it trained


def test_tpu_distribution_without_a_tpu_is_a_clear_error(pipeline_data, capsys):
    directory, _ = pipeline_data
    assert (
        main(
            [
                "-q",
                "train",
                str(directory / "poisson"),
                str(directory / "tpu"),
                "--noise-multiplier",
                "1",
                "--distribution",
                "tpu",
            ]
        )
        == 2
    )
    assert "--distribution tpu: no TPU" in capsys.readouterr().err
    assert (
        main(
            [
                "-q",
                "train",
                str(directory / "poisson"),
                str(directory / "tpu"),
                "--noise-multiplier",
                "1",
                "--cpu-replicas",
                "2",
            ]
        )
        == 2
    )
    assert "--cpu-replicas" in capsys.readouterr().err


def test_amplified_accounting_matches_an_independent_calibrate_call(pipeline_data, capsys, monkeypatch):
    directory, data = pipeline_data
    batches = str(directory / "amplified")
    report = batch_local(
        str(directory / "bounded"), data, batches, BatchOptions(seed=0, steps=30, batch_size=40, min_sep=3)
    )
    privacy = train(
        batches, str(directory / "amplified-train"), TrainOptions(epsilon=3.0, delta=1e-2, bands=3, amplified=True)
    ).privacy
    assert privacy["mechanism"] == "bandmf-minsep" and privacy["monte_carlo"]["verified"]
    assert privacy["noise_multiplier"] < privacy["monte_carlo"]["fallback_noise_multiplier"]
    assert privacy["parameters"]["max_contributions"] == 2 and privacy["delta"] <= 1e-2
    assert (
        main(
            [
                "-q",
                "calibrate",
                "--mechanism",
                "bandmf-minsep",
                "--epsilon",
                "3",
                "--delta",
                "1e-2",
                "--steps",
                "30",
                "--sampling-prob",
                str(report.sampling_probability),
                "--min-sep",
                "3",
                "--bands",
                "3",
                "-k",
                "2",
            ]
        )
        == 0
    )
    independent = json.loads(capsys.readouterr().out)
    assert independent["noise_multiplier"] == privacy["noise_multiplier"]
    assert independent["fallback_noise_multiplier"] == privacy["monte_carlo"]["fallback_noise_multiplier"]
    # --mc-runner cuda draws the same samples (here the GPU's per-sample functions on the CPU): the same plan
    from madp.accounting import monte_carlo_cuda
    from madp.training.batches import open_batches
    from madp.training.plan import privacy_plan

    monkeypatch.setattr(monte_carlo_cuda, "gpu", lambda: monte_carlo_cuda.CPU)
    on_gpu = privacy_plan(
        open_batches(batches), TrainOptions(epsilon=3.0, delta=1e-2, bands=3, amplified=True, mc_runner="cuda")
    )
    assert on_gpu.noise_multiplier == pytest.approx(privacy["noise_multiplier"], rel=1e-12)


def test_mc_runner_cuda_is_refused_where_tensorflow_trains_on_the_gpu(pipeline_data, monkeypatch):
    """cupy's arrays would compete with TensorFlow's for the GPU: the plan is then computed first, in
    madp run's calibrate stage, and nothing is written here."""
    directory, _ = pipeline_data
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: ["GPU:0"] if kind == "GPU" else [])
    output = directory / "mc-runner-cuda"
    options = TrainOptions(epsilon=3.0, delta=1e-2, bands=3, amplified=True, mc_runner="cuda")
    with pytest.raises(InputError, match="calibrate stage, with mc_runner: cuda"):
        train(str(directory / "bounded"), str(output), options)
    assert not output.exists()


def test_zero_out_rows_train_with_zero_gradient(pipeline_data, capsys):
    """`--zero-out` (the audit's zero-out neighbour): listing no record changes nothing bit for bit, listing
    every record leaves a non-private model at its initialization, and a bad file is a clear error."""
    import tf_keras

    directory, data = pipeline_data
    batches = str(directory / "zero-out-batches")
    batch_local(str(directory / "bounded"), data, batches, BatchOptions(seed=0, steps=20, batch_size=64))
    ids = [row["id"] for row in map(json.loads, open(data))]
    none, every = directory / "none.json", directory / "every.json"
    none.write_text("[]")
    every.write_text(json.dumps(ids))

    def weights(out, **options):
        train(batches, str(directory / out), TrainOptions(**options))
        return tf_keras.models.load_model(str(directory / out / "model.keras"), compile=False).get_weights()

    private = dict(noise_multiplier=1.0, noise_seed=3)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(weights("plain", **private), weights("zero-none", zero_out=str(none), **private))
    )
    from madp.training.tasks import build_model

    tf_keras.utils.set_random_seed(0)  # what train() does before building the model
    initial = build_model("logreg", 8)[0].get_weights()
    assert all(
        np.array_equal(a, b) for a, b in zip(weights("zero-every", mechanism="none", zero_out=str(every)), initial)
    )
    assert not all(np.array_equal(a, b) for a, b in zip(weights("baseline", mechanism="none"), initial))
    (directory / "bad.json").write_text('{"ids": 1}')
    assert (
        main(
            [
                "-q",
                "train",
                batches,
                str(directory / "bad"),
                "--mechanism",
                "none",
                "--zero-out",
                str(directory / "bad.json"),
            ]
        )
        == 2
    )
    assert "JSON list of record ids" in capsys.readouterr().err
