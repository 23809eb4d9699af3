"""`madp report`: the HTML page of a run directory."""

from __future__ import annotations

import argparse
import dataclasses

from madp.commands.registry import Family
from madp.core.options import add_options, option, options_from


@dataclasses.dataclass(frozen=True)
class ReportOptions:
    """The options of `madp report` (each field its `--flag`): where the page goes and what it may show."""

    output: str | None = option(None, help="HTML file (default RUN_DIR/report.html)")
    internal: bool = option(
        False,
        help="also show what the guarantee does not cover: the realized sampling (batch sizes, gaps) where "
        "the guarantee relies on its secrecy, the non-private baseline and a non-private audit; the page "
        "is then internal, not for publication",
    )


def add_parsers(commands: argparse._SubParsersAction) -> None:
    page = commands.add_parser("report", help="an HTML page with plots of a `madp run` directory's reports")
    page.add_argument("run_dir", help="the run_dir of a `madp run`")
    add_options(page, ReportOptions)


def _report(args: argparse.Namespace, unknown: list[str]) -> dict:
    from madp.tools.report import write_report

    options = options_from(ReportOptions, args)
    return write_report(args.run_dir, options.output, options.internal)


FAMILY = Family(add_parsers, {"report": _report})
