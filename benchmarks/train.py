"""Training step benchmark: non-private vs DP-SGD vs DP-BandMF steps of the same model.

The step functions of `madp.training.trainer` run on the same in-memory batches, after a warm-up
that traces them; the best of --repeats timed blocks is reported, with the ratios. Inputs: the
synthetic logistic-regression content (16 features) for `logreg`/`mlp`, synthetic emails
(`madp generate --task text` documents) encoded as the trainer encodes them for `text-classifier`
(hashed n-grams) and `text-lm` (bytes), random ids and labels for `transformer` (a Transformer
encoder classifier: vocabulary 5000, 64 tokens, width 64, 2 heads, 1 block, 4 classes; with
--keras3 built of Keras 3 layers, without the position embedding, madp's being a tf_keras layer), and
English sentences cut to --length tokens for `causal-lm` (the pretrained model of --pretrained, all
its weights or, with --lora-rank, LoRA adapters only; tokens/s reported too). Targets:
DP-SGD at most 3x the non-private step and BandMF (8 bands) within 1.2x of DP-SGD (mlp); at batch
256, DP-SGD at most 1.5x non-private for the text classifier, 2x for the transformer and 3x for
the text LM; for the pretrained causal LM at most 2x with LoRA, 3x fine-tuning every weight. All
these models take ghost clipping (`madp.training.clipping`; the fully fine-tuned causal LM's
RMSNorm and tied embedding included); `dp-sgd-per-example-gradients` is the general path a model
with other layers takes. `--xla` compiles every step with XLA and
`--mixed-precision` computes in bfloat16 (`madp train --xla --mixed-precision`).

    python benchmarks/train.py [--model mlp|text-classifier|text-lm|transformer] [--batch-size 1024] [--steps 100]
    python benchmarks/train.py --model transformer --keras3 --batch-size 256 --steps 20
    python benchmarks/train.py --model causal-lm --pretrained PATH.gguf [--lora-rank 8] --batch-size 8 \
        --length 64 --steps 3 --repeats 2 --warmup 2 [--kinds non-private,dp-sgd] [--xla] [--mixed-precision]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", help="logreg, mlp, text-classifier, text-lm or transformer")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--bands", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (the first traces)")
    parser.add_argument(
        "--kinds", help="steps to time, of non-private,dp-sgd,bandmf-BANDS,dp-sgd-per-example-gradients (default: all)"
    )
    parser.add_argument("--pretrained", help="causal-lm: the GGUF file")
    parser.add_argument("--lora-rank", type=int, default=0, help="causal-lm: LoRA adapters only, of this rank")
    parser.add_argument("--length", type=int, default=64, help="causal-lm: tokens per text")
    parser.add_argument("--xla", action="store_true", help="every step compiled by XLA (jit_compile)")
    parser.add_argument("--mixed-precision", action="store_true", help="layers compute in bfloat16")
    parser.add_argument("--keras3", action="store_true", help="transformer: of Keras 3 layers (`import keras`)")
    args = parser.parse_args()

    import numpy as np

    from madp.accounting.strategies import sqrt_coefficients
    from madp.core.batch_files import Feature
    from madp.core.randomness import SecretKey
    from madp.training.ghost_clipping import ghost_clippable
    from madp.training.options import TrainOptions
    from madp.training.preparation import tf, tf_keras
    from madp.training.queries import BandMfQuery, DpSgdQuery
    from madp.training.steps import NonPrivateStep, PrivateStep, compute_precision
    from madp.training.tasks import ByteLmTask, TextClassifierTask, build_model
    from madp.training.text import softmax_loss

    if args.keras3:
        import keras

        keras_lib = keras
    else:
        keras_lib = tf_keras
    rng = np.random.default_rng(0)
    if args.model in ("text-classifier", "text-lm"):
        from madp.tools.data.synthetic_text import TOPICS, documents

        texts, topics = documents(np.arange(args.batch_size + 1), rng.integers(0, 10**6, args.batch_size), 0)
        rows = {"text": np.array([t.encode() for t in texts], dtype=object), "label": topics}
        features = {name: Feature(name, "bytes", ()) for name in ("text", "label")}
        options = TrainOptions(model=args.model, mechanism="none")
        task = (
            TextClassifierTask(options, features, list(TOPICS))
            if args.model == "text-classifier"
            else ByteLmTask(options, features)
        )
        inputs, labels, _ = task.encode(rows)
        build = task.build
    elif args.model == "causal-lm":
        from madp.training import pretrained
        from madp.training.bpe_tokenizer import token_sequences

        loaded = pretrained.read_pretrained(args.pretrained)
        sentences = [f"{ENGLISH[i % len(ENGLISH)]} (text {i})".encode() for i in range(args.batch_size)]
        inputs, labels = token_sequences(loaded.tokenizer, sentences, args.length)
        build = lambda: (  # noqa: E731
            pretrained.pretrained_model(loaded, args.length, args.lora_rank),
            pretrained.next_token_loss,
        )
    elif args.model == "transformer":
        inputs = rng.integers(1, 5000, (args.batch_size, 64)).astype(np.int32)
        labels = rng.integers(0, 4, args.batch_size).astype(np.int32)
        build = lambda: (transformer_classifier(5000, 64, 64, 2, 4, keras_lib), softmax_loss)  # noqa: E731
    else:
        inputs = rng.normal(size=(args.batch_size, args.features)).astype(np.float32)
        labels = (rng.random(args.batch_size) < 0.5).astype(np.float32)
        build = lambda: build_model(args.model, args.features)  # noqa: E731
    x, y, weight = tf.constant(inputs), tf.constant(labels), tf.ones(args.batch_size)

    def make(kind: str):
        keras_lib.utils.set_random_seed(0)
        with compute_precision(args.mixed_precision):
            model, loss = build()
        optimizer = keras_lib.optimizers.SGD(0.1)
        if kind == "non-private":
            return NonPrivateStep(model, loss, optimizer, jit_compile=args.xla)
        template = [tf.TensorSpec(v.shape, v.dtype) for v in model.trainable_variables]
        key = SecretKey.fresh()
        query = (
            BandMfQuery(1.0, 1.0, key, tuple(sqrt_coefficients(args.bands).tolist()), template)
            if kind.startswith("bandmf")
            else DpSgdQuery(1.0, 1.0, key)
        )
        return PrivateStep(
            model,
            loss,
            optimizer,
            query,
            float(args.batch_size),
            fast=kind != "dp-sgd-per-example-gradients",
            jit_compile=args.xla,
        )

    def run(step, steps: int) -> None:
        for _ in range(steps):
            step(x, y, weight)
        step.model.trainable_variables[0].numpy()  # wait for the last update

    results = {
        "model": args.model,
        "batch_size": args.batch_size,
        "device": "GPU" if tf.config.list_physical_devices("GPU") else "CPU",
        "steps": args.steps,
        "xla": args.xla,
        "mixed_precision": args.mixed_precision,
        **({"keras": "Keras 3" if args.keras3 else "tf_keras"} if args.model == "transformer" else {}),
        **({"length": args.length, "lora_rank": args.lora_rank} if args.model == "causal-lm" else {}),
    }
    kinds = ["non-private", "dp-sgd", f"bandmf-{args.bands}", "dp-sgd-per-example-gradients"]
    if not ghost_clippable(build()[0]):  # dp-sgd already takes the per-example path
        kinds.remove("dp-sgd-per-example-gradients")
    if args.kinds:
        kinds = [kind for kind in kinds if kind in args.kinds.split(",")]
    tokens = int((labels >= 0).sum()) if args.model == "causal-lm" else None  # predicted tokens per step
    for kind in kinds:
        step = make(kind)
        run(step, args.warmup)
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            run(step, args.steps)
            times.append(time.perf_counter() - started)
        results[kind] = {
            "steps_per_s": round(args.steps / min(times), 3),
            "slowest_steps_per_s": round(args.steps / max(times), 3),
            **({"tokens_per_s": round(tokens * args.steps / min(times), 1)} if tokens else {}),
        }
        del step
    for name, (slow, fast) in {
        "dp_sgd_over_non_private": ("dp-sgd", "non-private"),
        "bandmf_over_dp_sgd": (f"bandmf-{args.bands}", "dp-sgd"),
    }.items():
        if slow in results and fast in results:
            results[name] = round(results[fast]["steps_per_s"] / results[slow]["steps_per_s"], 2)
    print(json.dumps(results, indent=2))


ENGLISH = [  # the causal LM's texts: plain English, as it was trained on
    "The history of the city goes back more than two thousand years. It was founded on the banks of a river, "
    "where traders met to exchange goods from the north and the south. Over the centuries it grew into an "
    "important centre of commerce and learning, with a university, a cathedral and a busy port.",
    "Regular exercise improves both physical and mental health. Even a short walk every day can lower blood "
    "pressure, help people sleep better and reduce stress. Doctors recommend at least thirty minutes of "
    "moderate activity on most days of the week.",
]


def transformer_classifier(vocabulary: int, length: int, width: int, heads: int, classes: int, keras_lib):
    """Of `keras_lib`'s layers (the tf_keras or the Keras 3 module): token and position embeddings
    (Keras 3: token embeddings only, madp's PositionEmbedding being a tf_keras layer), one pre-norm
    encoder block (attention, a 4x-wide GELU layer), mean pooling, a softmax layer."""
    from madp.training.preparation import tf_keras
    from madp.training.text import PositionEmbedding

    layers = keras_lib.layers
    inputs = keras_lib.Input((length,), dtype="int32")
    x = layers.Embedding(vocabulary, width)(inputs)
    x = PositionEmbedding()(x) if keras_lib is tf_keras else x
    normalized = layers.LayerNormalization()(x)
    x = x + layers.MultiHeadAttention(heads, width // heads)(normalized, normalized)
    hidden = layers.Dense(4 * width, activation="gelu")(layers.LayerNormalization()(x))
    x = x + layers.Dense(width)(hidden)
    pooled = layers.GlobalAveragePooling1D()(layers.LayerNormalization()(x))
    return keras_lib.Model(inputs, layers.Dense(classes)(pooled))


if __name__ == "__main__":
    main()
