"""What a training output holds, and who may read it (no TensorFlow: `madp run` and `madp report`
read it too).

Published vs internal, as everywhere in madp: only what the guarantee covers, or what is a function of
public parameters, may be published. OUTPUT/internal/ holds the rest, with a NOTICE saying so.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import io
import json
import zipfile
from collections.abc import Mapping
from typing import Any, NamedTuple

from madp.core import storage
from madp.core.errors import InputError
from madp.core.selection import REJECTED_DIR

INTERNAL_DIR = "internal"  # OUTPUT/internal/: never published (see NOTICE)
NOTICE = """INTERNAL - do not publish this folder.

logs/: TensorBoard scalars computed from the training rows without noise (training loss, fraction of
clipped gradients, per-example gradient norms), and the evaluation scalars when --eval-data was not
declared public. No privacy guarantee covers them: one user's records can move them.
evaluation.json: the evaluations on --eval-data when it was not declared public (--eval-data-public):
computed without noise on records the guarantee does not cover.
timing.json: the training's wall time and steps per second, which depend on how many rows the secret
sampling drew and on their content.
checkpoints/: the model, the optimizer and, for BandMF, the last noise vectors of the mechanism. Those
noise vectors are as secret as the noise key: with them one can remove the noise from released steps.
(The noise key itself is never written; a resumed run draws a fresh one.)
replaced/: while a training started with --replace runs, the earlier training it replaces (its files at
their places below OUTPUT); deleted once the new training has finished, moved back if it stops before.

What may be published: model.keras, metrics.json, privacy.json and logs/ (privacy/epsilon_spent, a
function of the public plan only, and the evaluation scalars on --eval-data declared public).
"""
EVALUATION_FILE = "evaluation.json"  # OUTPUT/internal/: the evaluations on --eval-data not declared public
EVALUATION_FIELDS = ("eval", "final", "pretrained_eval")  # a training's evaluations, in either file
TIMING_FILE = "timing.json"  # OUTPUT/internal/: the training's timings
TIMING_FIELDS = ("wall_time_s", "steps_per_s")
CHECKPOINTS = "checkpoints"  # OUTPUT/internal/checkpoints/: an interrupted training's, until it finishes
STATE_FILE, NEXT_STATE_FILE = "state.json", "next_state.json"  # in it: what a resume reads (long_training)
REPLACED = "replaced"  # OUTPUT/internal/replaced/: the training a --replace training replaces, until it finishes
REPLACED_LIST = "files.json"  # in it: the files set aside (paths below OUTPUT), written before the first is moved
EVENTS = "events.out.tfevents.*"  # TensorBoard's event files
# What a finished training leaves in OUTPUT (below it, as `fnmatch` patterns): what `madp train --replace`
# replaces. Its checkpoints are not among them: a finished training removes them, and an interrupted one's
# are resumed, never replaced.
WRITTEN = (
    "model.keras",
    "metrics.json",
    "privacy.json",
    f"logs/{EVENTS}",
    f"{INTERNAL_DIR}/NOTICE.txt",
    f"{INTERNAL_DIR}/{EVALUATION_FILE}",
    f"{INTERNAL_DIR}/{TIMING_FILE}",
    f"{INTERNAL_DIR}/logs/{EVENTS}",
    f"{REJECTED_DIR}/rejected.jsonl",
    f"{REJECTED_DIR}/counts.json",
)


def written_by_training(relative: str) -> bool:
    """Whether a file at this path below a training's OUTPUT is one a finished training writes."""
    return any(fnmatch.fnmatchcase(relative, pattern) for pattern in WRITTEN)


@dataclasses.dataclass(frozen=True)
class ReplacedListing:
    """OUTPUT/internal/replaced/files.json: the earlier training a --replace training set aside (`set_aside`).
    Its JSON (`to_json`) is the file's object, its fields in this order."""

    files: tuple[str, ...]  # the files set aside, as paths below OUTPUT
    finished_training: str | None  # the digest of its model.keras and privacy.json (`_finished_training`)

    def to_json(self) -> dict[str, Any]:
        return {"files": list(self.files), "finished_training": self.finished_training}

    @classmethod
    def from_json(cls, data: Any, where: str) -> ReplacedListing:
        """The listing of a parsed files.json (`where` names it in errors)."""
        files = data.get("files") if isinstance(data, dict) else None
        if not (
            isinstance(files, list)
            and all(isinstance(path, str) for path in files)
            and isinstance(data.get("finished_training"), str | None)
        ):
            raise InputError(f"{where}: not a list of replaced files madp wrote (paths and a digest)")
        return cls(tuple(files), data.get("finished_training"))


