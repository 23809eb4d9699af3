"""One declaration per option: a command's options are the fields of a frozen dataclass, each declared
with `option(...)`, which keeps its command-line facts (help, aliases, choices, how text is parsed,
its argument group, its `madp run` section) in the field's metadata beside its one default. A
declaration becomes argparse options, and parsed arguments the dataclass again (`add_options`,
`options_from`: the commands' parsers, and an engine's own trailing options); `madp run` reads the
section facts; a Python caller just builds the dataclass. An option's flag is its field's name with
dashes (`flag_of`)."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import types
import typing
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from madp.core.errors import OptionError

METADATA_KEY = "madp.option"
CALIBRATE = "calibrate"  # `madp run`'s section of the privacy options of `madp train`


@dataclasses.dataclass(frozen=True)
class Option:
    """An option's command-line facts (see `option`)."""

    help: str | None = None
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    group: str | None = None
    repeatable: bool = False
    section: str | None = None
    how_only: bool = False
    flag: str | None = None


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str | None = None,
    aliases: tuple[str, ...] = (),
    choices: tuple[str, ...] | None = None,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    group: str | None = None,
    repeatable: bool = False,
    section: str | None = None,
    how_only: bool = False,
    flag: str | None = None,
) -> Any:
    """A dataclass field that is a command-line option, `--NAME-WITH-DASHES` (`flag_of`), with `default`
    (none: a required option). `aliases`: further flags (`-k`); `choices`: the values it takes (checked
    for a Python caller too: `check_choices`); `parse`: how its text becomes the value (default: the
    field's type, int, float or str); a bool field is a switch; `repeatable`: given once per value, a
    tuple; `group`: the title of its argument group in --help; `section`: the `madp run` section that
    takes it where not the command's own (`CALIBRATE`); `how_only`: says only how a stage reaches its
    outputs, never what they are, so `madp run` leaves it out of the stage's fingerprint; `flag`: its flag
    where not the field's name with dashes (a config key that a longer flag spells out)."""
    facts = Option(help, aliases, choices, parse, metavar, group, repeatable, section, how_only, flag)
    return dataclasses.field(default=default, metadata={METADATA_KEY: facts})


def flag_of(name: str) -> str:
    """The flag of the option field `name`: `max_contributions` -> `--max-contributions`."""
    return "--" + name.replace("_", "-")


def error_text(error: BaseException) -> str:
    """An error as the command line says it: an `OptionError` names each parameter by its flag."""
    return error.named(flag_of) if isinstance(error, OptionError) else str(error)


class Declared(NamedTuple):
    """One declared option of a dataclass, its type resolved."""

    name: str
    option: Option
    default: Any  # dataclasses.MISSING: required
    switch: bool  # a bool field: given or not
    parse: Callable[[str], Any] | None  # argparse's type; None for a switch or a string

    @property
    def flags(self) -> tuple[str, ...]:
        return (self.option.flag or flag_of(self.name), *self.option.aliases)

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING


def declared(cls: type) -> tuple[Declared, ...]:
    """The options `cls` declares, in the order its __init__ takes them (keyword-only ones, such as a base
    class's `kw_only` options, last); fields not made by `option` are none of them."""
    hints = typing.get_type_hints(cls)
    found = []
    for field in sorted(dataclasses.fields(cls), key=lambda field: field.kw_only is True):
        facts = field.metadata.get(METADATA_KEY)
        if facts is None:
            continue
        kind = value_type(hints[field.name])
        switch = kind is bool
        parse = facts.parse
        if parse is None and not switch and not facts.repeatable:  # a repeatable option's values: strings
            if kind not in (int, float, str):
                raise TypeError(f"{cls.__name__}.{field.name}: a {kind} option needs parse=")
            parse = None if kind is str else kind
        found.append(Declared(field.name, facts, field.default, switch, parse))
    return tuple(found)


def value_type(hint: Any) -> Any:
    """The type of an option's values: `int | None` -> int; a tuple type as `tuple`."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return typing.get_origin(hint) or hint


def section_keys(cls: type, section: str) -> tuple[str, ...]:
    """The options of `cls` that `madp run`'s `section` takes, by name (its config keys)."""
    return tuple(each.name for each in declared(cls) if each.option.section == section)


