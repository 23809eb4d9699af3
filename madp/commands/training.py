"""Training: `madp train`, and the calibrate stage of `madp run` (the privacy plan of its options)."""

from __future__ import annotations

import argparse

from madp.commands.registry import Family, seed_argument


def add_parsers(commands: argparse._SubParsersAction) -> None:
    training = commands.add_parser("train", help="DP-SGD or DP-BandMF training on `madp batch` outputs")
    training.add_argument("batches", help="a `madp batch` output directory")
    training.add_argument("output", help="output directory: model.keras, metrics.json, privacy.json, logs/")
    training.add_argument("--epsilon", type=float, help="target epsilon: sigma is calibrated to it")
    training.add_argument("--delta", type=float, default=1e-5)
    training.add_argument("--noise-multiplier", type=float, help="use this sigma instead (prints its epsilon)")
    training.add_argument(
        "--calibration",
        help="a privacy plan (privacy.json of a run, or the calibrate stage of "
        "`madp run`) for these batches: its sigma and guarantee are used",
    )
    training.add_argument(
        "--mechanism",
        choices=("auto", "dpsgd", "bandmf", "none"),
        default="auto",
        help="auto: DP-SGD for Poisson batches with --min-sep 1 and one band, else BandMF; "
        "none: the non-private baseline",
    )
    training.add_argument("--bands", type=int, default=1, help="BandMF bands of C (1: DP-SGD noise)")
    training.add_argument("--strategy", choices=("sqrt", "optimized"), default="sqrt", help="BandMF coefficients")
    training.add_argument(
        "--model",
        default="logreg",
        help="logreg, mlp, text-classifier, text-lm, causal-lm (--pretrained), or module:function: "
        "function(schema) returns "
        "(model, per-row loss) or (model, loss, optimizer), tf_keras or Keras 3",
    )
    training.add_argument("--features", default="features", help="feature holding the input of a numeric model")
    training.add_argument("--label", "--label-column", dest="label", default="label", help="feature holding the label")
    numeric = training.add_argument_group("numeric and module:function models")
    numeric.add_argument(
        "--inputs",
        type=lambda value: tuple(value.split(",")),
        help="the model's input features F1,F2,... (default --features); several are given as a dict by name",
    )
    numeric.add_argument(
        "--task",
        default="binary",
        help="binary (one logit; accuracy), multiclass (--classes outputs; accuracy), regression (mse, mae), or "
        "module:function: function(features) returns a task of your own (its features, encode, metrics)",
    )
    numeric.add_argument("--classes", type=int, help="--task multiclass: labels are 0..N-1")
    numeric.add_argument(
        "--model-path",
        action="append",
        default=[],
        metavar="DIR",
        help="directory searched (before the current directory and PYTHONPATH) for a module:function model; repeatable",
    )
    text = training.add_argument_group("text models (text-classifier, text-lm, causal-lm)")
    text.add_argument("--text-column", default="text", help="feature holding the text (default text)")
    text.add_argument(
        "--labels",
        type=lambda value: tuple(value.split(",")),
        help="text-classifier: the public label set, A,B,... (default: read from the data, which discloses it)",
    )
    text.add_argument(
        "--max-length",
        type=int,
        default=128,
        help="word n-grams (classifier), bytes (text-lm) or tokens (causal-lm) per text",
    )
    text.add_argument(
        "--pretrained",
        metavar="PATH",
        help="a pretrained model (weights and tokenizer) of a Llama architecture, a local GGUF "
        "file or keras-hub preset directory (LlamaBackbone or Llama3Backbone with a Llama3Tokenizer): "
        "causal-lm fine-tunes it; text-classifier adds a frozen feature of its token embeddings beside "
        "the n-grams; `make pretrained` fetches SmolLM2-135M-Instruct as GGUF",
    )
    text.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="causal-lm: train only LoRA adapters of this rank on the query and value projections "
        "(default 0: fine-tune every weight)",
    )
    text.add_argument("--buckets", type=int, default=16384, help="text-classifier: hash buckets of the n-grams")
    text.add_argument(
        "--ngrams",
        type=int,
        help="text-classifier: hash n-grams of 1 to this many words (default 1, words; 2 with --pretrained: "
        "words and word pairs)",
    )
    text.add_argument(
        "--word-prefix",
        type=int,
        help="text-classifier: cut each word to its first N characters before hashing (default 6; 0, and the "
        "default with --pretrained: whole words)",
    )
    text.add_argument("--width", type=int, help="embedding width (default 64)")
    text.add_argument("--layers", type=int, default=2, help="text-lm: Transformer blocks")
    text.add_argument("--heads", type=int, default=4, help="text-lm: attention heads")
    text.add_argument(
        "--on-invalid",
        choices=("error", "skip"),
        default="error",
        help="rows a text model cannot use (not UTF-8, no words, label not in --labels): stop, or train "
        "them with weight 0 and list them in OUTPUT/rejected/",
    )
    training.add_argument(
        "--retrain",
        action="store_true",
        help="train although an earlier private training used these batches: both models' guarantee is "
        "then the composition privacy.json states (with secret sampling, far more than twice epsilon)",
    )
    training.add_argument(
        "--optimizer", choices=("sgd", "adam"), help="default: adam for the text models, sgd for the others"
    )
    training.add_argument(
        "--learning-rate",
        type=float,
        help="default: 0.01 with adam (0.003 for text-lm, 1e-4 for causal-lm), 0.5 with sgd",
    )
    training.add_argument(
        "--adam-epsilon",
        type=float,
        help="Adam's epsilon, added to the root of each coordinate's mean squared gradient: a coordinate "
        "whose gradients stay below it moves less than the learning rate (default: Keras' 1e-7; "
        "3e-3 makes text-classifier memorize less in long trainings)",
    )
    training.add_argument(
        "--l2",
        type=float,
        help="L2 penalty: l2 times each weight is added to the step's (noised) mean gradient, outside the "
        "clipping, so it costs no privacy (default: 3e-4 for text-classifier without --pretrained, else 0)",
    )
    training.add_argument("--clip-norm", type=float, default=1.0)
    training.add_argument(
        "--seed", type=seed_argument, default=0, help="seed of the model initialization (not of the noise)"
    )
    training.add_argument(
        "--noise-seed",
        type=seed_argument,
        help="TESTING ONLY: reproduce the noise from this seed; the model is then not private "
        "(default: a fresh secret key per run, never written)",
    )
    training.add_argument(
        "--mc-seed",
        type=seed_argument,
        default=0,
        help="--amplified: seed of the Monte Carlo verification samples (public)",
    )
    training.add_argument("--eval-data", help="records (.jsonl/.parquet) to evaluate on")
    training.add_argument(
        "--eval-data-public",
        action="store_true",
        help="--eval-data is public data: only then are the evaluations published (metrics.json, logs/); "
        "computed without noise, on private records (a hold-out of the same corpus) no guarantee covers "
        "them, so by default they go to OUTPUT/internal/",
    )
    training.add_argument("--eval-every", type=int, default=100, help="steps between evaluations")
    training.add_argument(
        "--amplified",
        action="store_true",
        help="account b-min-sep Poisson batches with amplification (bandmf-minsep, Monte Carlo "
        "estimate-verify-release; falls back to unamplified BandMF when verification fails)",
    )
    training.add_argument(
        "--mc-samples",
        type=int,
        help="--amplified: most Monte Carlo samples one verification "
        "may draw per direction (default: 4x what the sequential "
        "test needs at delta 0)",
    )
    training.add_argument("--mc-workers", type=int, default=1, help="--amplified: worker processes")
    training.add_argument(
        "--mc-runner",
        choices=("local", "cuda"),
        default="local",
        help="--amplified: where the Monte Carlo samples are drawn: local (default; --mc-workers "
        "processes) or cuda (one NVIDIA GPU: pip install 'madp[cuda]'; refused where TensorFlow "
        "trains on a GPU: compute the plan in madp run's calibrate stage)",
    )
    training.add_argument(
        "--distribution",
        choices=("default", "mirrored", "tpu"),
        default="default",
        help="tf.distribute strategy: default (one device), mirrored (all local GPUs, or "
        "the logical CPUs of --cpu-replicas), tpu",
    )
    training.add_argument(
        "--tpu", default="", help="--distribution tpu: TPU name or grpc:// address ('' = local TPU VM)"
    )
    training.add_argument(
        "--cpu-replicas",
        type=int,
        default=1,
        help="--distribution mirrored without GPUs: split the CPU into this many logical devices",
    )
    training.add_argument(
        "--xla",
        action="store_true",
        help="compile each training step with XLA (one device; every step padded to the largest step's rows)",
    )
    training.add_argument(
        "--mixed-precision",
        action="store_true",
        help="layers compute in bfloat16 (GPUs, TPUs, recent CPUs); weights, losses, the clipping norms and "
        "the noised sum stay float32",
    )
    training.add_argument(
        "--max-contributions",
        "-k",
        type=int,
        help="K (default: read from the bounding report of the batches' SELECTED)",
    )
    training.add_argument(
        "--zero-out",
        help="a JSON list of record ids whose rows train with weight 0 (zero "
        "gradient): the zero-out neighbour of their users (madp audit)",
    )
    training.add_argument(
        "--testing-only-noise-scale",
        type=float,
        default=1.0,
        help="TESTING ONLY: multiply the noise by this while keeping the claimed guarantee "
        "(shows that madp audit catches a broken mechanism); the model is not private",
    )
    long = training.add_argument_group("long jobs")
    long.add_argument(
        "--lr-schedule",
        choices=("constant", "cosine", "warmup-cosine"),
        help="learning rate by step index: constant, cosine decay to 0, or linear warmup then cosine "
        "(default: constant; cosine for text-classifier without privacy)",
    )
    long.add_argument(
        "--internal-scalars",
        action="store_true",
        help="also log the training loss, clipped fraction and gradient norm at each --eval-every step to "
        "OUTPUT/internal/logs/ (INTERNAL: computed without noise, not covered by the guarantee)",
    )
    long.add_argument("--warmup-steps", type=int, default=0, help="--lr-schedule warmup-cosine: warmup steps")
    long.add_argument(
        "--checkpoint-every",
        type=int,
        help="write a checkpoint every N steps (and at each evaluation) to OUTPUT/internal/checkpoints/ (internal)",
    )
    long.add_argument(
        "--resume",
        action="store_true",
        help="continue from OUTPUT's last checkpoint to the same T steps under the same plan (fresh noise key)",
    )
    long.add_argument(
        "--replace",
        action="store_true",
        help="OUTPUT may hold an earlier finished training: its outputs are replaced once this training has "
        "taken its first step (its checks passed, its model traced and ran); a checkpoint, or a file madp train "
        "does not write, is refused by name (what madp run's train and baseline stages do); nothing is replaced "
        "under --resume",
    )


