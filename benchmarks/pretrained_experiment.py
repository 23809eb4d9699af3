"""The papers' multi-attribution experiment: fine-tune a pretrained causal LM on multi-owner text with
user-level DP, three ways, at several epsilons, and compare held-out loss per token.

The corpus is a madp JSON Lines file with `text` and `users` (`benchmarks/text_corpus.py`: CPython's
changelog, or Debian's package descriptions). A seeded share of the records is held out for
evaluation (`text_defaults.split`); the rest goes through `madp bound -k K` once, then, per
mechanism and epsilon, a batch output of its own (a fresh secret sampling key each: several
trainings on one batch output would compose) and `madp train --model causal-lm --pretrained`:

- `dpsgd`: Poisson sampling of records (`--sampler minsep --min-sep 1`), DP-SGD, each user
  contributing at most K records;
- `bandmf`: deterministic min-sep batches (`--sampler minsep-greedy --min-sep b`), DP-BandMF with b
  bands, unamplified;
- `bandmf-amplified`: b-min-sep Poisson sampling (`--sampler minsep --min-sep b`), DP-BandMF with b
  bands, amplification by sampling accounted by Monte Carlo (`--amplified`);

and once without privacy (`none`) on Poisson batches. Each training evaluates on the held-out texts
after its last step; `pretrained_eval` (the model before any step) is the row every fine-tuning has
to beat. The table (loss in nats per token; lower is better) is printed and written to
OUT/experiment.json, and plotted in OUT/experiment.png (`--table-only` redoes both from the JSON).

    python benchmarks/pretrained_experiment.py CORPUS.jsonl OUT --pretrained PATH.gguf \
        [--epsilons 1,2,4,8] [--mechanisms dpsgd,bandmf,bandmf-amplified] [-k 4] [--steps 40] \
        [--batch-size 16] [--bands 4] [--max-length 32] [--lora-rank 8] [--eval-records 128]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from text_defaults import madp, split  # noqa: E402

from madp.training.outputs import evaluation_of  # noqa: E402  (the held-out split's: internal)

# mechanism -> (madp batch sampler flags, madp train mechanism flags); b: --bands
SAMPLERS = {
    "none": lambda b: ["--sampler", "minsep", "--min-sep", "1"],
    "dpsgd": lambda b: ["--sampler", "minsep", "--min-sep", "1"],
    "bandmf": lambda b: ["--sampler", "minsep-greedy", "--min-sep", str(b)],
    "bandmf-amplified": lambda b: ["--sampler", "minsep", "--min-sep", str(b)],
}
MECHANISMS = {
    "none": lambda b: ["--mechanism", "none"],
    "dpsgd": lambda b: ["--mechanism", "dpsgd"],
    "bandmf": lambda b: ["--mechanism", "bandmf", "--bands", str(b)],
    "bandmf-amplified": lambda b: ["--mechanism", "bandmf", "--bands", str(b), "--amplified"],
}


def held_out_texts(test: str, directory: str, count: int) -> str:
    """The first `count` held-out records, as the evaluation file (a loss over a few thousand tokens)."""
    path = os.path.join(directory, "eval.jsonl")
    with open(test, encoding="utf-8") as source, open(path, "w", encoding="utf-8") as out:
        for _, line in zip(range(count), source):
            out.write(line)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus")
    parser.add_argument("output")
    parser.add_argument("--pretrained", required=True)
    parser.add_argument("--epsilons", default="1,2,4,8")
    parser.add_argument("--mechanisms", default="dpsgd,bandmf,bandmf-amplified")
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--bands", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--eval-records", type=int, default=128)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--extra", default="", help="more madp train flags, for every training")
    parser.add_argument("--table-only", action="store_true", help="print and plot OUT/experiment.json, run nothing")
    args = parser.parse_args()
    if args.table_only:
        summary = json.load(open(os.path.join(args.output, "experiment.json")))
        print(table(summary))
        plot(summary, os.path.join(args.output, "experiment.png"))
        return

    os.makedirs(args.output, exist_ok=True)
    records, test, _ = split(args.corpus, args.output)
    evaluation = held_out_texts(test, args.output, args.eval_records)
    bound = os.path.join(args.output, "bounded")
    madp("bound", records, bound, "-k", str(args.k), "--runner", "local")
    common = [
        "--model", "causal-lm", "--pretrained", args.pretrained, "--lora-rank", str(args.lora_rank),
        "--max-length", str(args.max_length), "--eval-data", evaluation, "--eval-every", str(args.steps),
        "--delta", str(args.delta), *args.extra.split(),
    ]  # fmt: skip
    runs = [("none", None)] + [
        (mechanism, float(epsilon)) for mechanism in args.mechanisms.split(",") for epsilon in args.epsilons.split(",")
    ]
    results = []
    for mechanism, epsilon in runs:
        name = mechanism if epsilon is None else f"{mechanism}-eps{epsilon:g}"
        batches, trained = os.path.join(args.output, f"batches-{name}"), os.path.join(args.output, f"trained-{name}")
        started = time.perf_counter()
        madp("batch", bound, records, batches, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
             "--content-columns", "text", "--runner", "local", *SAMPLERS[mechanism](args.bands))  # fmt: skip
        privacy = [] if epsilon is None else ["--epsilon", str(epsilon)]
        madp("train", batches, trained, *common, *MECHANISMS[mechanism](args.bands), *privacy)
        timing = json.load(open(os.path.join(trained, "internal", "timing.json")))
        evaluated = evaluation_of(trained, internal=True)
        plan = json.load(open(os.path.join(trained, "privacy.json")))
        results.append(
            {
                "mechanism": mechanism,
                "epsilon": epsilon,
                "noise_multiplier": plan.get("noise_multiplier"),
                "loss": evaluated["final"]["loss"],
                "pretrained_loss": evaluated["pretrained_eval"]["loss"],
                "steps_per_s": timing["steps_per_s"],
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
        print(json.dumps(results[-1]), flush=True)
    summary = {
        "corpus": args.corpus,
        "pretrained": os.path.basename(args.pretrained),
        **{key: getattr(args, key) for key in ("k", "steps", "batch_size", "bands", "max_length", "lora_rank")},
        "eval_tokens": evaluated["final"]["tokens"],
        "pretrained_loss": results[0]["pretrained_loss"],
        "runs": results,
    }
    json.dump(summary, open(os.path.join(args.output, "experiment.json"), "w"), indent=2)
    print(table(summary))
    plot(summary, os.path.join(args.output, "experiment.png"))


def plot(summary: dict, path: str) -> None:
    """Held-out loss against epsilon, a line per mechanism, the pretrained and non-private losses as
    horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for mechanism in dict.fromkeys(run["mechanism"] for run in summary["runs"] if run["epsilon"] is not None):
        runs = sorted((r["epsilon"], r["loss"]) for r in summary["runs"] if r["mechanism"] == mechanism)
        axis.plot(*zip(*runs), marker="o", label=mechanism)
    axis.axhline(summary["pretrained_loss"], color="grey", linestyle="--", label="pretrained")
    for run in summary["runs"]:
        if run["mechanism"] == "none":
            axis.axhline(run["loss"], color="black", linestyle=":", label="non-private")
    axis.set(xscale="log", xlabel="epsilon", ylabel="held-out loss (nats per token)")
    axis.set_title(f"{summary['pretrained']}, k = {summary['k']}, T = {summary['steps']}, B = {summary['batch_size']}")
    axis.legend(fontsize=8)
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)


def table(summary: dict) -> str:
    """Held-out loss (nats per token): a row per mechanism, a column per epsilon."""
    epsilons = sorted({run["epsilon"] for run in summary["runs"] if run["epsilon"] is not None})
    lines = [
        "| mechanism | " + " | ".join(f"epsilon {e:g}" for e in epsilons) + " |",
        "|---" * (len(epsilons) + 1) + "|",
        "| pretrained (no fine-tuning) | " + " | ".join(f"{summary['pretrained_loss']:.3f}" for _ in epsilons) + " |",
    ]
    by_mechanism: dict[str, dict] = {}
    for run in summary["runs"]:
        by_mechanism.setdefault(run["mechanism"], {})[run["epsilon"]] = run
    for mechanism, runs in by_mechanism.items():
        if mechanism == "none":
            cells = [f"{runs[None]['loss']:.3f}"] * len(epsilons)
            mechanism = "non-private"
        else:
            cells = [
                f"{runs[e]['loss']:.3f} (sigma {runs[e]['noise_multiplier']:.2f})" if e in runs else "-"
                for e in epsilons
            ]
        lines.append(f"| {mechanism} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