def set_aside(output: str, paths: list[str]) -> None:
    """Move the earlier training's files (`paths`, from `storage.written_files`) to OUTPUT/internal/replaced/,
    each at its place below OUTPUT, so that the training replacing it writes into an OUTPUT holding nothing
    of it, and nothing of it is lost until that training has finished (`settle_replaced`). Their list is
    written first, with the digest of its model and privacy.json: a process killed while moving them leaves
    what tells a moved file from a new one, and the earlier training's model and privacy.json from those the
    new training writes last."""
    if not paths:
        return
    relatives = [storage.below(output, path) for path in paths]
    aside = replaced_directory(output)
    listing = ReplacedListing(tuple(relatives), _finished_training(output))
    storage.write_text(storage.join(aside, REPLACED_LIST), json.dumps(listing.to_json(), indent=2))
    storage.move_below(output, aside, relatives)
    internal_path(output, REPLACED)  # the NOTICE, moved aside with the rest, written again


def drop_replaced(output: str) -> None:
    """Delete the earlier training set aside in OUTPUT, once the training replacing it has written all its
    outputs: its list first, which says that it is still to be settled, so that a process killed while the
    rest is deleted leaves nothing `settle_replaced` would move back over the new training."""
    aside = replaced_directory(output)
    storage.remove_file(storage.join(aside, REPLACED_LIST))
    storage.remove_tree(aside)


def settle_replaced(output: str) -> str | None:
    """Settle the earlier training that a --replace training set aside in OUTPUT (`set_aside`), once that
    training has stopped: "finished" where it wrote its model and its privacy.json, the last of its outputs
    (others than the earlier ones: their digest is in the list), but was stopped before `drop_replaced`
    (which this does), "kept" where it left a checkpoint to resume (--resume finishes it, then deletes them),
    "restored" where it stopped for good (its own files are deleted and the earlier ones moved back to their
    places); None where nothing waits to be settled (what is left of the folder, a deletion by
    `drop_replaced` cut short or a list never written, is removed). `settled_text` says which."""
    aside = replaced_directory(output)
    listing = storage.join(aside, REPLACED_LIST)
    if storage.kind(listing) != "file":
        storage.remove_tree(aside)
        return None
    listed = ReplacedListing.from_json(json.loads(storage.read_text(listing)), listing)
    moved, finished = listed.files, _finished_training(output)
    if finished is not None and finished != listed.finished_training:
        drop_replaced(output)
        return "finished"
    if _resumable_checkpoint(output):
        return "kept"
    newer = [
        path
        for path in storage.list_files(output, skip_hidden=True)
        if written_by_training(relative := storage.below(output, path)) and relative not in moved
    ]
    storage.remove_written(output, newer)
    still_aside = [relative for relative in moved if storage.kind(storage.join(aside, relative)) == "file"]
    storage.move_below(aside, output, still_aside)
    storage.remove_tree(aside)
    return "restored"


def _finished_training(output: str) -> str | None:
    """A digest of OUTPUT's model.keras and privacy.json (written last), where both are there: what tells a
    training set aside from the one that replaced it."""
    files = [storage.join(output, name) for name in ("model.keras", "privacy.json")]
    if any(storage.kind(path) != "file" for path in files):
        return None
    return ":".join(storage.sha256(path) for path in files)


def settled_text(output: str, outcome: str | None) -> str | None:
    """What a log says of a `settle_replaced` outcome in OUTPUT (None: nothing was settled)."""
    return {
        "restored": f"{output}: a --replace training stopped before it finished: the training it replaced is back "
        f"in place",
        "kept": _kept_text(output),
        "finished": f"{output}: a --replace training had finished: the training it replaced, set aside, is deleted",
    }.get(outcome or "")


def replaced_kept(output: str) -> str:
    """Where OUTPUT keeps a training that an interrupted --replace training set aside, what a message says
    of it; else ""."""
    return _kept_text(output) if storage.kind(replaced_directory(output)) != "missing" else ""


def _kept_text(output: str) -> str:
    return f"{replaced_directory(output)} keeps the training it replaces until it finishes"


def replaced_directory(output: str) -> str:
    """OUTPUT/internal/replaced/, named, not made."""
    return storage.join(output, INTERNAL_DIR, REPLACED)


def _resumable_checkpoint(output: str) -> bool:
    """Whether OUTPUT/internal/checkpoints/ holds a checkpoint's state, which a --resume reads: a first
    checkpoint cut short (a full disk, a kill) leaves its files and no state."""
    directory = checkpoints_directory(output)
    return any(storage.kind(storage.join(directory, name)) == "file" for name in (STATE_FILE, NEXT_STATE_FILE))


# What a saved model's archive says instead of the clock time of saving: the earliest time a zip entry
# can hold, and Keras' metadata.json "date_saved" at that time
NEUTRAL_ZIP_TIME = (1980, 1, 1, 0, 0, 0)
NEUTRAL_DATE_SAVED = "1980-01-01@00:00:00"