def train_options(args: argparse.Namespace):
    from madp.training.options import TrainOptions

    return TrainOptions(
        epsilon=args.epsilon,
        delta=args.delta,
        noise_multiplier=args.noise_multiplier,
        mechanism=args.mechanism,
        bands=args.bands,
        strategy=args.strategy,
        model=args.model,
        features=args.features,
        label=args.label,
        inputs=args.inputs,
        task=args.task,
        classes=args.classes,
        model_path=tuple(args.model_path),
        optimizer=args.optimizer,
        learning_rate=args.learning_rate,
        adam_epsilon=args.adam_epsilon,
        l2=args.l2,
        clip_norm=args.clip_norm,
        seed=args.seed,
        noise_seed=args.noise_seed,
        mc_seed=args.mc_seed,
        eval_data=args.eval_data,
        eval_data_public=args.eval_data_public,
        eval_every=args.eval_every,
        max_contributions=args.max_contributions,
        amplified=args.amplified,
        mc_samples=args.mc_samples,
        mc_workers=args.mc_workers,
        mc_runner=args.mc_runner,
        distribution=args.distribution,
        tpu=args.tpu,
        cpu_replicas=args.cpu_replicas,
        xla=args.xla,
        mixed_precision=args.mixed_precision,
        calibration=args.calibration,
        zero_out=args.zero_out,
        testing_noise_scale=args.testing_only_noise_scale,
        text_column=args.text_column,
        labels=args.labels,
        max_length=args.max_length,
        buckets=args.buckets,
        ngrams=args.ngrams,
        word_prefix=args.word_prefix,
        width=args.width,
        layers=args.layers,
        heads=args.heads,
        on_invalid=args.on_invalid,
        retrain=args.retrain,
        lr_schedule=args.lr_schedule,
        warmup_steps=args.warmup_steps,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        replace=args.replace,
        internal_scalars=args.internal_scalars,
        pretrained=args.pretrained,
        lora_rank=args.lora_rank,
    )


def _train(args: argparse.Namespace, unknown: list[str]) -> dict:
    from madp.stages.training import run_train

    return run_train(args.batches, args.output, train_options(args)).to_json()


def calibrate_batches(args: argparse.Namespace) -> dict:
    """The privacy plan of training on args.batches with args' privacy options, written to args.output: the
    calibrate stage of `madp run`, which parses it as a `madp train` command."""
    from madp.stages.calibrating import calibration_json, run_calibrate

    return calibration_json(run_calibrate(args.batches, args.output, train_options(args)))


FAMILY = Family(add_parsers, {"train": _train}, {"train": train_options})
