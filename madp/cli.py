"""The `madp` command line: the parser of every command family (`madp.commands`), the jobs on top of
them (`madp run`, `madp audit`), and `main`."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import signal
import sys
import threading

from madp.commands import accounting, batching, bounding, data, report, training
from madp.commands.registry import (
    ERROR,
    FAILED,
    INTERRUPTED,
    PASSED,
    Family,
    Parser,
    build_parser,
    read_paths,
    written_directory,
)
from madp.core import output_lock, storage
from madp.core.errors import CheckFailed, DiskFull, InputError
from madp.core.options import add_options, declared, error_text
from madp.core.selection import REPORT_FILE
from madp.tools.planning.audit_config import AuditOptions

log = logging.getLogger("madp")
DESCRIPTION = (
    "User-level differential privacy for records that belong to several people: bound contributions, "
    "materialize batches, calibrate the noise, train; `madp run CONFIG.yaml` chains them."
)
STAGE_FAMILIES = (data.FAMILY, bounding.FAMILY, batching.FAMILY, accounting.FAMILY, training.FAMILY, report.FAMILY)


def _add_jobs(commands: argparse._SubParsersAction) -> None:
    job = commands.add_parser(
        "run",
        help="the production job from a YAML config: generate, bound, batch, "
        "calibrate, train (each optional, each resumable)",
    )
    job.add_argument("config", help="YAML config (see examples/demo.yaml)")
    job.add_argument("--force", action="store_true", help="re-run every stage, even those up to date")
    job.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value (repeatable), e.g. --set bound.max_contributions=4",
    )

    audit = commands.add_parser(
        "audit",
        help="an empirical lower bound on the epsilon of the model a config "
        "trains: plant canary users, train once, guess who was included",
    )
    audit.add_argument("config", help="the YAML config of `madp run`; its audit section gives the defaults below")
    audit.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value (repeatable)"
    )
    add_options(audit, AuditOptions, defaults=False)  # the audit section gives the defaults
    audit.add_argument("--force", action="store_true", help="re-run every stage of the audit's job")


def _run(args: argparse.Namespace, unknown: list[str]) -> dict:
    from madp.jobs.audit import run_audit
    from madp.jobs.run import run

    # its audit stage is `madp audit CONFIG` with the run's --set overrides and no flags of its own
    return run(args.config, args.set, lambda config, overrides: run_audit(config, overrides, {}), args.force).to_json()


def _audit(args: argparse.Namespace, unknown: list[str]) -> dict:
    from madp.jobs.audit import run_audit

    given = {each.name: getattr(args, each.name) for each in declared(AuditOptions)}
    return run_audit(args.config, args.set, given, args.force)


JOBS = Family(_add_jobs, {"run": _run, "audit": _audit})


def parser() -> Parser:
    """Every madp command."""
    return build_parser((*STAGE_FAMILIES, JOBS), DESCRIPTION)


def _after_stop(args: argparse.Namespace) -> str:
    """What an interrupted command, or one stopped by a full disk, kept and how to go on: the end of its
    one line. Outputs are marked finished last (a report, a stage's manifest, a training's model and
    metrics), so nothing unfinished passes for finished."""
    if args.command in ("run", "audit"):
        rerun = f"madp {args.command} {args.config}"
        return f"the stages that finished are kept: `{rerun}` again skips them and runs the rest"
    if args.command == "train":
        from madp.training.long_training import after_stop

        return after_stop(args.output, args.batches)
    output = written_directory(args)
    if args.command == "generate":
        if output:
            return f"{output} may hold only some of its Parquet shards: generate again before reading it"
        return f"{args.output} is written whole or not at all: generate again"
    if output and storage.kind(storage.join(output, REPORT_FILE)) == "missing":
        return (
            f"{output} is unfinished (no {REPORT_FILE}, which is written last, so no madp command reads it): "
            f"run the command again"
        )
    return "run the command again"


class _Stop:
    """Ctrl-C while madp runs. The first stops the command: a KeyboardInterrupt, after whose clean-up (locks
    released, temporaries and staged files removed, a Beam job's workers stopped) madp prints one line and
    exits 130. A later one, during that clean-up or once the command has ended (while Beam's or TensorFlow's
    threads finish, which an interrupted Beam job can leave waiting for ever), ends the process at once: the
    line, if not printed yet, and the command's exit status (130 when interrupted), never a traceback. What
    the clean-up had left to do is what a killed process leaves, which madp handles: a dead process's lock is
    taken over, temporaries and staged files are never read and go at the next run."""

    def __init__(self) -> None:
        self.args: argparse.Namespace | None = None  # the command, once parsed
        self.interrupted = False
        self.said = False  # the interrupted command's line printed
        self.code: int | None = None  # the command's exit status, once it has ended

    def __call__(self, signum, frame) -> None:
        if not self.interrupted and self.code is None:
            self.interrupted = True
            raise KeyboardInterrupt
        if self.interrupted and not self.said and self.args is not None:
            self.say()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED.code if self.code is None else self.code)

    def say(self) -> None:
        assert self.args is not None
        print(f"madp {self.args.command}: interrupted: {_after_stop(self.args)}", file=sys.stderr)
        self.said = True


def main(argv: list[str] | None = None) -> int:
    """The madp command line (`argv`: the program's own when None), Ctrl-C answered by `_Stop`; on the
    program's own command line, `_Stop` stays SIGINT's handler until the process tears down (a Ctrl-C is
    ignored then), and a caller's own handler is restored."""
    stop = _Stop()
    # Not where SIGINT is ignored (a background job of a script) or its handler is not Python's
    answered = signal.getsignal(signal.SIGINT) not in (None, signal.SIG_IGN)
    ours = threading.current_thread() is threading.main_thread() and answered
    previous = signal.signal(signal.SIGINT, stop) if ours else None
    if ours and argv is None:
        # CPython gives SIGINT back its default action once the exit functions have run, as it tears the
        # interpreter down (a while with Beam or TensorFlow loaded): a Ctrl-C there would end the process by
        # the signal, with no line. It is ignored from the last exit functions on (those registered before this
        # one; the command's own run first, under `_Stop`): the process ends as it would have, with its status.
        atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)
    try:
        stop.code = _main(argv, stop)
        return stop.code
    finally:
        if stop.code is None:  # a traceback: its status
            stop.code = FAILED.code
        if ours and argv is not None:
            signal.signal(signal.SIGINT, previous)


def _main(argv: list[str] | None, stop: _Stop) -> int:
    madp = parser()
    args, unknown = madp.parse_known_args(argv)
    stop.args = args
    if unknown and not madp.takes_runner_options(args.command):
        madp.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # Beam relays its workers' start-up warnings (missing GCP client libraries, unparsed
    # options) through these loggers; they say nothing about the job.
    logging.getLogger("apache_beam").setLevel(logging.ERROR)
    # The DirectRunner also logs a failed step's traceback as its worker meets it, and relays it; the
    # driver raises the same failure itself (an InputError or a full disk as one line, below).
    logging.getLogger("apache_beam.runners.common").setLevel(logging.CRITICAL)
    logging.getLogger("apache_beam.runners.portability.local_job_service").setLevel(logging.CRITICAL)
    logging.getLogger().addFilter(lambda record: "apitools not found" not in record.getMessage())
    output = written_directory(args)
    try:
        if output:
            storage.refuse_overlap(output, read_paths(args))
        with output_lock.exclusive(output, args.command) if output else contextlib.nullcontext():
            result = madp.run(args, unknown)
    except KeyboardInterrupt:
        stop.say()
        return INTERRUPTED.code
    except CheckFailed as error:
        print(json.dumps(error.result, indent=2, sort_keys=True, default=str))
        print(f"madp {args.command}: FAILED: {error}", file=sys.stderr)
        return FAILED.code
    except DiskFull as error:
        print(f"madp {args.command}: error: {error}; {_after_stop(args)}", file=sys.stderr)
        return ERROR.code
    except InputError as error:
        print(f"madp {args.command}: error: {error_text(error)}", file=sys.stderr)
        return ERROR.code
    except Exception as error:
        # A write on a full file system that no layer below turned into a DiskFull (TensorFlow's
        # summaries, checkpoints and model, a file written by a library).
        full = storage.disk_full(getattr(error, "filename", None) or output, error)
        if full is None:
            raise
        print(f"madp {args.command}: error: {full}; {_after_stop(args)}", file=sys.stderr)
        return ERROR.code
    print(json.dumps(result.to_json(), indent=2, sort_keys=True))
    return PASSED.code if result.ok else FAILED.code


if __name__ == "__main__":
    sys.exit(main())
