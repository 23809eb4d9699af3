"""The options of `madp train`, checked when built: what to train, how privately, on what."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from madp.core.errors import OptionError, nonnegative, positive
from madp.core.options import (
    CALIBRATE,
    Checks,
    Message,
    check_choices,
    comma_list,
    option,
    refuse_failed,
    seed_argument,
    shell_words,
)

MECHANISMS = ("auto", "dpsgd", "bandmf", "none")
STRATEGIES = ("sqrt", "optimized")  # BandMF coefficients (`accounting.strategies`)
OPTIMIZERS = ("sgd", "adam")
ON_INVALID = ("error", "skip")  # rows a text model cannot use: stop, or train them with weight 0
DISTRIBUTIONS = ("default", "mirrored", "tpu")
MC_RUNNERS = ("local", "cuda")  # --mc-runner: worker processes, or one NVIDIA GPU
TASKS = ("binary", "multiclass", "regression")  # what a numeric or module:function model predicts
SCHEDULES = ("constant", "cosine", "warmup-cosine")  # --lr-schedule
# What --optimizer and --learning-rate default to, per model (`training_defaults`). The text
# classifier's were chosen on CPython's changelog (benchmarks/text_defaults.py, docs/history.md,
# "Choosing the text defaults on real text"): Adam at 0.01 came within a point of a linear model on the same n-grams
# (SGD at 0.5: 2.4 points below it). The language model's are those its figures (docs/benchmarks.md, Text
# models) were measured with (examples/text-lm.yaml).
# The pretrained causal LM's rate is a common one for fine-tuning with Adam (not tuned here): the
# from-scratch rates would move it far from its pretrained weights in a few steps. Its LoRA adapters
# (--lora-rank) start at zero and take a higher one: 2e-3, chosen on CPython's changelog (at batch
# 256, 40 steps, it beat 1e-3 without privacy and with DP-SGD) and confirmed on Debian's package
# descriptions (docs/benchmarks.md, "The papers' multi-attribution experiment").
# The classifier beside a pretrained feature (text-classifier --pretrained) takes Adam at 0.03, chosen
# on CPython's changelog at epsilon 8 (0.642 and 0.636 accuracy in two runs, against 0.603 at 0.01).
# Adam's epsilon (--adam-epsilon, added to the root of a coordinate's mean squared gradient) keeps
# Keras' 1e-7 for every model. 3e-3 makes the text classifier memorize less (a coordinate whose
# gradients stay below it moves less than the learning rate, so a rare n-gram's row learns slowly):
# after 1000 steps of 256 it lifted the classifier on four real corpora without privacy (1.5 to 11
# points), but it learns more slowly in the first few hundred steps, privately throughout them
# (docs/history.md, "Choosing the text defaults on real text"), so it is not the default.
OPTIMIZER_DEFAULTS = {"text-classifier": "adam", "text-lm": "adam", "causal-lm": "adam"}
LEARNING_RATE_DEFAULTS = {
    ("text-lm", "adam"): 0.003,
    ("causal-lm", "adam"): 1e-4,
    ("causal-lm-lora", "adam"): 2e-3,
    ("text-classifier-pretrained", "adam"): 0.03,
    ("*", "adam"): 0.01,
    ("*", "sgd"): 0.5,
}
KERAS_ADAM_EPSILON = 1e-7  # what tf_keras and Keras 3 default to
# An L2 penalty (--l2: l2 times each weight added to the step's noised mean gradient) of 3e-4 keeps
# the text classifier from memorizing rare words without privacy and, unlike --adam-epsilon 3e-3,
# does not slow its first steps: chosen on a second sample of PyPI's packages, CPython's changelog
# and Debian's packages (docs/history.md, "Choosing the text defaults on real text"); the classifier beside a pretrained
# feature was measured without one, and keeps none. Keyed as LEARNING_RATE_DEFAULTS' models.
L2_DEFAULTS = {"text-classifier": 3e-4}
# Without privacy the text classifier's rate decays by a cosine to 0 (--lr-schedule cosine): its
# accuracy stops rising within a few hundred steps at a constant rate, while the steps' sampling noise
# keeps the weights moving; the decay lets them settle (after 1000 steps of 256, +1 to +2 points on a
# second sample of PyPI's packages and CPython's changelog, -1 on Debian's packages: docs/history.md,
# "Choosing the text defaults on real text"). With DP-SGD the rate stays constant: the noise then sums over the steps,
# so with sum_t r_t of signal against sqrt(sum_t r_t^2) of noise a constant rate is the best (Cauchy-
# Schwarz), and a cosine lost 2 points privately on the changelog. Keyed as LEARNING_RATE_DEFAULTS.
NON_PRIVATE_SCHEDULE_DEFAULTS = {"text-classifier": "cosine"}
# The classifier's words are cut to their first 6 characters (--word-prefix; 0 keeps them whole), a
# stemmer that needs no vocabulary: "packages", "packaged" and "packaging" share one row, which under
# DP-SGD's noise gathers their signal. At epsilon 8 it lifted accuracy by 0.7 to 1.9 points (the mean
# of two noise seeds) on a second sample of PyPI's packages, CPython's changelog (1000 and 250 steps)
# and Debian's packages, and moved it by -0.5 to +0.7 without privacy; 5 and 7 characters did about
# as well (docs/history.md, "Choosing the text defaults on real text"). Beside a pretrained feature words
# stay whole (measured so).
CLASSIFIER_WORD_PREFIX = 6


def clip_norm_option() -> Any:
    """--clip-norm, the bound on each example's gradient norm: `madp train` clips to it, and `madp recommend-k`
    plans a training with it and writes it into its config's calibrate section."""
    return option(1.0, section=CALIBRATE)


