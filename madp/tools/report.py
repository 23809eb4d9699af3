"""`madp report RUN_DIR`: one self-contained HTML page (PNG plots inlined) about a `madp run`.

Every number and plot comes from the run's JSON reports: bound/report.json (histograms of
records per user and of users per record, before and after bounding), batches/report.json
(batch sizes per step, gaps between a user's participations), calibration.json (sigma and the
sigma-epsilon curve), train/ and baseline/ metrics.json (evaluation curves), audit/audit.json
(the measured lower bound beside the claim) and recommend-k.json (the sweep that chose k, when
`madp recommend-k --write-config` planned the run). Sections whose report is missing are listed as such.
A published page holds only what the guarantee covers: the realized sampling of an amplified
mechanism, the non-private baseline, a non-private audit and evaluations on data not declared public
appear on an `--internal` page only.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import json
from collections.abc import Mapping

from madp.core import storage
from madp.core.errors import InputError
from madp.core.randomness import DETERMINISTIC
from madp.core.reports import AuditReport, BatchReport, BoundReport
from madp.tools.planning.recommend import SWEEP_FILE, Recommendation
from madp.training.outputs import Evaluation, Evaluations, TrainingMetrics, evaluations_of
from madp.training.plan import Guarantee, PrivacyPlan, stated_plan

SOURCES = {
    "bound": "bound/report.json",
    "batches": "batches/report.json",
    "calibration": "calibration.json",
    "train": "train/metrics.json",
    "privacy": "train/privacy.json",
    "baseline": "baseline/metrics.json",
    "audit": "audit/audit.json",
    "recommend": SWEEP_FILE,  # `madp recommend-k --write-config`: the sweep that chose k
}


QUALITY_METRICS = ("accuracy", "macro_f1", "bits_per_byte", "perplexity")  # what metrics.json's final holds


def _load(run_dir: str) -> dict[str, dict]:
    found = {}
    for name, relative in SOURCES.items():
        path = storage.join(run_dir, relative)
        if storage.kind(path) == "file":
            try:
                found[name] = json.loads(storage.read_text(path))
            except ValueError as error:
                raise InputError(f"{path}: not a report madp wrote (not JSON: {error})") from error
            if not isinstance(found[name], dict):
                raise InputError(f"{path}: not a report madp wrote (a JSON {type(found[name]).__name__})")
    return found


@dataclasses.dataclass(frozen=True)
class RunReports:
    """The reports of a run directory the page is made from (None where the run has none), and the
    evaluations of each training the page may show."""

    bound: BoundReport | None = None
    batches: BatchReport | None = None
    calibration: PrivacyPlan | None = None
    privacy_stated: bool = False  # train/privacy.json is there (a non-private training's states no plan)
    privacy: PrivacyPlan | None = None
    train: TrainingMetrics | None = None
    baseline: TrainingMetrics | None = None
    evaluations: Mapping[str, Evaluations] = dataclasses.field(default_factory=dict)  # train, baseline
    audit: AuditReport | None = None  # audit/audit.json
    recommend: Recommendation | None = None  # recommend-k.json

    @classmethod
    def from_json(cls, data: Mapping[str, dict], where: str, internal: bool) -> RunReports:
        """The reports of the run directory `where`, each parsed file of `data` (`_load`: by its name in
        SOURCES) read as its stage wrote it; the evaluations of data not declared public only where
        `internal`."""
        path = {name: storage.join(where, relative) for name, relative in SOURCES.items()}
        metrics = {
            name: TrainingMetrics.from_json(data[name], path[name]) for name in ("train", "baseline") if name in data
        }
        evaluations = {name: evaluations_of(storage.join(where, name), internal) for name in metrics}
        return cls(
            bound=BoundReport.from_json(data["bound"], path["bound"]) if "bound" in data else None,
            batches=BatchReport.from_json(data["batches"], path["batches"]) if "batches" in data else None,
            calibration=_plan(data.get("calibration"), "calibration"),
            privacy_stated=bool(data.get("privacy")),
            privacy=_plan(data.get("privacy"), "privacy"),
            train=metrics.get("train"),
            baseline=metrics.get("baseline"),
            evaluations={name: shown for name, shown in evaluations.items() if shown is not None},
            audit=AuditReport.from_json(data["audit"], path["audit"]) if "audit" in data else None,
            recommend=Recommendation.from_json(data["recommend"], path["recommend"]) if "recommend" in data else None,
        )

    @property
    def released(self) -> PrivacyPlan | None:
        """The plan the trained model states (train/privacy.json), else the one it is to train with."""
        return self.privacy if self.privacy_stated else self.calibration


def _plan(stated: dict | None, name: str) -> PrivacyPlan | None:
    """The plan of a privacy or calibration file; None without that file, or for a non-private training."""
    if not stated:
        return None
    try:
        return stated_plan(stated)
    except ValueError as error:
        raise InputError(f"{SOURCES[name]}: {error}") from None


def _png(figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _counts(histogram: Mapping[str, int]) -> tuple[list[int], list[int]]:
    pairs = sorted((int(value), count) for value, count in histogram.items())
    return [v for v, _ in pairs], [c for _, c in pairs]


def shows_sampling(plan: PrivacyPlan | None, batches: BatchReport | None) -> bool:
    """Whether the realized sampling (batch sizes per step, participation gaps) may be on a published page:
    only when no guarantee relies on keeping it secret (deterministic batches, or unamplified accounting).
    `plan`: the plan released with the model (`RunReports.released`)."""
    if plan is not None:
        return not plan.relies_on_secret_sampling
    return batches is not None and batches.sampling == DETERMINISTIC


def shows_baseline(reports: RunReports, internal: bool) -> bool:
    """Whether the non-private baseline may be on the page: only an internal one. The baseline saw the
    records without noise, so its metrics can tell a dataset from its neighbour (one user's records
    made extreme move its held-out accuracy); like a non-private audit, it is never published."""
    return internal and reports.baseline is not None


def _models(reports: RunReports, internal: bool) -> tuple[str, ...]:
    """The trainings whose metrics the page shows: the private one, and the baseline on an internal page."""
    return ("train", "baseline") if shows_baseline(reports, internal) else ("train",)


def shows_audit(reports: RunReports, internal: bool) -> bool:
    """Whether the audit may be on a published page: only if its model was private (its numbers are then a
    second private release of the records, see the page's note), or on an internal page."""
    return reports.audit is not None and (internal or reports.audit.audit_model_private)


def published_with_audit(plan: PrivacyPlan | None, audit: AuditReport | None) -> Guarantee | None:
    """The (epsilon, delta) of the model and a private audit published together: the audit trained a second
    model on the same records (and canaries), so its figures beside the model release both trainings.
    Basic composition (the sum of the epsilons and of the deltas) bounds that for any two mechanisms.
    None without a plan or a private audit (a non-private audit is never published)."""
    if plan is None or audit is None or not audit.audit_model_private or audit.claimed_epsilon is None:
        return None
    return Guarantee(plan.epsilon + float(audit.claimed_epsilon), plan.delta + float(audit.delta))


def _figures(reports: RunReports, plt, internal: bool) -> list[tuple[str, str, str]]:
    """(title, caption, base64 PNG) of every plot the reports allow (the realized sampling only if
    `shows_sampling` or `internal`)."""
    figures = []
    if reports.recommend is not None and reports.recommend.sweep:
        figures.append(_choosing_k(reports.recommend, plt))
    if reports.bound is not None:
        figures += _bound_figures(reports.bound, plt)
    if reports.batches is not None and (internal or shows_sampling(reports.released, reports.batches)):
        figures += _sampling_figures(reports.batches, plt)
    if reports.calibration is not None and reports.calibration.epsilon_curve:
        figures.append(_calibration_figure(reports.calibration, plt))
    models = _models(reports, internal)
    curves = {name: reports.evaluations[name].points for name in models if name in reports.evaluations}
    curves = {name: points for name, points in curves.items() if points}
    if curves:
        figures.append(_training_figure(curves, _pretrained_eval(reports, models), plt))
    if shows_audit(reports, internal) and reports.audit is not None and reports.audit.per_canary:
        figures.append(_audit_figure(reports.audit, plt))
    return figures


def _bound_figures(bound: BoundReport, plt) -> list[tuple[str, str, str]]:
    """Records per user before and after bounding, and the kept fraction by arity."""
    hist = bound.histograms
    figure, axis = plt.subplots(figsize=(7, 4))
    for histogram, label in (
        (hist.records_per_user_input, "input"),
        (hist.records_per_user_selected, "after bounding"),
    ):
        values, counts = _counts(histogram)
        shown = [(v, c) for v, c in zip(values, counts) if v >= 1]  # log axis; users left with 0: caption
        axis.plot([v for v, _ in shown], [c for _, c in shown], marker="o", markersize=3, label=label)
    k = bound.parameters.max_contributions
    axis.axvline(k, color="grey", linestyle="--", label=f"K = {k}")
    axis.set(xscale="log", yscale="log", xlabel="records per user", ylabel="users")
    axis.legend()
    without = dict(zip(*_counts(hist.records_per_user_selected))).get(0, 0)  # users by their records
    figures = [
        (
            "Records per user",
            f"Users by their number of records in the input and after bounding; "
            f"{without:,} users have no selected record (bound/report.json).",
            _png(figure),
        )
    ]
    plt.close(figure)
    values, inputs = _counts(hist.records_by_users_input)
    selected = dict(zip(*_counts(hist.records_by_users_selected)))
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.bar([str(v) for v in values], [selected.get(v, 0) / n for v, n in zip(values, inputs)])
    axis.set(xlabel="users per record", ylabel="fraction kept", ylim=(0, 1))
    figures.append(
        (
            "Kept fraction by record arity",
            "Fraction of the input records with u users that "
            "bounding kept: the bias towards few-user records (bound/report.json).",
            _png(figure),
        )
    )
    plt.close(figure)
    return figures


def _sampling_figures(batches: BatchReport, plt) -> list[tuple[str, str, str]]:
    """The realized batch sizes against the target, and the gaps between a user's participations."""
    parameters = batches.parameters
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(batches.batch_sizes.per_step, linewidth=0.8, label="sampled")
    if batches.written_batch_sizes.per_step is not None:
        axis.plot(batches.written_batch_sizes.per_step, linewidth=0.8, label="written")
    axis.axhline(parameters.batch_size, color="grey", linestyle="--", label="target B")
    axis.set(xlabel="step", ylabel=f"batch size ({parameters.batch_size_counts})")
    axis.legend()
    figures = [
        (
            "Batch sizes",
            "Realized batch size per step against the target expected size (batches/report.json).",
            _png(figure),
        )
    ]
    plt.close(figure)
    gaps = batches.participation.gap_histogram
    if gaps:
        values, counts = _counts(gaps)
        figure, axis = plt.subplots(figsize=(7, 4))
        axis.bar(values, counts, width=1.0)
        axis.axvline(parameters.min_sep - 0.5, color="red", linestyle="--", label=f"min-sep b = {parameters.min_sep}")
        axis.set(xlabel="steps between a user's consecutive participations", ylabel="gaps", yscale="log")
        axis.legend()
        figures.append(
            (
                "Gaps between participations",
                "Every gap between two consecutive steps a user takes part in; none is below b (batches/report.json).",
                _png(figure),
            )
        )
        plt.close(figure)
    return figures


def _calibration_figure(calibration: PrivacyPlan, plt) -> tuple[str, str, str]:
    """Epsilon against sigma around the calibrated sigma."""
    sigmas, epsilons = zip(*(calibration.epsilon_curve or ()))
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(sigmas, epsilons, marker="o", markersize=3)
    axis.plot(
        [calibration.noise_multiplier],
        [calibration.epsilon],
        marker="*",
        markersize=12,
        color="red",
        label=f"this run: sigma {calibration.noise_multiplier:.3g}",
    )
    axis.set(xlabel="noise multiplier sigma", ylabel=f"epsilon at delta {calibration.delta:g}")
    axis.legend()
    png = _png(figure)
    plt.close(figure)
    return "Sigma and epsilon", f"Epsilon of {calibration.mechanism} as a function of sigma (calibration.json).", png


def _training_figure(curves: dict[str, tuple[Evaluation, ...]], start: Evaluation | None, plt) -> tuple[str, str, str]:
    """Loss and the task's quality metric on the evaluation data, per training shown."""
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    quality = next(m for m in QUALITY_METRICS if m in next(iter(curves.values()))[0].metrics)
    for name, points in curves.items():
        steps = [p.step for p in points]
        axes[0].plot(steps, [p.loss for p in points], label="private" if name == "train" else "non-private")
        axes[1].plot(steps, [p.metrics[quality] for p in points], label="private" if name == "train" else "non-private")
    if start:  # a pretrained model: what fine-tuning has to beat
        for axis, value in zip(axes, (start.loss, start.metrics[quality])):
            axis.axhline(value, color="grey", linestyle="--", label="pretrained, before training")
    axes[0].set(xlabel="step", ylabel="eval loss")
    axes[1].set(xlabel="step", ylabel=f"eval {quality.replace('_', ' ')}")
    axes[1].legend()
    png = _png(figure)
    plt.close(figure)
    return (
        "Training",
        f"Loss and {quality.replace('_', ' ')} on the evaluation data "
        f"({' and '.join(f'{name}/' for name in curves)} metrics.json).",
        png,
    )


def _audit_figure(audit: AuditReport, plt) -> tuple[str, str, str]:
    """The canaries' scores, included against excluded, and the lower bound they give."""
    figure, axis = plt.subplots(figsize=(7, 4))
    for included, label in ((True, "included"), (False, "excluded (zero gradient)")):
        axis.hist(
            [c.score for c in audit.per_canary if c.included == included],
            bins=30,
            alpha=0.6,
            label=f"{label} canaries",
        )
    axis.set(xlabel="score (minus the audit model's mean loss on the canary's records)", ylabel="canaries")
    axis.legend()
    claimed = audit.claimed_epsilon
    png = _png(figure)
    plt.close(figure)
    return (
        "Privacy audit",
        f"{audit.canaries} canary users, each included with probability 1/2; "
        f"{audit.correct_guesses} of {audit.guesses} guesses right give epsilon >= "
        f"{audit.epsilon_lower_bound:.3g} at {100 * audit.confidence:.0f}% confidence, against "
        f"the claimed {'none (non-private)' if claimed is None else f'{claimed:.4g}'}; the audit "
        f"cannot measure above {audit.largest_measurable_epsilon:.3g} (audit/audit.json).",
        png,
    )


def _pretrained_eval(reports: RunReports, models: tuple[str, ...]) -> Evaluation | None:
    """A pretrained model's evaluation before training (the same in every training of the run)."""
    found = (reports.evaluations[name].before_training for name in models if name in reports.evaluations)
    return next((start for start in found if start), None)


def _choosing_k(result: Recommendation, plt) -> tuple[str, str, str]:
    """The recommend-k sweep: bias, variance and their sum (the excess-risk proxy) against k, the
    infeasible k marked, the recommended k and the median heuristic's."""
    rows = result.sweep
    scored = [row for row in rows if row.excess_risk is not None]
    ks = [row.k for row in scored]
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(ks, [r.bias for r in scored], marker="o", markersize=3, label="bias (1 - kept fraction)")
    axis.plot(ks, [r.variance for r in scored], marker="o", markersize=3, label="variance T (sigma/B)^2")
    axis.plot(ks, [r.excess_risk for r in scored], marker="o", color="black", label="sum")
    infeasible = [r for r in scored if not r.feasible]
    if infeasible:
        axis.plot(
            [r.k for r in infeasible],
            [r.excess_risk for r in infeasible],
            "x",
            color="red",
            markersize=10,
            label="infeasible",
        )
    if result.recommended_k is not None:
        axis.axvline(result.recommended_k, color="green", linestyle="--", label=f"k = {result.recommended_k}")
    axis.axvline(result.median_heuristic_k, color="grey", linestyle=":", label="median heuristic")
    axis.set(xscale="log", yscale="log", xlabel="contribution bound k", ylabel="excess-risk proxy")
    axis.legend(fontsize=8)
    unscored = [str(r.k) for r in rows if r.excess_risk is None]
    caption = f"The sweep of `madp recommend-k` that chose k ({SWEEP_FILE}): {result.criterion}. {result.reason}."
    if unscored:
        caption += f" No proxy for k = {', '.join(unscored)} (infeasible before the accountant)."
    png = _png(figure)
    plt.close(figure)
    return "Choosing k", caption, png


def _summary(reports: RunReports, internal: bool) -> list[tuple[str, str]]:
    rows = []
    bound, batches = reports.bound, reports.batches
    if bound is not None:
        rows += [
            ("input records", f"{bound.input_records:,}"),
            ("input users", f"{bound.input_users:,}"),
            ("contribution bound K", str(bound.parameters.max_contributions)),
            ("largest per-user bound (K or a capacity)", str(bound.contribution_bound)),
            ("selected records", f"{bound.selected_records:,}"),
            ("kept fraction", f"{bound.distinct_selected / max(bound.input_records, 1):.3f}"),
        ]
    if batches is not None:
        rows += [
            ("sampler", batches.sampler),
            ("steps", str(batches.steps)),
            ("expected batch size", f"{batches.parameters.batch_size:g}"),
            ("min-sep b", str(batches.parameters.min_sep)),
            ("sampling probability", f"{batches.sampling_probability or 0:.4g}"),
        ]
        if internal or shows_sampling(reports.released, batches):
            rows.append(("mean realized batch size", f"{batches.batch_sizes.mean:.2f}"))
    plan = reports.released
    together = published_with_audit(plan, reports.audit) if shows_audit(reports, internal) else None
    if together is not None:  # the page's headline: the model and the audit's second training composed
        rows.insert(
            0, ("(epsilon, delta) of this page: model and audit", f"({together.epsilon:.4g}, {together.delta:g})")
        )
    if plan is not None:
        rows += [
            ("mechanism", plan.mechanism),
            ("noise multiplier sigma", f"{plan.noise_multiplier:.4g}"),
            ("(epsilon, delta)" + (" of the model alone" if together else ""), f"({plan.epsilon:.4g}, {plan.delta:g})"),
            ("records per user the accountant assumes (k)", str(plan.contribution_bound)),
            ("privacy unit", plan.privacy_unit),
            ("neighbouring relation", plan.neighbouring_relation),
            (
                "batch sampling",
                plan.sampling + ("" if plan.relies_on_secret_sampling else " (the accounting does not rely on it)"),
            ),
        ]
        if plan.noise is not None:
            rows += [("noise", plan.noise), ("private", "yes" if plan.private else "NO")]
    models = _models(reports, internal)
    shown = {name: reports.evaluations.get(name) for name in models}
    lasts = {name: evaluations.last if evaluations else None for name, evaluations in shown.items()}
    finals = {name: last.metrics if last else {} for name, last in lasts.items()}
    start = _pretrained_eval(reports, models)
    if start:
        rows.append(("pretrained model eval loss, before training", f"{start.loss:.4f}"))
    for metric in QUALITY_METRICS:
        for name, label in (("train", "private"), ("baseline", "non-private (internal)")):
            if finals.get(name, {}).get(metric) is not None:
                rows.append((f"{label} eval {metric.replace('_', ' ')}", f"{finals[name][metric]:.4f}"))
        if len(finals) == 2 and all(finals[name].get(metric) for name in finals):
            private, non_private = (finals[name][metric] for name in models)  # models: train, baseline
            gap = private / non_private
            rows.append((f"privacy-utility gap ({metric.replace('_', ' ')}): private / non-private", f"{gap:.3f}"))
    audit = reports.audit
    if audit is not None and shows_audit(reports, internal):
        claimed = audit.claimed_epsilon
        rows += [
            (
                "audit: measured epsilon lower bound",
                f"{audit.epsilon_lower_bound:.4g} ({100 * audit.confidence:.0f}% confidence, "
                f"{audit.canaries} canaries, at most {audit.largest_measurable_epsilon:.3g} measurable)",
            ),
            ("audit: claimed epsilon", "none (non-private audit model)" if claimed is None else f"{claimed:.4g}"),
            ("audit: verdict", audit.verdict),
        ]
    return rows


GRAPH_STATEMENT = (
    "The bound's figures (input records and users, the contribution bound, selected records, the kept "
    "fraction, and the plots of records per user and of the kept fraction by arity) describe the graph of "
    "which user each record belongs to. The guarantee protects the content of a user's records, not this "
    "graph, which it treats as public; no published file holds a digest of it or of the selection."
)


def _guarantee_basis(reports: RunReports) -> list[str]:
    """What the stated guarantee rests on (the plan's assumptions, and its composition with earlier
    trainings), and what the graph figures are, as HTML paragraphs beside the guarantee."""
    parts = []
    plan = reports.released
    if plan is not None:
        parts.append("<h2>What the guarantee rests on</h2><ul>")
        parts += [f"<li>{html.escape(assumption)}</li>" for assumption in plan.assumptions]
        if plan.composition is not None:
            earlier = plan.composition.trainings - 1
            composed = (
                f"the (epsilon, delta) above composes this training with {earlier} earlier one(s) on the same records"
            )
            parts.append(f"<li>{html.escape(composed)} (privacy.json: composition)</li>")
        parts.append("</ul>")
    if reports.bound is not None:
        parts.append(f"<p>{html.escape(GRAPH_STATEMENT)}</p>")
    return parts


def write_report(run_dir: str, output: str | None = None, internal: bool = False) -> dict:
    """The page; `internal` adds the realized sampling even where a guarantee relies on its secrecy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = _load(run_dir)
    if not found:
        raise InputError(f"{run_dir}: no reports of a `madp run` found (looked for {', '.join(SOURCES.values())})")
    # evaluations on data not declared public: an internal page's only
    reports = RunReports.from_json(found, run_dir, internal)
    try:
        figures, rows = _figures(reports, plt, internal), _summary(reports, internal)
    except (KeyError, TypeError, IndexError, ValueError) as error:  # an audit or sweep of another version, or edited
        raise InputError(f"{run_dir}: a report lacks what madp writes ({type(error).__name__}: {error})") from error
    output = output or storage.join(run_dir, "report.html")
    optional = ("audit", "recommend")  # a run without an audit, or planned by hand, misses nothing
    missing = [relative for name, relative in SOURCES.items() if name not in found and name not in optional]
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>madp run report</title>",
        "<style>body{font-family:sans-serif;max-width:1150px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse}td{padding:2px 12px;border-bottom:1px solid #ddd}"
        "figure{margin:1.5em 0}figcaption{color:#555}</style></head><body>",
        f"<h1>madp run: {html.escape(run_dir)}</h1>",
    ]
    if internal:
        parts.append(
            "<p><strong>INTERNAL: this page shows the realized batch sampling, the non-private baseline and "
            "evaluations on data not declared public; do not publish it.</strong></p>"
        )
    elif reports.baseline is not None:
        parts.append(
            "<p>The non-private baseline is left out: it saw the records without noise, so its metrics are "
            "not covered by the guarantee (baseline/ is internal; <code>madp report --internal</code> shows "
            "it).</p>"
        )
    elif reports.batches is not None and not shows_sampling(reports.released, reports.batches):
        parts.append(
            "<p>The realized batch sizes and participation gaps are left out: the guarantee relies on "
            "the sampling staying secret (batches/report.json is internal; <code>madp report "
            "--internal</code> shows them).</p>"
        )
    if not internal and reports.train is not None and reports.train.evaluation is not None:
        parts.append(
            "<p>The evaluations are left out: the evaluation data was not declared public "
            "(<code>--eval-data-public</code>), and figures computed without noise on private records are "
            "not covered by the guarantee (train/internal/ holds them; <code>madp report --internal</code> "
            "shows them).</p>"
        )
    if shows_audit(reports, internal):
        parts.append(
            "<p>The audit trained a second model on the same records (with canaries). Publishing its "
            "results releases that model's statistics too: the records' guarantee for everything on this "
            "page is then the composition of both trainings (the sum of their epsilons and of their deltas, "
            "the first row below).</p>"
        )
    elif reports.audit is not None:
        parts.append(
            "<p>The audit is left out: its model was not private (<code>--non-private</code> or a "
            "testing option); <code>madp report --internal</code> shows it.</p>"
        )
    parts.append("<table>")
    parts += [f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in rows]
    parts.append("</table>")
    parts += _guarantee_basis(reports)
    for title, caption, png in figures:
        parts.append(
            f"<figure><h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' "
            f"src='data:image/png;base64,{png}'><figcaption>{html.escape(caption)}</figcaption></figure>"
        )
    if missing:
        parts.append(f"<p>Not in this run: {html.escape(', '.join(missing))}.</p>")
    parts.append("</body></html>")
    storage.write_text(output, "\n".join(parts))
    return {"report": output, "figures": [title for title, _, _ in figures], "missing": missing}