def checkpoints_directory(output: str) -> str:
    """OUTPUT/internal/checkpoints/, named, not made."""
    return storage.join(output, INTERNAL_DIR, CHECKPOINTS)


def internal_path(output: str, *parts: str) -> str:
    """A path under OUTPUT/internal/, whose NOTICE says it is never published (written on first use)."""
    notice = storage.join(output, INTERNAL_DIR, "NOTICE.txt")
    if storage.kind(notice) == "missing":
        storage.write_text(notice, NOTICE)
    return storage.join(output, INTERNAL_DIR, *parts)


def without_clock_times(path: str) -> None:
    """Rewrite the Keras archive at `path` (model.keras, a zip file) with every clock time in it made
    neutral: Keras writes the time of saving into metadata.json ("date_saved") and into the weights'
    zip entry, and the time its temporary files were written into an assets entry. Saved at the end of
    the training, the model would otherwise tell when the training ended. Every entry keeps its name,
    place, compression, permissions and content (metadata.json all but its date)."""
    with storage.open_input(path) as handle:
        saved = zipfile.ZipFile(io.BytesIO(handle.read()))
    rewritten = io.BytesIO()
    with saved, zipfile.ZipFile(rewritten, "w") as archive:
        for entry in saved.infolist():
            content = saved.read(entry)
            if entry.filename == "metadata.json" and "date_saved" in (metadata := json.loads(content)):
                content = json.dumps({**metadata, "date_saved": NEUTRAL_DATE_SAVED}).encode()
            neutral = zipfile.ZipInfo(entry.filename, date_time=NEUTRAL_ZIP_TIME)
            neutral.compress_type, neutral.external_attr = entry.compress_type, entry.external_attr
            archive.writestr(neutral, content)
    storage.write_whole(path, lambda handle: handle.write(rewritten.getvalue()))


METRICS_FILE = "metrics.json"
METRICS_FORMAT_VERSION = 1  # of metrics.json; a file without it is its predecessor (the same keys)


class Evaluation(NamedTuple):
    """One evaluation on --eval-data, as `Evaluations` holds it in its file: the loss, the task's other
    metrics by name, and the step it ran after."""

    loss: float
    metrics: Mapping[str, Any]  # the task's metrics but the loss, named as the task names them
    step: int | None  # the step it ran after; None: a pretrained model's, before the first step

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Evaluation:
        """An evaluation of the file (a KeyError where it lacks its loss)."""
        metrics = {name: value for name, value in data.items() if name not in ("loss", "step")}
        return cls(data["loss"], metrics, data.get("step"))


@dataclasses.dataclass(frozen=True)
class Evaluations:
    """A training's evaluations on --eval-data: each one (its step, loss and the task's metrics, named as the
    task names them), the last, and a pretrained model's before the first step (`pretrained_eval`, stated
    by a training from --pretrained only, None where it had no evaluation data)."""

    eval: tuple[Mapping[str, Any], ...]  # each evaluation: its step, loss and the task's metrics
    final: Mapping[str, Any] | None  # the last evaluation
    pretrained_eval: Mapping[str, Any] | None = None  # the pretrained model's, before the first step
    from_pretrained: bool = False  # whether the training states `pretrained_eval` (no key of its own)

    @property
    def points(self) -> tuple[Evaluation, ...]:
        """Each evaluation, typed."""
        return tuple(Evaluation.from_json(each) for each in self.eval)

    @property
    def last(self) -> Evaluation | None:
        """The last evaluation, typed (None where there is none)."""
        return Evaluation.from_json(self.final) if self.final else None

    @property
    def before_training(self) -> Evaluation | None:
        """A pretrained model's evaluation before the first step, typed (None where there is none)."""
        return Evaluation.from_json(self.pretrained_eval) if self.pretrained_eval else None

    def to_json(self) -> dict[str, Any]:
        """As metrics.json and OUTPUT/internal/evaluation.json hold them."""
        stated = {"pretrained_eval": self.pretrained_eval} if self.from_pretrained else {}
        return {**stated, "eval": list(self.eval), "final": self.final}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Evaluations:
        return cls(
            tuple(data.get("eval") or ()),
            data.get("final"),
            data.get("pretrained_eval"),
            "pretrained_eval" in data,
        )


