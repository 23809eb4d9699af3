"""Real multi-owner text corpora available offline, as madp records (JSON Lines: id, users, text, label).

`--source changelog`: CPython's changelog, from the Debian package `python3.11-doc` (the PSF
documentation licence). Each changelog item is a record: `text` is the item (its issue number left
out), `label` the section it is filed under (Library, Core and Builtins, Tests, IDLE, Build,
Documentation, C API, Windows, Security, Tools/Demos, macOS: 11 classes, about 10,000 items of
Python 3.5 to 3.11), and `users` the people the item credits ("Patch by A and B.", "Contributed by
C.", ...). About a quarter of the items credit someone; an item that credits nobody is its own
single owner (`item:<id>`), which the README states wherever a figure comes from this corpus.

`--source debian`: the source packages of Debian 12 (bookworm, main), from the archive's index files
(`Sources.xz`; `Translation-en.xz` for the descriptions). Each source package is a record: `text`
is the description of the binary package of its name (else its first binary package with one),
short and long; `label` that binary's section, among the --sections most common (the others are
left out);
`users` its Maintainer and Uploaders by e-mail address (lower case): several people per record,
and teams (the Debian Python Team, ...) that own thousands.

    python benchmarks/text_corpus.py OUT.jsonl [--source changelog] [--deb python3.11-doc_*.deb]
    python benchmarks/text_corpus.py OUT.jsonl --source debian [--sources Sources.xz] [--translations Translation-en.xz]

Without the file options the files are fetched from Debian's archive (`apt-get download`, or
deb.debian.org: Debian's mirror, no other network); the output's summary gives their SHA-256.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import hashlib
import html
import json
import lzma
import os
import re
import subprocess
import tempfile
import urllib.request

CHANGELOG = "./usr/share/doc/python3.11/html/whatsnew/changelog.html.gz"
_TOKENS = re.compile(r"<h2>(.*?)<a|<h3>(.*?)<a|<li><p>(.*?)</p>\s*</li>", re.S)
_CREDIT = re.compile(
    r"(?:[Pp]atch(?:es)?|[Cc]ontributed|[Ii]mplemented|[Ww]ritten|[Oo]riginal patch|[Ii]nitial patch)\s+by\s+([^.;(]+)"
)
_ISSUE = re.compile(r"^\s*(?:gh|bpo)-\d+:\s*")


def _plain(fragment: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", fragment)).split())


def credited(text: str) -> list[str]:
    """The names an item credits, in order of appearance, each once."""
    names: list[str] = []
    for group in _CREDIT.findall(text):
        for name in re.split(r",\s*|\s+and\s+|\s*&\s*", group):
            name = name.strip()
            if name and len(name) < 40 and name not in names:
                names.append(name)
    return names


def records(changelog_html: str) -> list[dict]:
    """The changelog's items as records (id, users, text, label, version)."""
    version = section = ""
    out: list[dict] = []
    for match in _TOKENS.finditer(changelog_html):
        if match.group(1) is not None:
            version = _plain(match.group(1))
        elif match.group(2) is not None:
            section = _plain(match.group(2))
        else:
            item = _plain(match.group(3))
            text = _ISSUE.sub("", item)
            if not text or not section:
                continue
            record_id = len(out)
            out.append(
                {
                    "id": record_id,
                    "users": credited(text) or [f"item:{record_id}"],
                    "text": text,
                    "label": section,
                    "version": version,
                }
            )
    return out


def changelog_from_deb(deb: str) -> str:
    with tempfile.TemporaryDirectory() as directory:
        subprocess.run(["dpkg-deb", "-x", deb, directory], check=True)
        with gzip.open(os.path.join(directory, CHANGELOG), "rt", encoding="utf-8") as file:
            return file.read()


DEBIAN = "http://deb.debian.org/debian/dists/bookworm/main"
_ADDRESS = re.compile(r"<([^<>@\s]+@[^<>\s]+)>")


