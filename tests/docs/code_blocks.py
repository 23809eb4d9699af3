"""The pages' code blocks, run as the docs' convention says (docs_common: README.md, docs/tutorials/*.md,
docs/how-to/*.md):

- ```python and ```bash blocks run in page order in one fresh directory per page: the python blocks in one
  namespace (one interpreter for the page), each bash block with `bash -euo pipefail`, `madp` and the
  interpreter's `python` on PATH and the repository's root in $MADP_REPO; other languages are not run;
- a block after the line `<!-- file: NAME -->` is written to NAME in that directory instead;
- a block after `<!-- not-run: REASON -->` is not run, and the reason may not be empty.

A failing block is named by its page and line; a traceback's or bash's line numbers are the page's."""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import textwrap
from typing import NamedTuple

RUN = ("python", "bash")  # the languages whose blocks run
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
MARK = re.compile(r"^<!--\s*(?P<kind>file|not-run)\b\s*(?P<colon>:?)\s*(?P<value>.*?)\s*-->$")
BLOCK_TIMEOUT_S = 300  # one block at most


class Block(NamedTuple):
    """A fenced block of a page: its language, text, the page's line of its first text line, its mark."""

    language: str
    text: str
    line: int  # 1-based, the first line of the block's text
    file: str | None  # `<!-- file: NAME -->`: written to NAME
    not_run: str | None  # `<!-- not-run: REASON -->`: its reason


class BlockFailed(AssertionError):
    """A block failed, or its mark breaks the convention: the message names the page and line."""


def blocks(page: str, text: str) -> list[Block]:
    """The fenced blocks of a page's Markdown `text` with the mark on the last non-blank line above each."""
    found = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        end = index + 1
        while end < len(lines) and not re.match(rf"^ *{fence[0]}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        # the fence's indentation off each line (a block in a list item); a line indented less, all of it
        body = "\n".join(
            line[indent:] if not line[:indent].strip() else line.lstrip() for line in lines[index + 1 : end]
        )
        language = opening["info"].strip().split(" ")[0].strip("{}").lower()
        file, not_run = _mark(page, lines, index)
        found.append(Block(language, body + "\n" if body else "", index + 2, file, not_run))
        index = end + 1
    return found


def _mark(page: str, lines: list[str], fence: int) -> tuple[str | None, str | None]:
    above = fence - 1
    while above >= 0 and not lines[above].strip():
        above -= 1
    mark = MARK.match(lines[above].strip()) if above >= 0 else None
    if mark is None:
        return None, None
    where = f"{page}:{above + 1}"
    if not mark["colon"] or not mark["value"]:
        what = "a file name" if mark["kind"] == "file" else "a reason"
        raise BlockFailed(f"{where}: `<!-- {mark['kind']}: ... -->` needs {what}")
    if mark["kind"] == "file":
        return mark["value"], None
    return None, mark["value"]


def run_page(page: str, text: str, directory: str, repo: str) -> list[str]:
    """Run a page's blocks in `directory` (fresh, empty); what ran, by page and line. Raises BlockFailed."""
    work, scripts = os.path.join(directory, "work"), os.path.join(directory, "blocks")
    os.makedirs(work)
    os.makedirs(scripts)
    environment = _environment(scripts, repo)
    python: _Interpreter | None = None
    ran = []
    try:
        for block in blocks(page, text):
            where = f"{page}:{block.line}"
            if block.file is not None:
                _write(where, work, block)
            elif block.not_run is not None or block.language not in RUN:
                continue
            elif block.language == "bash":
                _bash(where, page, block, work, scripts, environment)
            else:
                python = python or _Interpreter(work, scripts, environment)
                python.run(where, page, block)
            ran.append(where)
    finally:
        if python is not None:
            python.close()
    return ran


def _environment(scripts: str, repo: str) -> dict[str, str]:
    """The blocks' environment: this checkout's `madp` and the interpreter's `python` first on PATH."""
    bin_dir = os.path.join(scripts, "bin")
    os.makedirs(bin_dir)
    madp = os.path.join(bin_dir, "madp")
    with open(madp, "w", encoding="utf-8") as handle:
        handle.write(f'#!/bin/sh\nexec "{sys.executable}" -m madp.cli "$@"\n')
    os.chmod(madp, 0o755)
    os.symlink(sys.executable, os.path.join(bin_dir, "python"))
    path = os.pathsep.join([bin_dir, os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    pythonpath = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PATH": path, "PYTHONPATH": pythonpath, "MADP_REPO": repo}


def _write(where: str, work: str, block: Block) -> None:
    assert block.file is not None
    target = os.path.normpath(os.path.join(work, block.file))
    if os.path.isabs(block.file) or not target.startswith(work + os.sep):
        raise BlockFailed(f"{where}: `<!-- file: {block.file} -->` must name a file inside the page's directory")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "w", encoding="utf-8") as handle:
        handle.write(block.text)


def _padded(page: str, block: Block) -> str:
    """The block's text after blank lines, so that its line numbers are the page's."""
    return "\n" * (block.line - 1) + block.text


def _bash(where: str, page: str, block: Block, work: str, scripts: str, environment: dict[str, str]) -> None:
    script = os.path.join(scripts, os.path.basename(page))  # bash names the page in its errors
    with open(script, "w", encoding="utf-8") as handle:
        handle.write(_padded(page, block))
    try:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", script],
            cwd=work,
            env=environment,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as error:
        raise BlockFailed(f"{where}: the bash block ran past {BLOCK_TIMEOUT_S} s") from error
    if done.returncode != 0:
        raise BlockFailed(
            f"{where}: the bash block exited {done.returncode}\n{_tail(done.stdout)}\n{_tail(done.stderr)}"
        )


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


# The page's interpreter: it runs each block it reads (JSON lines on stdin) in one namespace and answers on
# its own pipe, so that what the blocks (and their subprocesses) print cannot be taken for an answer.
_DRIVER = textwrap.dedent(
    """
    import json, os, sys, traceback
    answers = os.fdopen(int(sys.argv[1]), "w")
    namespace = {"__name__": "__main__"}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            exec(compile(request["code"], request["file"], "exec"), namespace)
            answer = {"ok": True}
        except BaseException:
            answer = {"ok": False, "error": traceback.format_exc()}
        sys.stdout.flush(); sys.stderr.flush()
        answers.write(json.dumps(answer) + "\\n"); answers.flush()
    """
)


class _Interpreter:
    """One Python process per page, its output in a log file."""

    def __init__(self, work: str, scripts: str, environment: dict[str, str]) -> None:
        self.log_path = os.path.join(scripts, "python.log")
        self.log = open(self.log_path, "w", encoding="utf-8")
        read, write = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-c", _DRIVER, str(write)],
            cwd=work,
            env=environment,
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            pass_fds=(write,),
            text=True,
        )
        os.close(write)
        self.answers = os.fdopen(read, encoding="utf-8")

    def run(self, where: str, page: str, block: Block) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"code": _padded(page, block), "file": page}) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.answers], [], [], BLOCK_TIMEOUT_S)
        line = self.answers.readline() if ready else ""
        if not line:
            self.log.flush()
            why = "ran past its time" if not ready else "ended its interpreter"
            raise BlockFailed(f"{where}: the python block {why}\n{_tail(open(self.log_path).read())}")
        answer = json.loads(line)
        if not answer["ok"]:
            raise BlockFailed(f"{where}: the python block failed\n{answer['error']}")

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.answers.close()
        self.log.close()
