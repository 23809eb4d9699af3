"""The trainings ledger: the private trainings on one selection (`SELECTED/trainings.jsonl`, one
`TrainingEntry` a line), which every later training on it composes with (`composed_plan`). No TensorFlow
here: `madp batch` and `madp run` read it to keep the checkpoints it names from being stranded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Iterable
from typing import Any

from madp.accounting.calibrate import composed_epsilon
from madp.accounting.evr import unamplified
from madp.accounting.mechanisms import Mechanism
from madp.accounting.monte_carlo import MinSepProcess
from madp.core import storage
from madp.core.batch_files import TRAININGS_FILE, read_batch_report
from madp.core.errors import InputError
from madp.training.outputs import checkpoints_directory
from madp.training.plan import Composition, Guarantee, PrivacyPlan, parameters_of, to_json

log = logging.getLogger("madp.train")

STARTED, FINISHED = "started", "finished"  # a ledger entry's state: steps may have run / all T steps ran
_LACKS_BATCH_FILES = "an entry lacks the batch files it trained on or their truncation probability"


def _not_a_ledger(path: str, reason: str) -> InputError:
    return InputError(f"{path}: not a ledger madp wrote ({reason})")


def _is_probability(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= 1


@dataclasses.dataclass(frozen=True)
class TrainingEntry:
    """One private training in a trainings ledger (a line of `trainings.jsonl`, `record_training` writes
    it): what it trained on and under which plan, and how far it got. Its JSON (`to_json`) is the line's
    object, its fields in this order. An entry that an earlier madp wrote lacks the fields added since:
    they read as what that madp did (`from_json`): state "finished", resumable_from 0, the others None."""

    training: str | None  # the training's unique id (None: entered before trainings had one)
    output: str | None  # where it writes, or what it is ("Python API")
    state: str  # "started" (steps may have run) or "finished" (all T steps ran); earlier madp entered finished ones
    batches: str | None  # the batch output it trained on
    batch_files: str | None  # the digest of that output's batch files' SHA-256: the identity of its sampling
    mechanism: str  # the plan's mechanism
    parameters: dict[str, Any]  # the plan's parameters, as its JSON holds them
    noise_multiplier: float  # the plan's sigma
    epsilon: float | None  # the plan's own epsilon
    delta: float | None  # the plan's own delta
    truncation_probability: float | None  # rho: the probability some step of its batches exceeded B_max
    # the earliest step a continuation may restart at (entries of earlier madp: any step)
    resumable_from: int
    run: str | None  # the run (step object) that trains it now

    @classmethod
    def from_json(cls, data: Any, where: str) -> TrainingEntry:
        """An entry of the ledger file `where`, checked as far as the ledger's readers rely on it."""
        if not (isinstance(data, dict) and {"mechanism", "parameters", "noise_multiplier"} <= set(data)):
            raise _not_a_ledger(where, "an entry lacks mechanism, parameters or sigma")
        resumable_from = data.get("resumable_from", 0)
        if type(resumable_from) is not int:
            raise _not_a_ledger(where, "an entry's resumable_from is not a step count")
        batch_files, rho = data.get("batch_files"), data.get("truncation_probability")
        if not isinstance(batch_files, str | None) or not (rho is None or _is_probability(rho)):
            raise _not_a_ledger(where, _LACKS_BATCH_FILES)
        return cls(
            training=data.get("training"),
            output=data.get("output"),
            state=data.get("state", FINISHED),
            batches=data.get("batches"),
            batch_files=batch_files,
            mechanism=data["mechanism"],
            parameters=data["parameters"],
            noise_multiplier=data["noise_multiplier"],
            epsilon=data.get("epsilon"),
            delta=data.get("delta"),
            truncation_probability=rho,
            resumable_from=resumable_from,
            run=data.get("run"),
        )

    def to_json(self) -> dict[str, Any]:
        """The entry as its ledger line holds it, ready for json.dumps."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class Ledger:
    """Where the private trainings on a batch output are entered: beside the selection it was made from
    (`madp bound`'s OUTPUT: `SELECTED/trainings.jsonl`, under that output's lock), one ledger for every
    batch output made from it, since a training on any of them releases the same users' records. An
    entry names the batch files it trained on (`batch_files`: a digest of their SHA-256, internal like
    the batch report), so that trainings on one sampling (a batch output, or a copy of it) are told from
    trainings on independent batches of the selection. The batch output's own ledger
    (`BATCHES/trainings.jsonl`, which madp kept before the selection did) is read too: its entries
    trained on these batches."""

    selection: str  # the bound output the batches were made from: the ledger's folder, whose lock guards it
    batches: str  # the batch output trained on
    batch_files: str  # the digest of its batch files' SHA-256: the identity of its sampling

    @property
    def path(self) -> str:
        return storage.join(self.selection, TRAININGS_FILE)


def ledger_of(batches_dir: str) -> Ledger:
    """The ledger of the trainings on a `madp batch` output (`Ledger`), as its report names it."""
    report = read_batch_report(batches_dir)
    listed = "\n".join(entry.sha256 for entry in report.files)
    return Ledger(report.selected, batches_dir, hashlib.sha256(listed.encode()).hexdigest())


def trainings_ledger(batches_dir: str) -> Ledger:
    """The ledger a private training on a `madp batch` output enters; refused where its selection is not
    there to keep it (moved or removed since batching): the training would miss the earlier ones."""
    ledger = ledger_of(batches_dir)
    if not ledger.selection or storage.kind(ledger.selection) != "directory":
        raise InputError(
            f"the trainings ledger of {batches_dir} is kept with the selection it was made from, "
            f"{ledger.selection or '(none named in its report)'}, which is not there (moved or removed): a private "
            f"training composes with every earlier one on that selection, which madp reads there; restore it "
            f"at that path, or train where it is"
        )
    return ledger


def read_entries(path: str) -> list[TrainingEntry]:
    """The entries of one ledger file, checked ([] where there is none)."""
    if storage.kind(path) != "file":
        return []
    try:
        lines = [json.loads(line) for line in storage.read_text(path).splitlines() if line.strip()]
    except ValueError as error:
        raise InputError(f"{path}: not a ledger madp wrote ({error}); the earlier trainings are unknown") from None
    return [TrainingEntry.from_json(line, path) for line in lines]


def _selection_entries(ledger: Ledger) -> list[TrainingEntry]:
    trainings = read_entries(ledger.path) if ledger.selection else []
    if any(t.batch_files is None or t.truncation_probability is None for t in trainings):
        raise _not_a_ledger(ledger.path, _LACKS_BATCH_FILES)
    return trainings


def earlier_trainings(ledger: Ledger) -> list[TrainingEntry]:
    """The private trainings on the ledger's selection (`record_training`), oldest first, each naming the
    batch files it trained on: first those of the batch output's own ledger, as trainings on these batches
    (unless the selection's ledger holds their entry since: a continuation), then the selection's."""
    shared = _selection_entries(ledger)
    return _batch_output_entries(ledger, {t.training for t in shared}) + shared


def entry_of(ledger: Ledger, training: str | None) -> TrainingEntry | None:
    """The ledger's (first) entry of the training with this id, where it holds one."""
    return next((t for t in earlier_trainings(ledger) if t.training == training), None)


def _batch_output_entries(ledger: Ledger, entered: set[str | None]) -> list[TrainingEntry]:
    """The entries of the batch output's own ledger (madp kept it there before the selection did), as
    trainings on these batches, but for the trainings in `entered`."""
    return [
        dataclasses.replace(t, batches=ledger.batches, batch_files=ledger.batch_files)
        for t in read_entries(storage.join(ledger.batches, TRAININGS_FILE))
        if t.training not in entered
    ]


def stranded_checkpoints(batches_dir: str, trainings: Iterable[str] = ()) -> list[str]:
    """The checkpoints (OUTPUT/internal/checkpoints) that re-making the batches in BATCHES would strand, where
    they are there: those of the private trainings its ledger holds as started, not finished, on the batch
    files BATCHES holds now (a copy of them too), and those of the OUTPUTs in `trainings` (known to train on
    BATCHES, a non-private training too). An interrupted training resumes only on the batches it trained on.
    A ledger entry's OUTPUT is read as the training named it (a relative one from this directory)."""
    try:
        ledger = ledger_of(batches_dir)
    except InputError:  # no finished batch output there (no report.json): no training resumes on it
        interrupted = []
    else:
        interrupted = [
            str(t.output)
            for t in earlier_trainings(ledger)
            if t.state == STARTED and t.batch_files == ledger.batch_files
        ]
    folders = dict.fromkeys(checkpoints_directory(output) for output in [*trainings, *interrupted])
    return [folder for folder in folders if storage.kind(folder) != "missing"]


def refuse_stranding(checkpoints: list[str], remaking: str, resuming: str) -> None:
    """Refuse, naming the first of `checkpoints` (`stranded_checkpoints`) and the ways out, a command that
    would re-make the batches they resume on: `remaking` says what would, `resuming` how to resume instead."""
    if checkpoints:
        raise InputError(
            f"{checkpoints[0]} holds the checkpoint of an interrupted training: {remaking} and re-make what that "
            f"training trained on, so that it could never be resumed. {resuming}, or move {checkpoints[0]} away "
            f"to train afresh (the trainings ledger keeps the interrupted training: a new one composes with it)"
        )


def _truncation_probability(plan: PrivacyPlan) -> float:
    """rho: the probability that some step of the plan's batches sampled more than B_max units (0 where the
    guarantee does not pay for truncation), which its truncation_delta is rho (1 + e^epsilon) of."""
    return plan.truncation_delta / (1 + math.exp(plan.epsilon))


def record_training(
    ledger: Ledger, training: str, output: str, plan: PrivacyPlan, state: str, resumable_from: int, run: str
) -> None:
    """Enter the private training `training` (a unique id; `output`: where it writes, or what it is) in the
    ledger of its selection, or set the state of its entry. A training is entered before its first noisy
    update: whatever it released before an interruption (evaluations, checkpointed models) is then
    covered by its entry, which every later training on the selection composes with, finished or not.
    `resumable_from`: the earliest step a continuation of the entry may restart at (no step it may
    have released runs twice); `run`: the run (step object) that trains it now. The entries of the
    batch output's own ledger join the selection's (trainings on these batches, of this plan's
    mechanism: `composed_plan` refuses others), so that trainings on other batches of the selection
    compose with them too, and a new batching into that output loses none of them."""
    rho = _truncation_probability(plan)
    entry = TrainingEntry(
        training=training,
        output=output,
        state=state,
        batches=ledger.batches,
        batch_files=ledger.batch_files,
        mechanism=plan.mechanism,
        parameters=to_json(plan.parameters),
        noise_multiplier=plan.noise_multiplier,
        epsilon=plan.epsilon,
        delta=plan.delta,
        truncation_probability=rho,
        resumable_from=resumable_from,
        run=run,
    )
    shared = _selection_entries(ledger)
    entered = {t.training for t in shared} | {training}
    own = [dataclasses.replace(t, truncation_probability=rho) for t in _batch_output_entries(ledger, entered)]
    trainings = own + [t for t in shared if t.training != training] + [entry]
    storage.write_text(ledger.path, "".join(json.dumps(t.to_json()) + "\n" for t in trainings))


def composed_plan(plan: PrivacyPlan, *, training: str, retrain: bool) -> PrivacyPlan:
    """The plan of a private training on batches whose selection earlier private trainings used (the ledger
    of `plan.trained_on`'s selection: its entries other than `training`'s own, finished or interrupted),
    released with the composition of all of them as its (epsilon, delta) (the single training's figures
    kept under `single_training`): whoever publishes this model next to the earlier ones gets no more than
    that. Refused where the guarantee relies on the secret sampling and an earlier training used these
    batches (re-using that sampling leaks far more than twice epsilon) unless `retrain`; refused without a
    composed figure (other mechanisms on one batch output); refused where the selection is not there to
    keep the ledger."""
    if not plan.trained_on:
        return plan
    ledger = trainings_ledger(plan.trained_on)
    earlier = [t for t in earlier_trainings(ledger) if t.training != training]
    if not earlier:
        return plan
    same = sum(t.batch_files == ledger.batch_files for t in earlier)
    composed = composition(plan, earlier, ledger.batch_files)
    outputs = ", ".join(str(t.output) for t in earlier)
    said = (
        f"{len(earlier)} earlier private training(s) on the selection {ledger.selection} ({outputs}), {same} of "
        f"them on these batches"
    )
    if composed is None:
        raise InputError(
            f"{said}, with another mechanism or parameters than this training's on one batch output, which madp "
            f"has no composed figure for: train with their mechanism and parameters, or on batches made anew "
            f"from the selection (composed with them as an independent release)"
        )
    figure = f"together they are ({composed.epsilon:.4g}, {composed.delta:.3g})-DP"
    if same and plan.relies_on_secret_sampling and not retrain:
        raise InputError(
            f"{said}: {figure}. {plan.mechanism} relies on the secret sampling of these batches and training "
            f"on them again re-uses it, which composes far worse than independent batches: retrain (--retrain, "
            f"retrain=True) to accept that composed guarantee, or train on batches made anew from the selection "
            f"(composed with these trainings as an independent release)"
        )
    log.warning("%s: %s; the plan states that composed guarantee", said, figure)
    return dataclasses.replace(
        plan,
        epsilon=composed.epsilon,
        delta=composed.delta,
        single_training=Guarantee(plan.epsilon, plan.delta),
        composition=composed,
    )


def _equivalent_noise_multiplier(sigmas: list[float]) -> float:
    """(sum sigma_i^-2)^(-1/2): one release at it dominates the releases of one sampling at each sigma_i."""
    return sum(sigma**-2 for sigma in sigmas) ** -0.5


def _formal_mechanism(entry: TrainingEntry) -> Mechanism:
    """What a ledger entry's training is accounted as (a Monte Carlo plan's unamplified fallback)."""
    try:
        parameters = parameters_of(entry.mechanism, entry.parameters)
    except (KeyError, TypeError, AttributeError) as error:
        raise InputError(
            f"the trainings ledger's entry of {entry.output!r} holds no parameters of a mechanism madp "
            f"accounts ({type(error).__name__}: {error}): not a ledger madp wrote"
        ) from None
    return unamplified(parameters) if isinstance(parameters, MinSepProcess) else parameters


def _one_mechanism(entries: list[TrainingEntry], mechanism: str, parameters: dict[str, Any]) -> bool:
    return all(t.mechanism == mechanism and t.parameters == parameters for t in entries)


def _largest_truncation_probability(entries: list[TrainingEntry]) -> float:
    """The largest rho of the entries of one other batch output: entries of the selection's ledger, which
    each record theirs (`_selection_entries`)."""
    return max(t.truncation_probability for t in entries if t.truncation_probability is not None)


def composition(plan: PrivacyPlan, earlier: list[TrainingEntry], batch_files: str) -> Composition | None:
    """The guarantee of this training, on the batches of `batch_files`, and the `earlier` ones (ledger
    entries) on the same selection, released together.

    Trainings on one batch output share its sampling: n Gaussian releases of one sampled batch with noise
    multipliers sigma_i are n stacked queries of sensitivity 1 each, dominated by the same mechanism at
    sigma = (sum sigma_i^-2)^(-1/2). With amplification this is far worse than n times epsilon (the same
    secret sampling is used again). Trainings on independent batch outputs of the selection (each sampled
    with a key of its own) are independent mechanisms on the same users, each at its outputs' equivalent
    sigma: their privacy loss distributions compose (PLD). Truncation adds its delta once: the event that
    some step of any of these batch outputs sampled more than B_max units has a probability of at most the
    sum of theirs (rho, the same for both neighbours), which costs rho (1 + e^epsilon). A batch output
    whose trainings differ in mechanism or parameters has no such closed form: None."""
    groups: dict[str | None, list[TrainingEntry]] = {}
    for entry in earlier:
        groups.setdefault(entry.batch_files, []).append(entry)
    these = groups.pop(batch_files, [])
    if not _one_mechanism(these, plan.mechanism, to_json(plan.parameters)):  # the plan's, as the ledger holds them
        return None
    if not all(_one_mechanism(group, group[0].mechanism, group[0].parameters) for group in groups.values()):
        return None
    sigma = _equivalent_noise_multiplier([*(t.noise_multiplier for t in these), plan.noise_multiplier])
    releases = [(plan.formal_mechanism, sigma)] + [
        (_formal_mechanism(group[0]), _equivalent_noise_multiplier([t.noise_multiplier for t in group]))
        for group in groups.values()
    ]
    mechanism_delta = plan.delta - plan.truncation_delta
    composed = composed_epsilon(releases, mechanism_delta)
    rho = _truncation_probability(plan) + sum(_largest_truncation_probability(group) for group in groups.values())
    monte_carlo = "bandmf-minsep" in {plan.mechanism, *(t.mechanism for t in earlier)}
    return Composition(
        trainings=len(earlier) + 1,
        outputs=tuple(t.output for t in earlier),
        equivalent_noise_multiplier=sigma,
        epsilon=composed,
        delta=mechanism_delta + rho * (1 + math.exp(composed)),
        accountant="unamplified fallback (PLD)" if monte_carlo else "PLD",
        independent_batches=len(groups) or None,
    )
