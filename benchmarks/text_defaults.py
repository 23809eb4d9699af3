"""Do the text classifier's defaults learn on real text? madp's `text-classifier` with its default
options, non-private and at epsilon 8, against a linear model on the same hashed n-grams.

The corpus is a madp JSON Lines file with `text`, `label` and `users` (`benchmarks/text_corpus.py`
writes CPython's changelog, 11 classes). A seeded 20% of the records is held out for evaluation;
the rest goes through `madp bound -k K` (K given, or the one `madp recommend-k` recommends for the
training records at the same epsilon, delta, T and B: `-k recommend`), `madp batch` (Poisson, T
steps of expected size B, a fresh sampling key per private training) and `madp train --model
text-classifier` with nothing but the labels, the evaluation file and the privacy target (plus
--extra flags, to compare candidates).

The linear model: softmax regression on the L2-normalized presence vector of hashed n-grams
(`madp.training.text.hashed_ngrams`, same buckets and length), full-batch Adam, its L2 penalty
chosen on a validation tenth of its training records; on words alone and on words and word pairs
(`--linear-ngrams`), each with whole words and with words cut to 6 characters (`--linear-prefixes`,
the classifier's default), the most accurate of these four on the held-out records being the
reference (`linear`), whatever n-grams the classifier reads. It is trained on the records madp
trains on, the bounded selection (each record once): the comparison is between the two models on
the same data, not of the bounding's bias (which drops most records of a user with thousands). It
is also trained on all training records (`linear_all_records`, with the reference's n-grams).

    python benchmarks/text_defaults.py CORPUS.jsonl [--steps 1000] [--batch-size 256] [-k 4|recommend] \
        [--epsilon 8] [--extra "--optimizer adam --learning-rate 0.01"]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from madp.training.outputs import evaluation_of  # noqa: E402  (the held-out split's: internal)


def split(corpus: str, directory: str, seed: int = 0) -> tuple[str, str, list[str]]:
    """(training records, held-out records, sorted labels): a seeded 20% held out."""
    rows = [json.loads(line) for line in open(corpus, encoding="utf-8")]
    held_out = np.random.default_rng(seed).random(len(rows)) < 0.2
    paths = os.path.join(directory, "records.jsonl"), os.path.join(directory, "test.jsonl")
    for path, keep in zip(paths, (~held_out, held_out)):
        with open(path, "w", encoding="utf-8") as file:
            for row, kept in zip(rows, keep):
                if kept:
                    file.write(json.dumps(row) + "\n")
    return *paths, sorted({row["label"] for row in rows})


def madp(*arguments: str) -> str:
    """Runs the madp command line; its standard output."""
    command = [sys.executable, "-m", "madp.cli", "-q", *arguments]
    return subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.PIPE, text=True).stdout


def recommended_k(records: str, args: argparse.Namespace) -> int:
    """The k `madp recommend-k` recommends for these records at the benchmark's privacy and steps."""
    privacy = ["--epsilon", str(args.epsilon), "--delta", str(args.delta)]
    steps = ["--steps", str(args.steps), "--batch-size", str(args.batch_size)]
    return int(json.loads(madp("recommend-k", records, *privacy, *steps))["recommended_k"])


def bound_k(value: str) -> int | str:
    """-k: a positive integer, or `recommend`."""
    if value != "recommend" and not (value.isdigit() and int(value) > 0):
        raise argparse.ArgumentTypeError(f"{value!r} is neither a positive integer nor 'recommend'")
    return value if value == "recommend" else int(value)


def final_accuracy(output: str) -> dict:
    metrics = json.load(open(os.path.join(output, "metrics.json")))
    privacy = json.load(open(os.path.join(output, "privacy.json")))
    final = evaluation_of(output, internal=True)["final"]
    return {
        "accuracy": final["accuracy"],
        "macro_f1": final["macro_f1"],
        "optimizer": metrics["optimizer"],
        "learning_rate": metrics["learning_rate"],
        "epsilon": privacy.get("epsilon"),
        "noise_multiplier": privacy.get("noise_multiplier"),
    }


def bounded_records(records: str, bound: str, directory: str) -> str:
    """The records `madp bound` selected (each once), as a JSON Lines file."""
    import pyarrow.dataset as ds

    selected = {str(i) for i in ds.dataset(os.path.join(bound, "selected")).to_table()["id"].to_pylist()}
    path = os.path.join(directory, "selected.jsonl")
    with open(records, encoding="utf-8") as source, open(path, "w", encoding="utf-8") as out:
        out.writelines(line for line in source if str(json.loads(line)["id"]) in selected)
    return path


def presence_rows(path: str, labels: list[str], buckets: int, max_length: int, order: int, prefix: int):
    """(ids, weights, labels) of a JSON Lines file: each text's L2-normalized presence vector of
    hashed n-grams (words cut to `prefix` characters, 0: whole) as its distinct nonzero n-gram ids,
    each weighing 1 / sqrt(their number) (repeats and padding weigh 0), and each label's index."""
    from madp.training.text import hashed_ngrams

    index = {label: i for i, label in enumerate(labels)}
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    texts = np.array([r["text"].encode() for r in rows], dtype=object)
    ids = np.sort(hashed_ngrams(texts, buckets, max_length, order, prefix=prefix))
    present = ids != 0
    present[:, 1:] &= ids[:, 1:] != ids[:, :-1]
    weights = present / np.maximum(np.sqrt(present.sum(axis=1, keepdims=True)), 1e-12)
    return ids, weights.astype(np.float32), np.array([index[r["label"]] for r in rows])


