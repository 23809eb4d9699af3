"""`madp report`: the HTML page of a run directory."""

from __future__ import annotations

import argparse

from madp.commands.registry import Family


def add_parsers(commands: argparse._SubParsersAction) -> None:
    page = commands.add_parser("report", help="an HTML page with plots of a `madp run` directory's reports")
    page.add_argument("run_dir", help="the run_dir of a `madp run`")
    page.add_argument("--output", help="HTML file (default RUN_DIR/report.html)")
    page.add_argument(
        "--internal",
        action="store_true",
        help="also show what the guarantee does not cover: the realized sampling (batch sizes, gaps) where "
        "the guarantee relies on its secrecy, the non-private baseline and a non-private audit; the page "
        "is then internal, not for publication",
    )


def _report(args: argparse.Namespace, unknown: list[str]) -> dict:
    from madp.tools.report import write_report

    return write_report(args.run_dir, args.output, args.internal)


FAMILY = Family(add_parsers, {"report": _report})