def deb822(text: str) -> list[dict[str, str]]:
    """The paragraphs of a Debian control file (Sources, Translation-en) as field -> value, continuation
    lines joined with newlines."""
    paragraphs: list[dict[str, str]] = []
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        name = None
        for line in block.splitlines():
            if line[:1] in (" ", "\t") and name is not None:
                fields[name] += "\n" + line[1:]
            elif ":" in line:
                name, value = line.split(":", 1)
                fields[name] = value.strip()
        if fields:
            paragraphs.append(fields)
    return paragraphs


def debian_records(sources: str, translations: str, sections: int) -> list[dict]:
    """Debian's source packages as records (id, users, text, label), labels the `sections` most common."""
    descriptions: dict[str, str] = {}
    for paragraph in deb822(translations):
        name, text = paragraph.get("Package"), paragraph.get("Description-en")
        if name and text and name not in descriptions:
            short, _, long = text.partition("\n")
            body = " ".join(line.strip() for line in long.splitlines() if line.strip() != ".")
            descriptions[name] = f"{short.strip()}. {body}".strip()
    out: list[dict] = []
    for paragraph in deb822(sources):
        name = paragraph.get("Package")
        # Package-List: "binary type section priority ...", one binary a line (a source's own Section is
        # often "misc"); the binary's section labels the record
        section_of = {
            fields[0]: fields[2].split("/")[-1]
            for fields in (line.split() for line in paragraph.get("Package-List", "").splitlines())
            if len(fields) >= 3
        }
        described = [b for b in [name, *section_of] if b in descriptions and b in section_of]
        people = paragraph.get("Maintainer", "") + "," + paragraph.get("Uploaders", "")
        users = list(dict.fromkeys(address.lower() for address in _ADDRESS.findall(people)))
        if name and described and users:
            binary = described[0]
            out.append({"id": name, "users": users, "text": descriptions[binary], "label": section_of[binary]})
    out = list({row["id"]: row for row in out}.values())  # a source listed twice: its last version
    common = collections.Counter(row["label"] for row in out).most_common(sections)
    kept = {label for label, _ in common}
    return [row for row in out if row["label"] in kept]


def _fetched(url: str, directory: str) -> str:
    path = os.path.join(directory, url.rsplit("/", 1)[1])
    urllib.request.urlretrieve(url, path)
    return path


def _sha256(path: str) -> str:
    with open(path, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("--source", choices=("changelog", "debian"), default="changelog")
    parser.add_argument("--deb", help="changelog: a python3.11-doc .deb (default: apt-get download it)")
    parser.add_argument("--sources", help="debian: Sources.xz of bookworm main (default: fetched)")
    parser.add_argument("--translations", help="debian: Translation-en.xz of bookworm main (default: fetched)")
    parser.add_argument("--sections", type=int, default=12, help="debian: the most common sections kept as labels")
    args = parser.parse_args()
    directory = tempfile.mkdtemp()
    if args.source == "changelog":
        deb = args.deb
        if deb is None:
            subprocess.run(["apt-get", "download", "python3.11-doc"], cwd=directory, check=True)
            (deb,) = glob.glob(os.path.join(directory, "python3.11-doc_*.deb"))
        items, inputs = records(changelog_from_deb(deb)), [deb]
    else:
        sources = args.sources or _fetched(f"{DEBIAN}/source/Sources.xz", directory)
        translations = args.translations or _fetched(f"{DEBIAN}/i18n/Translation-en.xz", directory)
        with lzma.open(sources, "rt", encoding="utf-8") as file, lzma.open(translations, "rt", encoding="utf-8") as t:
            items, inputs = debian_records(file.read(), t.read(), args.sections), [sources, translations]
    with open(args.output, "w", encoding="utf-8") as file:
        for item in items:
            file.write(json.dumps(item) + "\n")
    owners = collections.Counter(user for item in items for user in item["users"])
    summary = {
        "source": args.source,
        "records": len(items),
        "users": len(owners),
        "mean_users_per_record": round(sum(len(item["users"]) for item in items) / max(len(items), 1), 3),
        "largest_user_records": max(owners.values(), default=0),
        "labels": dict(collections.Counter(item["label"] for item in items).most_common()),
        "inputs": {os.path.basename(path): _sha256(path) for path in inputs},
        "output": args.output,
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