def linear_accuracy(
    records: str, test: str, labels: list[str], buckets: int, max_length: int, order: int, prefix: int
) -> dict:
    from madp.training import load_tensorflow
    from madp.training.text import softmax_loss

    tf = load_tensorflow()

    def fit(ids, presence, y, l2: float, epochs: int = 300):
        weights = tf.Variable(tf.zeros((buckets, len(labels))))
        bias = tf.Variable(tf.zeros(len(labels)))
        optimizer = tf.keras.optimizers.Adam(0.05)
        ids, presence, y = tf.constant(ids), tf.constant(presence), tf.constant(y)

        def logits(ids, presence, weights, bias):  # the presence vector times the weights, row by row
            return tf.einsum("nl,nlc->nc", presence, tf.gather(weights, ids)) + bias

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = softmax_loss(y, logits(ids, presence, weights, bias))
                loss = tf.reduce_mean(loss) + l2 * tf.reduce_sum(weights * weights)
            gradients = [tf.convert_to_tensor(g) for g in tape.gradient(loss, [weights, bias])]  # dense Adam
            optimizer.apply_gradients(zip(gradients, [weights, bias]))

        for _ in range(epochs):
            step()
        return lambda ids, presence: logits(ids, presence, weights, bias).numpy().argmax(axis=1)

    ids, presence, y = presence_rows(records, labels, buckets, max_length, order, prefix)
    validation = np.random.default_rng(1).random(len(y)) < 0.1
    train = ~validation
    scores = {}
    for l2 in (0.0, 1e-6, 1e-5, 1e-4, 1e-3):
        predict = fit(ids[train], presence[train], y[train], l2)
        scores[l2] = float(np.mean(predict(ids[validation], presence[validation]) == y[validation]))
    best = max(scores, key=lambda l2: scores[l2])
    test_ids, test_presence, y_test = presence_rows(test, labels, buckets, max_length, order, prefix)
    predicted = fit(ids, presence, y, best)(test_ids, test_presence)
    accuracy = round(float(np.mean(predicted == y_test)), 4)
    return {"accuracy": accuracy, "ngrams": order, "word_prefix": prefix, "l2": best, "validation": scores}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("-k", type=bound_k, default=4, help="records per user kept by madp bound, or 'recommend'")
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--delta", type=float, default=1e-6)
    parser.add_argument("--extra", default="", help="madp train flags for both trainings (a candidate default)")
    parser.add_argument("--skip-linear", action="store_true")
    parser.add_argument(
        "--linear-ngrams", default="1,2", help="n-gram orders the linear model is fit on; the best is the reference"
    )
    parser.add_argument(
        "--linear-prefixes", default="0,6", help="word prefixes (0: whole words) it is fit with, at each order"
    )
    parser.add_argument("--only", choices=("non_private", "private", "linear"), help="one of the three models")
    parser.add_argument("--work", help="working directory (default: a temporary one)")
    args = parser.parse_args()

    directory = args.work or tempfile.mkdtemp(prefix="madp-text-defaults-")
    os.makedirs(directory, exist_ok=True)
    records, test, labels = split(args.corpus, directory)
    bound = os.path.join(directory, "bound")
    k = recommended_k(records, args) if args.k == "recommend" else args.k
    madp("bound", records, bound, "-k", str(k), "--runner", "local")
    common = ["--model", "text-classifier", "--labels", ",".join(labels), "--eval-data", test]
    common += ["--eval-every", str(args.steps), *shlex.split(args.extra)]
    results: dict = {"corpus": args.corpus, "steps": args.steps, "batch_size": args.batch_size, "k": k}
    results["k_chosen_by"] = "madp recommend-k" if args.k == "recommend" else "-k"
    results["extra"] = args.extra
    for name, privacy in (("non_private", ["--mechanism", "none"]), ("private", ["--epsilon", str(args.epsilon)])):
        if args.only not in (None, name):  # "linear" trains neither
            continue
        batches = os.path.join(directory, f"batches-{name}")  # a fresh sampling key for each training
        madp("batch", bound, records, batches, "--steps", str(args.steps), "--batch-size", str(args.batch_size))
        output = os.path.join(directory, f"train-{name}")
        madp("train", batches, output, *common, *privacy, "--delta", str(args.delta))
        results[name] = final_accuracy(output)
    if not args.skip_linear and args.only in (None, "linear"):
        selection = bounded_records(records, bound, directory)
        features = [(int(n), int(p)) for n in args.linear_ngrams.split(",") for p in args.linear_prefixes.split(",")]
        fits = [linear_accuracy(selection, test, labels, 16384, 128, n, p) for n, p in features]
        results["linear_fits"] = fits
        results["linear"] = best = max(fits, key=lambda fit: fit["accuracy"])
        results["linear_all_records"] = linear_accuracy(
            records, test, labels, 16384, 128, best["ngrams"], best["word_prefix"]
        )
    if "linear" in results and "private" in results:
        linear = results["linear"]["accuracy"]
        results["non_private_minus_linear_points"] = round(100 * (results["non_private"]["accuracy"] - linear), 2)
        results["private_over_linear"] = round(results["private"]["accuracy"] / linear, 4)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
