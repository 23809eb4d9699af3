"""The options of `madp train`, checked when built: what to train, how privately, on what."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from madp.core.errors import InputError, nonnegative, positive

MECHANISMS = ("auto", "dpsgd", "bandmf", "none")
DISTRIBUTIONS = ("default", "mirrored", "tpu")
MC_RUNNERS = ("local", "cuda")  # --mc-runner: worker processes, or one NVIDIA GPU
TASKS = ("binary", "multiclass", "regression")  # what a numeric or module:function model predicts
SCHEDULES = ("constant", "cosine", "warmup-cosine")  # --lr-schedule
# What --optimizer and --learning-rate default to, per model (`training_defaults`). The text
# classifier's were chosen on CPython's changelog (benchmarks/text_defaults.py, README "Text
# defaults, on real text"): Adam at 0.01 came within a point of a linear model on the same n-grams
# (SGD at 0.5: 2.4 points below it). The language model's are those its README figures were
# measured with (examples/text-lm.yaml).
# The pretrained causal LM's rate is a common one for fine-tuning with Adam (not tuned here): the
# from-scratch rates would move it far from its pretrained weights in a few steps. Its LoRA adapters
# (--lora-rank) start at zero and take a higher one: 2e-3, chosen on CPython's changelog (at batch
# 256, 40 steps, it beat 1e-3 without privacy and with DP-SGD) and confirmed on Debian's package
# descriptions (README "The papers' multi-attribution experiment").
# The classifier beside a pretrained feature (text-classifier --pretrained) takes Adam at 0.03, chosen
# on CPython's changelog at epsilon 8 (0.642 and 0.636 accuracy in two runs, against 0.603 at 0.01).
# Adam's epsilon (--adam-epsilon, added to the root of a coordinate's mean squared gradient) keeps
# Keras' 1e-7 for every model. 3e-3 makes the text classifier memorize less (a coordinate whose
# gradients stay below it moves less than the learning rate, so a rare n-gram's row learns slowly):
# after 1000 steps of 256 it lifted the classifier on four real corpora without privacy (1.5 to 11
# points), but it learns more slowly in the first few hundred steps, privately throughout them
# (README "Text defaults, on real text"), so it is not the default.
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
# and Debian's packages (README "Text defaults, on real text"); the classifier beside a pretrained
# feature was measured without one, and keeps none. Keyed as LEARNING_RATE_DEFAULTS' models.
L2_DEFAULTS = {"text-classifier": 3e-4}
# Without privacy the text classifier's rate decays by a cosine to 0 (--lr-schedule cosine): its
# accuracy stops rising within a few hundred steps at a constant rate, while the steps' sampling noise
# keeps the weights moving; the decay lets them settle (after 1000 steps of 256, +1 to +2 points on a
# second sample of PyPI's packages and CPython's changelog, -1 on Debian's packages: README "Text
# defaults, on real text"). With DP-SGD the rate stays constant: the noise then sums over the steps,
# so with sum_t r_t of signal against sqrt(sum_t r_t^2) of noise a constant rate is the best (Cauchy-
# Schwarz), and a cosine lost 2 points privately on the changelog. Keyed as LEARNING_RATE_DEFAULTS.
NON_PRIVATE_SCHEDULE_DEFAULTS = {"text-classifier": "cosine"}
# The classifier's words are cut to their first 6 characters (--word-prefix; 0 keeps them whole), a
# stemmer that needs no vocabulary: "packages", "packaged" and "packaging" share one row, which under
# DP-SGD's noise gathers their signal. At epsilon 8 it lifted accuracy by 0.7 to 1.9 points (the mean
# of two noise seeds) on a second sample of PyPI's packages, CPython's changelog (1000 and 250 steps)
# and Debian's packages, and moved it by -0.5 to +0.7 without privacy; 5 and 7 characters did about
# as well (README "Text defaults, on real text"). Beside a pretrained feature words stay whole (measured so).
CLASSIFIER_WORD_PREFIX = 6


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    epsilon: float | None = None
    delta: float = 1e-5
    noise_multiplier: float | None = None
    mechanism: str = "auto"
    bands: int = 1
    strategy: str = "sqrt"
    model: str = "logreg"
    features: str = "features"
    label: str = "label"
    inputs: tuple[str, ...] | None = None  # the model's input features (None: --features alone)
    task: str = "binary"  # binary (one logit), multiclass (--classes logits or probabilities), regression,
    # or module:function: the user's own task (`madp.training.user_tasks.UserTask`)
    classes: int | None = None  # multiclass: labels are the integers 0..classes-1
    model_path: tuple[str, ...] = ()  # directories searched first for a module:function model
    optimizer: str | None = None  # sgd or adam; None: the model's default (`training_defaults`)
    learning_rate: float | None = None  # None: the default of the model and optimizer
    adam_epsilon: float | None = None  # None: Keras' default (KERAS_ADAM_EPSILON)
    l2: float | None = None  # L2 penalty added to the noised gradient; None: the model's (L2_DEFAULTS)
    clip_norm: float = 1.0
    seed: int = 0  # model initialization (public); not the noise
    noise_seed: int | None = None  # None: fresh secret noise key; an int reproduces (not private)
    mc_seed: int = 0  # Monte Carlo verification samples (public: they only check the accountant)
    eval_data: str | None = None
    eval_data_public: bool = False  # the user declares --eval-data public: only then are evaluations published
    eval_every: int = 100
    max_contributions: int | None = None
    amplified: bool = False
    mc_samples: int | None = None
    mc_workers: int = 1
    mc_runner: str = "local"  # where the Monte Carlo samples are drawn: MC_RUNNERS
    distribution: str = "default"
    tpu: str = ""
    cpu_replicas: int = 1
    xla: bool = False  # each step compiled by XLA (one device), padded to the largest step's rows
    mixed_precision: bool = False  # layers compute in bfloat16, weights and clipping in float32
    calibration: str | None = None
    zero_out: str | None = None  # file of record ids whose rows train with weight 0 (madp audit)
    testing_noise_scale: float = 1.0  # TESTING ONLY: scales the noise, not the claim (not private)
    retrain: bool = False  # train again on batches an earlier private training used (composition stated)
    text_column: str = "text"  # text models: the feature holding the text
    labels: tuple[str, ...] | None = None  # text-classifier: the public label set (None: read from the data)
    max_length: int = 128  # text-classifier: n-grams per text; text-lm: bytes per text; causal-lm: tokens
    buckets: int = 16384  # text-classifier: rows of the hashed n-gram embedding
    ngrams: int | None = None  # text-classifier: n-grams of 1 to this many words (None: `ngram_order`)
    word_prefix: int | None = None  # text-classifier: words cut to this many characters, 0: whole
    # (None: `word_prefix_length`)
    width: int | None = None  # text models: embedding width (None: 64)
    layers: int = 2  # text-lm: Transformer blocks
    heads: int = 4  # text-lm: attention heads
    on_invalid: str = "error"  # text models: rows they cannot use stop training, or train with weight 0
    lr_schedule: str | None = None  # constant, cosine or warmup-cosine, by step index (public); None: the
    # model's (constant, or NON_PRIVATE_SCHEDULE_DEFAULTS' without privacy)
    warmup_steps: int = 0  # warmup-cosine: steps of linear warmup
    checkpoint_every: int | None = None  # steps between checkpoints (OUTPUT/internal/checkpoints/)
    resume: bool = False  # continue from the last checkpoint of OUTPUT
    replace: bool = False  # a fresh training replaces an earlier one's outputs in OUTPUT, after its first step
    pretrained: str | None = None  # causal-lm, text-classifier: a pretrained model's GGUF file or keras-hub preset
    lora_rank: int = 0  # causal-lm: train LoRA adapters of this rank only (0: every weight)
    internal_scalars: bool = False  # training loss, clipped fraction, gradient norms to OUTPUT/internal/logs/

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
        """--ngrams, else words alone (1), or words and word pairs (2) beside a --pretrained feature
        (measured so). With word pairs the plain classifier learned less on three real corpora (README
        "Text defaults, on real text"): a text's n n-grams weigh 1 / sqrt(n) each in its bag, so pairs
        shrink its words' gradients while the noise on the bag stays the same, and the pairs, mostly
        in one text each, are memorized without privacy."""
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
    def target_epsilon(self) -> float:
        """The epsilon to calibrate sigma for."""
        if self.epsilon is None:
            raise InputError("give --epsilon (or --noise-multiplier)")
        return self.epsilon

    def __post_init__(self) -> None:
        checks = [
            (self.mechanism in MECHANISMS, f"--mechanism must be one of {MECHANISMS}"),
            (self.bands >= 1, "--bands must be at least 1"),
            (self.optimizer in (None, "sgd", "adam"), "--optimizer must be sgd or adam"),
            (self.learning_rate is None or positive(self.learning_rate), "--learning-rate must be positive and finite"),
            (self.adam_epsilon is None or positive(self.adam_epsilon), "--adam-epsilon must be positive and finite"),
            (
                self.adam_epsilon is None or self.optimizer_name == "adam",
                "--adam-epsilon sets Adam's epsilon, and this training uses SGD: drop it, or give --optimizer adam",
            ),
            (self.l2 is None or nonnegative(self.l2), "--l2 must be 0 or above and finite"),
            (positive(self.clip_norm), "--clip-norm must be positive and finite"),
            (self.eval_every >= 1, "--eval-every must be at least 1"),
            (
                self.eval_data is not None or not self.eval_data_public,
                "--eval-data-public needs --eval-data (it declares it public)",
            ),
            (
                self.mechanism == "none"
                or self.calibration is not None
                or self.epsilon is not None
                or self.noise_multiplier is not None,
                "give --epsilon (sigma is calibrated), --noise-multiplier, or --calibration",
            ),
            (
                self.calibration is None or (self.epsilon is None and self.noise_multiplier is None),
                "--calibration fixes sigma: drop --epsilon and --noise-multiplier",
            ),
            (
                self.calibration is None or self.mechanism != "none",
                "--mechanism none trains without privacy, --calibration with the plan's mechanism: give one of them",
            ),
            (
                self.noise_multiplier is None or positive(self.noise_multiplier),
                "--noise-multiplier must be positive and finite",
            ),
            (
                not self.amplified or self.mechanism in ("auto", "bandmf"),
                "--amplified accounts BandMF: use --mechanism auto or bandmf",
            ),
            (self.distribution in DISTRIBUTIONS, f"--distribution must be one of {DISTRIBUTIONS}"),
            (
                self.cpu_replicas >= 1 and (self.cpu_replicas == 1 or self.distribution == "mirrored"),
                "--cpu-replicas must be at least 1, and above 1 only with --distribution mirrored",
            ),
            (
                not self.xla or self.distribution == "default",
                "--xla compiles the step of one device: use --distribution default (a TPU compiles every step)",
            ),
            (self.mc_workers >= 1, "--mc-workers must be at least 1"),
            (self.mc_runner in MC_RUNNERS, f"--mc-runner must be one of {MC_RUNNERS}"),
            (self.mc_runner == "local" or self.mc_workers == 1, "--mc-workers is for --mc-runner local"),
            (positive(self.testing_noise_scale), "--testing-only-noise-scale must be positive and finite"),
            (self.max_length >= 1 and self.buckets >= 2, "--max-length must be at least 1 and --buckets at least 2"),
            (
                self.ngrams is None or 1 <= self.ngrams <= self.max_length,
                f"--ngrams must be between 1 (words) and --max-length ({self.max_length}): a longer n-gram is never "
                f"kept, and hashing it costs time",
            ),
            (self.word_prefix is None or self.word_prefix >= 0, "--word-prefix must be at least 0 (0: whole words)"),
            (self.width is None or self.width >= 1, "--width must be at least 1"),
            (
                self.layers >= 1 and self.heads >= 1 and (self.width or 64) % self.heads == 0,
                "--layers and --heads must be at least 1, and --width a multiple of --heads",
            ),
            (
                self.labels is None or len(set(self.labels)) == len(self.labels) >= 2,
                "--labels: at least two distinct labels",
            ),
            (self.on_invalid in ("error", "skip"), "--on-invalid must be 'error' or 'skip'"),
            (self.task in TASKS or self.user_task, f"--task must be one of {TASKS}, or module:function"),
            (
                not self.user_task or ":" in self.model,
                "--task module:function trains a --model module:function (the built-in models have their own tasks)",
            ),
            (
                (self.task == "multiclass") == (self.classes is not None) and (self.classes or 2) >= 2,
                "--task multiclass needs --classes N (N >= 2), and --classes needs --task multiclass",
            ),
            (self.inputs is None or len(self.inputs) >= 1, "--inputs: at least one feature"),
            (self.lr_schedule in (None, *SCHEDULES), f"--lr-schedule must be one of {SCHEDULES}"),
            (
                self.warmup_steps >= 0 and (self.warmup_steps == 0 or self.lr_schedule == "warmup-cosine"),
                "--warmup-steps must be at least 0, and above 0 only with --lr-schedule warmup-cosine",
            ),
            (self.checkpoint_every is None or self.checkpoint_every >= 1, "--checkpoint-every must be at least 1"),
            (
                (self.model == "causal-lm") <= (self.pretrained is not None)
                and (self.pretrained is None or self.model in ("causal-lm", "text-classifier")),
                "--model causal-lm needs --pretrained PATH, and --pretrained needs --model causal-lm or "
                "text-classifier",
            ),
            (
                self.lora_rank >= 0 and (self.lora_rank == 0 or self.model == "causal-lm"),
                "--lora-rank must be at least 0, and above 0 only with --model causal-lm",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise InputError(message)


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