NUMERIC = "numeric and module:function models"  # --help's argument groups
TEXT = "text models (text-classifier, text-lm, causal-lm)"
LONG = "long jobs"
AT_A_URL = "batches at a URL (gs://, s3://, hdfs://: TensorFlow reads none of them, so they are copied first)"


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """The options of `madp train` (each field its `--flag`), checked when built; `madp run` takes the
    privacy ones in its calibrate section (`CALIBRATE`), the others in its train section."""

    epsilon: float | None = option(None, help="target epsilon: sigma is calibrated to it", section=CALIBRATE)
    delta: float = option(1e-5, section=CALIBRATE)
    noise_multiplier: float | None = option(None, help="use this sigma instead (prints its epsilon)", section=CALIBRATE)
    calibration: str | None = option(
        None,
        help="a privacy plan (privacy.json of a run, or the calibrate stage of "
        "`madp run`) for these batches: its sigma and guarantee are used",
    )
    mechanism: str = option(
        "auto",
        choices=MECHANISMS,
        help="auto: DP-SGD for Poisson batches with --min-sep 1 and one band, else BandMF; "
        "none: the non-private baseline",
        section=CALIBRATE,
    )
    bands: int = option(1, help="BandMF bands of C (1: DP-SGD noise)", section=CALIBRATE)
    strategy: str = option("sqrt", choices=STRATEGIES, help="BandMF coefficients", section=CALIBRATE)
    model: str = option(
        "logreg",
        help="logreg, mlp, text-classifier, text-lm, causal-lm (--pretrained), or module:function: "
        "function(schema) returns "
        "(model, per-row loss) or (model, loss, optimizer), tf_keras or Keras 3",
    )
    features: str = option("features", help="feature holding the input of a numeric model")
    label: str = option("label", aliases=("--label-column",), help="feature holding the label")
    inputs: tuple[str, ...] | None = option(  # None: --features alone
        None,
        parse=comma_list,
        help="the model's input features F1,F2,... (default --features); several are given as a dict by name",
        group=NUMERIC,
    )
    # binary (one logit), multiclass (--classes logits or probabilities), regression, or module:function:
    # the user's own task (`madp.training.user_tasks.UserTask`)
    task: str = option(
        "binary",
        help="binary (one logit; accuracy), multiclass (--classes outputs; accuracy), regression (mse, mae), or "
        "module:function: function(features) returns a task of your own (its features, encode, metrics)",
        group=NUMERIC,
    )
    classes: int | None = option(None, help="--task multiclass: labels are 0..N-1", group=NUMERIC)
    model_path: tuple[str, ...] = option(
        (),
        repeatable=True,
        metavar="DIR",
        help="directory searched (before the current directory and PYTHONPATH) for a module:function model; repeatable",
        group=NUMERIC,
    )
    text_column: str = option("text", help="feature holding the text (default text)", group=TEXT)
    labels: tuple[str, ...] | None = option(
        None,
        parse=comma_list,
        help="text-classifier: the public label set, A,B,... (default: read from the data, which discloses it)",
        group=TEXT,
    )
    max_length: int = option(
        128, help="word n-grams (classifier), bytes (text-lm) or tokens (causal-lm) per text", group=TEXT
    )
    pretrained: str | None = option(
        None,
        metavar="PATH",
        help="a pretrained model (weights and tokenizer) of a Llama architecture, a local GGUF "
        "file or keras-hub preset directory (LlamaBackbone or Llama3Backbone with a Llama3Tokenizer): "
        "causal-lm fine-tunes it; text-classifier adds a frozen feature of its token embeddings beside "
        "the n-grams; `make pretrained` fetches SmolLM2-135M-Instruct as GGUF",
        group=TEXT,
    )
    lora_rank: int = option(
        0,
        help="causal-lm: train only LoRA adapters of this rank on the query and value projections "
        "(default 0: fine-tune every weight)",
        group=TEXT,
    )
    buckets: int = option(16384, help="text-classifier: hash buckets of the n-grams", group=TEXT)
    ngrams: int | None = option(  # None: `ngram_order`
        None,
        help="text-classifier: hash n-grams of 1 to this many words (default 1, words; 2 with --pretrained: "
        "words and word pairs)",
        group=TEXT,
    )
    word_prefix: int | None = option(  # None: `word_prefix_length`
        None,
        help="text-classifier: cut each word to its first N characters before hashing (default 6; 0, and the "
        "default with --pretrained: whole words)",
        group=TEXT,
    )
    width: int | None = option(None, help="embedding width (default 64)", group=TEXT)
    layers: int = option(2, help="text-lm: Transformer blocks", group=TEXT)
    heads: int = option(4, help="text-lm: attention heads", group=TEXT)
    on_invalid: str = option(
        "error",
        choices=ON_INVALID,
        help="rows a text model cannot use (not UTF-8, no words, label not in --labels): stop, or train "
        "them with weight 0 and list them in OUTPUT/rejected/",
        group=TEXT,
    )
    retrain: bool = option(  # a permission: privacy.json states the ledger's composition with it or without it
        False,
        help="train although an earlier private training used these batches: both models' guarantee is "
        "then the composition privacy.json states (with secret sampling, far more than twice epsilon)",
        how_only=True,
    )
    optimizer: str | None = option(  # None: the model's default (`training_defaults`)
        None, choices=OPTIMIZERS, help="default: adam for the text models, sgd for the others"
    )
    learning_rate: float | None = option(
        None,
        help="default: 0.01 with adam (0.003 for text-lm, 0.03 for text-classifier --pretrained, 1e-4 for "
        "causal-lm, 2e-3 for causal-lm --lora-rank), 0.5 with sgd",
    )
    adam_epsilon: float | None = option(
        None,
        help="Adam's epsilon, added to the root of each coordinate's mean squared gradient: a coordinate "
        "whose gradients stay below it moves less than the learning rate (default: Keras' 1e-7; "
        "3e-3 makes text-classifier memorize less in long trainings)",
    )
    l2: float | None = option(
        None,
        help="L2 penalty: l2 times each weight is added to the step's (noised) mean gradient, outside the "
        "clipping, so it costs no privacy (default: 3e-4 for text-classifier without --pretrained, else 0)",
    )
    clip_norm: float = clip_norm_option()
    seed: int = option(0, parse=seed_argument, help="seed of the model initialization (not of the noise)")
    noise_seed: int | None = option(  # None: a fresh secret noise key
        None,
        parse=seed_argument,
        help="TESTING ONLY: reproduce the noise from this seed; the model is then not private "
        "(default: a fresh secret key per run, never written)",
    )
    mc_seed: int = option(  # public: the samples only check the accountant
        0,
        parse=seed_argument,
        help="--amplified: seed of the Monte Carlo verification samples (public)",
        section=CALIBRATE,
    )
    eval_data: str | None = option(None, help="records (.jsonl/.parquet) to evaluate on")
    eval_data_public: bool = option(
        False,
        help="--eval-data is public data: only then are the evaluations published (metrics.json, logs/); "
        "computed without noise, on private records (a hold-out of the same corpus) no guarantee covers "
        "them, so by default they go to OUTPUT/internal/",
    )
    eval_every: int = option(100, help="steps between evaluations")
    amplified: bool = option(
        False,
        help="account b-min-sep Poisson batches with amplification (bandmf-minsep, Monte Carlo "
        "estimate-verify-release; falls back to unamplified BandMF when verification fails)",
        section=CALIBRATE,
    )
    mc_samples: int | None = option(
        None,
        help="--amplified: most Monte Carlo samples one verification "
        "may draw per direction (default: 4x what the sequential "
        "test needs at delta 0)",
        section=CALIBRATE,
    )
    mc_workers: int = option(  # every number of workers draws the same Monte Carlo samples (`mc_delta`)
        1, help="--amplified: worker processes", section=CALIBRATE, how_only=True
    )
    mc_runner: str = option(
        "local",
        choices=MC_RUNNERS,
        help="--amplified: where the Monte Carlo samples are drawn: local (default; --mc-workers "
        "processes) or cuda (one NVIDIA GPU: pip install 'madp[cuda]'; refused where TensorFlow "
        "trains on a GPU: compute the plan in madp run's calibrate stage)",
        section=CALIBRATE,
    )
    distribution: str = option(
        "default",
        choices=DISTRIBUTIONS,
        help="tf.distribute strategy: default (one device), mirrored (all local GPUs, or "
        "the logical CPUs of --cpu-replicas), tpu",
    )
    tpu: str = option("", help="--distribution tpu: TPU name or grpc:// address ('' = local TPU VM)")
    cpu_replicas: int = option(
        1, help="--distribution mirrored without GPUs: split the CPU into this many logical devices"
    )
    xla: bool = option(
        False,
        help="compile each training step with XLA (one device; every step padded to the largest step's rows)",
    )
    mixed_precision: bool = option(
        False,
        help="layers compute in bfloat16 (GPUs, TPUs, recent CPUs); weights, losses, the clipping norms and "
        "the noised sum stay float32",
    )
    max_contributions: int | None = option(
        None,
        aliases=("-k",),
        help="K (default: read from the bounding report of the batches' SELECTED)",
        section=CALIBRATE,
    )
    zero_out: str | None = option(
        None,
        help="a JSON list of record ids whose rows train with weight 0 (zero "
        "gradient): the zero-out neighbour of their users (madp audit)",
    )
    testing_only_noise_scale: float = option(  # scales the noise, not the claim
        1.0,
        help="TESTING ONLY: multiply the noise by this while keeping the claimed guarantee "
        "(shows that madp audit catches a broken mechanism); the model is not private",
    )
    lr_schedule: str | None = option(  # None: the model's (constant, or NON_PRIVATE_SCHEDULE_DEFAULTS')
        None,
        choices=SCHEDULES,
        help="learning rate by step index: constant, cosine decay to 0, or linear warmup then cosine "
        "(default: constant; cosine for text-classifier without --pretrained and without privacy)",
        group=LONG,
    )
    internal_scalars: bool = option(
        False,
        help="also log the training loss, clipped fraction and gradient norm at each --eval-every step to "
        "OUTPUT/internal/logs/ (INTERNAL: computed without noise, not covered by the guarantee)",
        group=LONG,
    )
    warmup_steps: int = option(0, help="--lr-schedule warmup-cosine: warmup steps", group=LONG)
    checkpoint_every: int | None = option(  # how often progress is saved; a finished training removes them
        None,
        help="write a checkpoint every N steps (and at each evaluation) to OUTPUT/internal/checkpoints/ (internal)",
        group=LONG,
        how_only=True,
    )
    resume: bool = option(  # finishes the interrupted training: its outputs are that training's
        False,
        help="continue from OUTPUT's last checkpoint to the same T steps under the same plan (fresh noise key)",
        group=LONG,
        how_only=True,
    )
    replace: bool = option(
        False,
        help="OUTPUT may hold an earlier finished training: its outputs are replaced once this training has "
        "taken its first step (its checks passed, its model traced and ran); a checkpoint, or a file madp train "
        "does not write, is refused by name (what madp run's train and baseline stages do); nothing is replaced "
        "under --resume",
        group=LONG,
    )
    # Where the batches come from, not which they are: the copy is checked against the batch report's SHA-256s,
    # which identify the batches in the trainings ledger
    batches_copy: str | None = option(  # None: `madp.beam.remote_batches.default_copy_folder`
        None,
        metavar="DIR",
        help="the local folder batches at a URL are copied to (each file checked) before the training reads "
        "them; a second training copies only what changed (default: a folder per URL in "
        "$XDG_CACHE_HOME/madp/batches, else ~/.cache/madp/batches)",
        group=AT_A_URL,
        how_only=True,
    )
    file_system_options: tuple[str, ...] = option(
        (),
        parse=shell_words,
        metavar="'OPTIONS'",
        help="the Beam pipeline options of the URL's file system, quoted as one argument and split as a shell "
        "line, e.g. '--hdfs_host NAMENODE --hdfs_port 9870 --hdfs_user madp'",
        group=AT_A_URL,
        how_only=True,
    )

    @property
    def user_model(self) -> bool:
        """--model module:function: a model of the user's own."""
        return ":" in self.model

    @property
    def user_task(self) -> bool:
        """--task module:function: a task of the user's own."""
        return ":" in self.task

    @property
    def optimizer_name(self) -> str:
        """--optimizer, else the model's default (Adam for the text models, SGD otherwise)."""
        return self.optimizer or OPTIMIZER_DEFAULTS.get(self.model, "sgd")

    @property
    def ngram_order(self) -> int:
        """--ngrams, else words alone (1), or words and word pairs (2) beside a --pretrained feature (measured so).
        With word pairs the plain classifier learned less on three real corpora (docs/history.md, "Choosing the text
        defaults on real text"): a text's n n-grams weigh 1 / sqrt(n) each in its bag, so pairs shrink its words'
        gradients while the noise on the bag stays the same, and the pairs, mostly in one text each, are memorized
        without privacy."""
        return self.ngrams or (1 if self.pretrained is None else 2)

    @property
    def word_prefix_length(self) -> int:
        """--word-prefix, else CLASSIFIER_WORD_PREFIX characters, or whole words (0) beside a
        --pretrained feature (measured so)."""
        if self.word_prefix is not None:
            return self.word_prefix
        return CLASSIFIER_WORD_PREFIX if self.pretrained is None else 0

    @property
    def batch_features(self) -> tuple[str, ...] | None:
        """The batch features (the records' content columns) the model reads; None for a --task, whose
        code names them."""
        if self.user_task:
            return None
        if self.model in ("text-lm", "causal-lm"):
            return (self.text_column,)
        if self.model == "text-classifier":
            return (self.text_column, self.label)
        return (*self.input_features, self.label)

    @property
    def input_features(self) -> tuple[str, ...]:
        """The features a numeric model reads: --inputs, else --features."""
        return self.inputs or (self.features,)

    @property
    def paths_beside_batches(self) -> tuple[str | None, ...]:
        """The local paths a training reads besides its batches (None: not given), the copy of batches at a
        URL among them: none may be, hold or lie inside its output."""
        return (self.eval_data, self.calibration, self.zero_out, self.pretrained, self.batches_copy)

    @property
    def target_epsilon(self) -> float:
        """The epsilon to calibrate sigma for."""
        if self.epsilon is None:
            raise OptionError("give {epsilon} (or {noise_multiplier})")
        return self.epsilon

    def __post_init__(self) -> None:
        check_choices(self)
        for checks in (
            self._privacy_checks(),
            self._optimizer_checks(),
            self._distribution_checks(),
            self._text_checks(),
            self._model_checks(),
            self._schedule_checks(),
        ):
            refuse_failed(checks)

    def _privacy_checks(self) -> Checks:
        return [
            (self.bands >= 1, "{bands} must be at least 1"),
            (positive(self.clip_norm), "{clip_norm} must be positive and finite"),
            (
                self.mechanism == "none"
                or self.calibration is not None
                or self.epsilon is not None
                or self.noise_multiplier is not None,
                "give {epsilon} (sigma is calibrated), {noise_multiplier}, or {calibration}",
            ),
            (
                self.calibration is None or (self.epsilon is None and self.noise_multiplier is None),
                "{calibration} fixes sigma: drop {epsilon} and {noise_multiplier}",
            ),
            (
                self.calibration is None or self.mechanism != "none",
                "{mechanism} none trains without privacy, {calibration} with the plan's mechanism: give one of them",
            ),
            (
                self.noise_multiplier is None or positive(self.noise_multiplier),
                "{noise_multiplier} must be positive and finite",
            ),
            (
                not self.amplified or self.mechanism in ("auto", "bandmf"),
                "{amplified} accounts BandMF: use {mechanism} auto or bandmf",
            ),
            (self.mc_workers >= 1, "{mc_workers} must be at least 1"),
            (self.mc_runner == "local" or self.mc_workers == 1, "{mc_workers} is for {mc_runner} local"),
            (positive(self.testing_only_noise_scale), "{testing_only_noise_scale} must be positive and finite"),
        ]

    def _optimizer_checks(self) -> Checks:
        return [
            (self.learning_rate is None or positive(self.learning_rate), "{learning_rate} must be positive and finite"),
            (self.adam_epsilon is None or positive(self.adam_epsilon), "{adam_epsilon} must be positive and finite"),
            (
                self.adam_epsilon is None or self.optimizer_name == "adam",
                "{adam_epsilon} sets Adam's epsilon, and this training uses SGD: drop it, or give {optimizer} adam",
            ),
            (self.l2 is None or nonnegative(self.l2), "{l2} must be 0 or above and finite"),
            (self.eval_every >= 1, "{eval_every} must be at least 1"),
            (
                self.eval_data is not None or not self.eval_data_public,
                "{eval_data_public} needs {eval_data} (it declares it public)",
            ),
        ]

    def _distribution_checks(self) -> Checks:
        return [
            (
                self.cpu_replicas >= 1 and (self.cpu_replicas == 1 or self.distribution == "mirrored"),
                "{cpu_replicas} must be at least 1, and above 1 only with {distribution} mirrored",
            ),
            (
                not self.xla or self.distribution == "default",
                "{xla} compiles the step of one device: use {distribution} default (a TPU compiles every step)",
            ),
        ]

    def _text_checks(self) -> Checks:
        return [
            (self.max_length >= 1 and self.buckets >= 2, "{max_length} must be at least 1 and {buckets} at least 2"),
            (
                self.ngrams is None or 1 <= self.ngrams <= self.max_length,
                Message(
                    "{ngrams} must be between 1 (words) and {max_length} ({0}): a longer n-gram is never kept, and "
                    "hashing it costs time",
                    (self.max_length,),
                ),
            ),
            (self.word_prefix is None or self.word_prefix >= 0, "{word_prefix} must be at least 0 (0: whole words)"),
            (self.width is None or self.width >= 1, "{width} must be at least 1"),
            (
                self.layers >= 1 and self.heads >= 1 and (self.width or 64) % self.heads == 0,
                "{layers} and {heads} must be at least 1, and {width} a multiple of {heads}",
            ),
            (
                self.labels is None or len(set(self.labels)) == len(self.labels) >= 2,
                "{labels}: at least two distinct labels",
            ),
        ]

    def _model_checks(self) -> Checks:
        return [
            (
                self.task in TASKS or self.user_task,
                Message("{task} must be one of {0}, or module:function", (", ".join(TASKS),)),
            ),
            (
                not self.user_task or self.user_model,
                "{task} module:function trains a {model} module:function (the built-in models have their own tasks)",
            ),
            (
                (self.task == "multiclass") == (self.classes is not None) and (self.classes or 2) >= 2,
                "{task} multiclass needs {classes} N (N >= 2), and {classes} needs {task} multiclass",
            ),
            (self.inputs is None or len(self.inputs) >= 1, "{inputs}: at least one feature"),
            (
                (self.model == "causal-lm") <= (self.pretrained is not None)
                and (self.pretrained is None or self.model in ("causal-lm", "text-classifier")),
                "{model} causal-lm needs {pretrained} PATH, and {pretrained} needs {model} causal-lm or "
                "text-classifier",
            ),
            (
                self.lora_rank >= 0 and (self.lora_rank == 0 or self.model == "causal-lm"),
                "{lora_rank} must be at least 0, and above 0 only with {model} causal-lm",
            ),
        ]

    def _schedule_checks(self) -> Checks:
        return [
            (
                self.warmup_steps >= 0 and (self.warmup_steps == 0 or self.lr_schedule == "warmup-cosine"),
                "{warmup_steps} must be at least 0, and above 0 only with {lr_schedule} warmup-cosine",
            ),
            (self.checkpoint_every is None or self.checkpoint_every >= 1, "{checkpoint_every} must be at least 1"),
        ]