@dataclasses.dataclass(frozen=True)
class TrainingMetrics:
    """metrics.json: what a training ran with (`settings`: the batches, the model, the optimizer, whether the
    evaluation data was declared public, ..., in the file's order), and its evaluations where that data was
    public (else `evaluation` says where the internal ones are)."""

    settings: Mapping[str, Any]  # what the training ran with, each a key of the file in its order
    evaluations: Evaluations | None  # where the evaluation data was declared public: its keys, in the file
    evaluation: str | None = None  # where the internal evaluations are, where they are not here

    @property
    def eval_data_public(self) -> bool:
        """Whether the evaluation data was declared public (a file of madp before it said so: not)."""
        return self.settings.get("eval_data_public") is True

    def to_json(self) -> dict[str, Any]:
        held = self.evaluations.to_json() if self.evaluations is not None else {}
        noted = {} if self.evaluation is None else {"evaluation": self.evaluation}
        return {"format_version": METRICS_FORMAT_VERSION, **self.settings, **held, **noted}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str) -> TrainingMetrics:
        """The metrics of a parsed metrics.json (`where` names it in errors)."""
        version = data.get("format_version", METRICS_FORMAT_VERSION)
        if type(version) is not int or not 1 <= version <= METRICS_FORMAT_VERSION:
            raise InputError(
                f"{where}: format_version {version!r} is not one this madp reads (it reads "
                f"{METRICS_FORMAT_VERSION}): written by another madp; read it with that madp"
            )
        evaluated = {"eval", "final", "pretrained_eval"} & set(data)
        settings = {k: v for k, v in data.items() if k not in evaluated | {"format_version", "evaluation"}}
        return cls(settings, Evaluations.from_json(data) if evaluated else None, data.get("evaluation"))


@dataclasses.dataclass(frozen=True)
class TrainingResult:
    """What a training returns and `madp train` prints: its metrics.json (less the file's format_version),
    its timings (internal/timing.json's, never published), its privacy.json and, where it trained rows with
    weight 0, where they are listed (internal)."""

    metrics: TrainingMetrics
    wall_time_s: float
    steps_per_s: float
    privacy: Mapping[str, Any]  # privacy.json's content: the plan, or that the training is not private
    rejected: str | None = None

    def to_json(self) -> dict[str, Any]:
        """As `madp train` prints it."""
        printed = {key: value for key, value in self.metrics.to_json().items() if key != "format_version"}
        printed.update(wall_time_s=self.wall_time_s, steps_per_s=self.steps_per_s, privacy=dict(self.privacy))
        if self.rejected is not None:
            printed["rejected"] = self.rejected
        return printed

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str) -> TrainingResult:
        """The result of a training as printed (`where` names it in errors)."""
        ours = ("wall_time_s", "steps_per_s", "privacy", "rejected")
        metrics = TrainingMetrics.from_json({k: v for k, v in data.items() if k not in ours}, where)
        return cls(metrics, data["wall_time_s"], data["steps_per_s"], data["privacy"], data.get("rejected"))


def read_metrics(output: str) -> TrainingMetrics | None:
    """OUTPUT/metrics.json of a training (None where there is none)."""
    path = storage.join(output, METRICS_FILE)
    stated = _json_object(path)
    return TrainingMetrics.from_json(stated, path) if stated else None


def write_metrics(output: str, metrics: TrainingMetrics) -> None:
    storage.write_text(storage.join(output, METRICS_FILE), json.dumps(metrics.to_json(), indent=2, allow_nan=False))


def evaluations_of(output: str, internal: bool) -> Evaluations | None:
    """A training output's evaluations: its metrics.json's where the evaluation data was declared public,
    else OUTPUT/internal/evaluation.json's, which only an `internal` reader gets (None where neither holds
    any). A metrics.json that does not say its evaluation data was public (`eval_data_public`; written by
    a madp that published every evaluation) is read as internal."""
    metrics = read_metrics(output)
    in_metrics = metrics.evaluations if metrics is not None and metrics.evaluations is not None else None
    if in_metrics is not None and not in_metrics.eval:
        in_metrics = None
    if in_metrics is not None and metrics is not None and metrics.eval_data_public:
        return in_metrics
    kept = _json_object(storage.join(output, INTERNAL_DIR, EVALUATION_FILE))
    if internal and kept:
        return Evaluations.from_json(kept)
    return in_metrics if internal else None


def evaluation_of(output: str, internal: bool) -> dict:
    """`evaluations_of` as JSON ({"eval": [...], "final": {...}, "pretrained_eval": ...}; {} where there are
    none). What a published page may show: `evaluation_of("run/train", internal=False).get("final")`."""
    evaluations = evaluations_of(output, internal)
    return {} if evaluations is None else evaluations.to_json()


def _json_object(path: str) -> dict:
    """A JSON object madp wrote ({} where the file is missing), or an InputError naming the file."""
    if storage.kind(path) != "file":
        return {}
    try:
        value = json.loads(storage.read_text(path))
    except ValueError as error:
        raise InputError(f"{path}: not the JSON madp wrote ({error})") from None
    if not isinstance(value, dict):
        raise InputError(f"{path}: not the JSON object madp wrote")
    return value