def how_only_flags(cls: type) -> dict[str, int]:
    """The flags of `cls`'s how-only options, each with the number of values it takes (a switch none)."""
    return {flag: 0 if each.switch else 1 for each in declared(cls) if each.option.how_only for flag in each.flags}


def check_choices(options: object) -> None:
    """Refuse a declared option whose value is not one of its choices (None: not given, where that is
    its default): argparse checks the command line's, this a Python caller's."""
    for each in declared(type(options)):
        value = getattr(options, each.name)
        if each.option.choices is not None and value not in each.option.choices and value != each.default:
            raise OptionError(f"{{{each.name}}} must be one of {{0}}", ", ".join(each.option.choices))


class Message(NamedTuple):
    """An `OptionError`'s template and the values it places by position."""

    template: str
    values: tuple[object, ...] = ()


Checks = list[tuple[bool, str | Message]]  # (passes, what to say if not: a template, or a Message)


def refuse_failed(checks: Checks) -> None:
    """Raise the `OptionError` of the first check that fails."""
    for ok, said in checks:
        if not ok:
            message = Message(said) if isinstance(said, str) else said
            raise OptionError(message.template, *message.values)


def comma_list(text: str) -> tuple[str, ...]:
    """`A,B,C` as a tuple of its items, empty ones kept (the caller's checks name them)."""
    return tuple(text.split(","))


def comma_names(text: str) -> tuple[str, ...]:
    """`A,B,,C` as a tuple of its non-empty items."""
    return tuple(item for item in text.split(",") if item)


def shell_words(text: str) -> tuple[str, ...]:
    """`--a 1 --b 'x y'` split as a shell splits a command line: options meant for another program (Beam's)
    given as one value, which quoting keeps from being taken for madp's own."""
    try:
        return tuple(shlex.split(text))
    except ValueError as error:  # shlex's: an unclosed quotation, a trailing escape
        raise argparse.ArgumentTypeError(f"options split as a shell line, got {text!r}: {error}") from None


SEED_BOUND = 2**64  # numpy's SeedSequence takes any non-negative integer; above this madp's keys wrap


def seed_argument(text: str) -> int:
    """How every --seed's text is parsed: an integer in [0, 2^64) (a negative one was a numpy traceback,
    a larger one reproduced a smaller one's draws)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a seed is an integer in [0, 2^64), got {text!r}") from None
    if not 0 <= value < SEED_BOUND:
        raise argparse.ArgumentTypeError(f"a seed is an integer in [0, 2^64), got {value}")
    return value


Declaration = TypeVar("Declaration")  # a dataclass of options (`option`)


def add_options(parser: argparse.ArgumentParser, declaration: type, defaults: bool = True) -> None:
    """Add the options a dataclass declares (`madp.core.options.option`) to a command's parser: each field's
    flag, aliases, help, choices, type and default, in its argument group if it names one. Without `defaults`
    an option left off the command line is None, a switch's too (the values come from elsewhere, a config
    section, where not given)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for each in declared(declaration):
        facts = each.option
        where: argparse._ActionsContainer = parser
        if facts.group is not None:
            if facts.group not in groups:
                groups[facts.group] = parser.add_argument_group(facts.group)
            where = groups[facts.group]
        settings: dict[str, Any] = {"dest": each.name, "help": facts.help}
        if each.switch:
            settings["action"] = "store_true"
            if not defaults:
                settings["default"] = None
        else:
            settings.update(choices=facts.choices, metavar=facts.metavar, type=each.parse)
            if facts.repeatable:
                settings["action"] = "append"
        if each.required:
            settings["required"] = True
        elif defaults:  # a repeatable option's values are appended to a list
            settings["default"] = list(each.default) if facts.repeatable else each.default
        where.add_argument(*each.flags, **settings)


def options_from(declaration: type[Declaration], args: argparse.Namespace) -> Declaration:
    """The dataclass `declaration` of a command's parsed options (checked as it is built)."""
    values = {each.name: getattr(args, each.name) for each in declared(declaration)}
    return declaration(**{name: tuple(value) if isinstance(value, list) else value for name, value in values.items()})
