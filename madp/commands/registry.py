"""The command registry: families of subcommands, the parser built from them, and the arguments several
families share (the options a dataclass declares are added to a parser and built from its parsed arguments
by `madp.core.options.add_options` and `options_from`)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

Handler = Callable[[argparse.Namespace, list[str]], dict]  # (parsed args, arguments left for the runner) -> its JSON


@dataclasses.dataclass(frozen=True)
class CommandResult:
    """What a command prints, a JSON object, and whether it passed: `ok` is false where an independent
    verifier found an output wrong (the command then exits 1, and `madp run` stops)."""

    printed: Mapping[str, Any]
    ok: bool

    def to_json(self) -> dict[str, Any]:
        return dict(self.printed)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CommandResult:
        """A command's printed object; a verifier's says whether it passed in its `ok` key."""
        return cls(data, data.get("ok") is not False)


class ExitStatus(NamedTuple):
    """An exit status of the `madp` command line: when a command ends with it, and what it prints."""

    code: int
    when: str
    prints: str


PASSED = ExitStatus(0, "the command finished and every check passed", "its result, a JSON object, on stdout")
FAILED = ExitStatus(
    1,
    "an independent verifier found an output wrong (its result's `ok` is false; `madp run` stops there), a "
    "check raised `CheckFailed` (an audit whose claim the canaries refute), or madp failed (a Python traceback)",
    "the check's result on stdout; on a `CheckFailed`, `madp COMMAND: FAILED: WHY` on stderr",
)
ERROR = ExitStatus(
    2,
    "bad input, options, config or outputs (an `InputError`: a missing or invalid file, an option out of range, an "
    "output another madp command holds), a full disk, or a command line argparse refuses",
    "`madp COMMAND: error: WHY`, one line on stderr that names the file, row, option or output; after a full disk, "
    "what was kept and how to go on",
)
INTERRUPTED = ExitStatus(
    130,
    "Ctrl-C (SIGINT) stopped it: 128 + SIGINT, as a shell reports such a command",
    "`madp COMMAND: interrupted: WHAT WAS KEPT`, one line on stderr saying how to go on",
)
EXIT_STATUSES = (PASSED, FAILED, ERROR, INTERRUPTED)


@dataclasses.dataclass(frozen=True)
class Family:
    """Subcommands: `add_parsers(subparsers)` adds them; `handlers` runs each; `runner_options`: those that
    take unknown arguments as their runner's options."""

    add_parsers: Callable[[argparse._SubParsersAction], None]
    handlers: Mapping[str, Handler]
    runner_options: frozenset[str] = frozenset()


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser that keeps its options by destination (flag, type, choices), options of its
    groups included."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.options: dict[str, argparse.Action] = {}  # before argparse adds --help
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        return self._kept(super().add_argument(*args, **kwargs))

    def add_argument_group(self, *args: Any, **kwargs: Any):
        group = super().add_argument_group(*args, **kwargs)
        add = group.add_argument
        group.add_argument = lambda *a, **k: self._kept(add(*a, **k))  # type: ignore[method-assign]
        return group

    def _kept(self, action: argparse.Action) -> argparse.Action:
        if action.option_strings:
            self.options[action.dest] = action
        return action


class Parser(argparse.ArgumentParser):
    """madp's command line; `commands` maps a name to its subcommand's parser, `family` a name to the family
    that runs it."""

    commands: Mapping[str, CommandParser]
    family: Mapping[str, Family]

    def run(self, args: argparse.Namespace, unknown: list[str]) -> CommandResult:
        """Run one parsed command (`unknown`: the arguments left for its runner); its result."""
        return CommandResult.from_json(self.family[args.command].handlers[args.command](args, unknown))

    def takes_runner_options(self, command: str) -> bool:
        return command in self.family[command].runner_options


def written_directory(args: argparse.Namespace) -> str | None:
    """The output directory a command writes (held exclusively while it runs); `madp run` holds its run_dir."""
    if args.command in ("bound", "batch", "train", "import-mbox"):
        return args.output
    if args.command == "generate" and not args.output.endswith((".jsonl", ".parquet")):
        return args.output
    return None


def read_paths(args: argparse.Namespace) -> list[str]:
    """The inputs of a command that writes a directory: none may be, contain or lie inside its output
    (the CLI refuses it; `madp run` its stages' steps, before any runs: `madp.jobs.run_steps`)."""
    named = {
        "bound": ("input", "capacities"),
        "batch": ("selected", "data"),
        "train": ("batches", "eval_data", "calibration", "zero_out", "pretrained", "batches_copy"),
        "import-mbox": ("mbox",),
    }.get(args.command, ())
    return [value for name in named if isinstance(value := getattr(args, name, None), str)]


def build_parser(families: tuple[Family, ...], description: str) -> Parser:
    parser = Parser(prog="madp", description=description)
    parser.add_argument("-q", "--quiet", action="store_true", help="print only results and errors")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    family = {}
    for each in families:
        each.add_parsers(commands)
        family.update({name: each for name in each.handlers})
    parser.commands, parser.family = commands.choices, family
    return parser