class OptimizerSettings(NamedTuple):
    """What `madp train` builds its optimizer and steps from (`training_defaults`)."""

    name: str  # sgd or adam
    learning_rate: float
    adam_epsilon: float | None  # Adam's epsilon; None with sgd
    l2: float  # the L2 penalty the step adds to the noised gradient (0: none)
    lr_schedule: str  # constant, cosine or warmup-cosine (`long_training.learning_rate_at`)


def training_defaults(options: TrainOptions) -> OptimizerSettings:
    """The optimizer of a training: --optimizer, --learning-rate, --adam-epsilon, --l2 and --lr-schedule
    where given, else the model's defaults (Adam for the text models, SGD otherwise; the rate of that
    model and optimizer; Keras' epsilon for Adam; L2_DEFAULTS' penalty; a constant rate, or
    NON_PRIVATE_SCHEDULE_DEFAULTS' schedule without privacy)."""
    optimizer = options.optimizer_name
    model = f"{options.model}-lora" if options.lora_rank else options.model
    if options.model == "text-classifier" and options.pretrained is not None:
        model = "text-classifier-pretrained"
    rate = options.learning_rate
    if rate is None:
        rate = LEARNING_RATE_DEFAULTS.get((model, optimizer), LEARNING_RATE_DEFAULTS[("*", optimizer)])
    epsilon = (options.adam_epsilon or KERAS_ADAM_EPSILON) if optimizer == "adam" else None
    l2 = L2_DEFAULTS.get(model, 0.0) if options.l2 is None else options.l2
    schedule = options.lr_schedule
    if schedule is None:
        schedule = NON_PRIVATE_SCHEDULE_DEFAULTS.get(model, "constant") if options.mechanism == "none" else "constant"
    return OptimizerSettings(optimizer, rate, epsilon, l2, schedule)
