"""Real multi-owner text corpora, from Debian's archive and PyPI, as madp records (JSON Lines: id, users, text, label).

`--source changelog`: CPython's changelog, from the Debian package `python3.11-doc` (the PSF
documentation licence). Each changelog item is a record: `text` is the item (its issue number left
out), `label` the section it is filed under (Library, Core and Builtins, Tests, IDLE, Build,
Documentation, C API, Windows, Security, Tools/Demos, macOS: 11 classes, about 10,000 items of
Python 3.5 to 3.11), and `users` the people the item credits ("Patch by A and B.", "Contributed by
C.", ...). About a quarter of the items credit someone; an item that credits nobody is its own
single owner (`item:<id>`), which docs/benchmarks.md states wherever a figure comes from this corpus.

`--source debian`: the source packages of Debian 12 (bookworm, main), from the archive's index files
(`Sources.xz`; `Translation-en.xz` for the descriptions). Each source package is a record: `text`
is the description of the binary package of its name (else its first binary package with one),
short and long; `label` that binary's section, among the --sections most common (the others are
left out);
`users` its Maintainer and Uploaders by e-mail address (lower case): several people per record,
and teams (the Debian Python Team, ...) that own thousands.

`--source pypi`: Python packages on PyPI, from its JSON API (pypi.org/pypi/NAME/json) for a seeded
sample of `--packages` names of its index (pypi.org/simple). A package is a record when its
classifiers name exactly one top-level topic (`Topic :: Scientific/Engineering :: ...` is
Scientific/Engineering), among the --topics most common, and its metadata names an owner: `users`
are the e-mail addresses of its author and maintainer fields (lower case), else their names (split at
commas and "and"); `text` is its summary and the start of its description (markup, links and
addresses removed); `label` the topic. A text without a letter or digit is left out, and so is one
that an earlier package (by name) already has, so that copies cannot sit on both sides of a split.
PyPI changes every day: `--cache` keeps what was fetched (resumable: a line cut short by a stopped
run is fetched again; `--cached-only` rebuilds the records from it without network), and the
summary gives its SHA-256.

    python benchmarks/text_corpus.py OUT.jsonl [--source changelog] [--deb python3.11-doc_*.deb]
    python benchmarks/text_corpus.py OUT.jsonl --source debian [--sources Sources.xz] [--translations Translation-en.xz]
    python benchmarks/text_corpus.py OUT.jsonl --source pypi [--packages 150000] [--cache pypi.jsonl]
    python benchmarks/text_corpus.py OUT2.jsonl --source pypi --seed 1 --exclude OUT.jsonl [--cache pypi2.jsonl]

The last draws a second sample of PyPI and leaves out the packages and texts of the first: a corpus
to choose defaults on that shares no record with the one they are evaluated on.

Without the file options the files are fetched from Debian's archive (`apt-get download`, or
deb.debian.org: Debian's mirror) or PyPI, no other network; the output's summary gives their SHA-256.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import glob
import gzip
import hashlib
import html
import http.client
import json
import lzma
import os
import re
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request

import numpy as np

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


PYPI = "https://pypi.org"
_PYPI_FIELDS = ("summary", "author", "author_email", "maintainer", "maintainer_email", "classifiers")
_EMAIL = re.compile(r"[^\s<>,;:\"'()\[\]]+@[^\s<>,;:\"'()\[\]]+\.[A-Za-z]{2,}")
_MARKUP = [
    (re.compile(r"!\[[^\]]*\]\([^)]*\)"), " "),  # a markdown image (badges)
    (re.compile(r"\[([^\]]*)\]\([^)]*\)"), r"\1"),  # a markdown link: its text
    (re.compile(r"<[^>]*>"), " "),  # HTML tags
    (re.compile(r"\.\. [^\n]*"), " "),  # reStructuredText directives (images, badges)
    (re.compile(r"\|[^|\n]+\|_?"), " "),  # reStructuredText substitutions
    (re.compile(r"https?://\S+|\S+@\S+"), " "),  # links and addresses
    (re.compile(r"[#*=`_~^>|\-\[\]]{2,}|[#*`]"), " "),  # headings, rules, emphasis, code marks
]
_NAMES = re.compile(r",|;|&|\band\b|\bet al\b\.?", re.I)


def pypi_names() -> list[str]:
    """PyPI's project names (normalized), from its simple index."""
    with urllib.request.urlopen(f"{PYPI}/simple/", timeout=120) as response:
        return re.findall(r'<a href="([^"/]+)/">', response.read().decode())


_CONNECTION = threading.local()  # one kept-alive HTTPS connection per thread: a TLS handshake costs more than a page


def _pypi_json(path: str, redirects: int = 3) -> dict:
    connection = getattr(_CONNECTION, "pypi", None) or http.client.HTTPSConnection("pypi.org", timeout=60)
    _CONNECTION.pypi = None  # until the response is read whole
    connection.request("GET", path)
    response = connection.getresponse()
    body = response.read()
    _CONNECTION.pypi = connection
    location = response.getheader("Location", "")
    if response.status in (301, 302, 307, 308) and redirects and location.startswith(("/", PYPI)):
        return _pypi_json(location.removeprefix(PYPI), redirects - 1)
    if response.status != 200:
        raise urllib.error.HTTPError(path, response.status, response.reason, response.headers, None)
    return json.loads(body)


def pypi_info(name: str) -> dict:
    """A project's metadata fields used here and the start of its description, or {"missing": why}."""
    try:
        info = _pypi_json(f"/pypi/{name}/json")["info"]
    except (OSError, http.client.HTTPException, ValueError, KeyError) as error:
        return {"name": name, "missing": f"{type(error).__name__}: {error}"[:200]}
    fields = {field: info.get(field) for field in _PYPI_FIELDS}
    return {"name": name, **fields, "description": (info.get("description") or "")[:8000]}


def cached_pypi(cache: str) -> dict[str, dict]:
    """The `pypi_info` entries of a cache file (JSON Lines) by name, but those missing for a transient
    reason (anything but a 404): `fetch_pypi` fetches them again. A last line cut short (no newline:
    a run stopped as it wrote it) is left out, so its package is fetched again; any other line that
    is not an entry stops the run, naming it."""
    known: dict[str, dict] = {}
    if not os.path.exists(cache):
        return known
    with open(cache, encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            try:
                entry = json.loads(line)
                name, missing = entry["name"], entry.get("missing")
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                if not line.endswith("\n"):
                    print(f"{cache}: line {number} is cut short (a stopped run); left out", file=sys.stderr)
                    break
                raise SystemExit(f"{cache}: line {number} is not a package entry of this script's cache") from None
            if missing is None or "HTTP Error 404" in missing:
                known[name] = entry
    return known


def _cut_line_removed(cache: str) -> None:
    """Truncate `cache` after its last newline: an entry appended then starts on a line of its own. An
    entry is a few kB (`pypi_info` keeps 8,000 characters of a description), so its last MiB holds it."""
    with open(cache, "rb+") as file:
        start = max(file.seek(0, os.SEEK_END) - (1 << 20), 0)
        file.seek(start)
        file.truncate(start + file.read().rfind(b"\n") + 1)


def fetch_pypi(names: list[str], cache: str, threads: int) -> list[dict]:
    """Each name's `pypi_info`, read from `cache` (`cached_pypi`) where it is there, else fetched and
    appended to it."""
    known = cached_pypi(cache)
    todo = [name for name in names if name not in known]
    if os.path.exists(cache):
        _cut_line_removed(cache)
    with open(cache, "a", encoding="utf-8") as out, concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for done, entry in enumerate(pool.map(pypi_info, todo), 1):
            known[entry["name"]] = entry
            out.write(json.dumps(entry) + "\n")
            if done % 2000 == 0:
                print(f"fetched {done} of {len(todo)} packages", file=sys.stderr, flush=True)
    return [known[name] for name in names]


def plain_description(text: str) -> str:
    """A README's prose: markdown and reStructuredText markup, HTML, links and addresses removed."""
    for pattern, replacement in _MARKUP:
        text = pattern.sub(replacement, text)
    return " ".join(text.split())


def pypi_users(info: dict) -> list[str]:
    """The owners a package's metadata names: its author and maintainer addresses, else names."""
    fields = [info.get(field) or "" for field in ("author", "author_email", "maintainer", "maintainer_email")]
    addresses = [a.lower() for a in _EMAIL.findall(" ".join(fields[1::2]) + " " + " ".join(fields[::2]))]
    if addresses:
        return list(dict.fromkeys(addresses))
    names = [n.strip().lower() for n in _NAMES.split(" , ".join(fields[::2]))]
    return list(dict.fromkeys(n for n in names if n and n not in ("none", "unknown", "n/a") and len(n) < 60))


def pypi_records(infos: list[dict], topics: int, text_chars: int = 600) -> list[dict]:
    """Packages as records (id, users, text, label): one top-level topic among the `topics` most common."""
    out: list[dict] = []
    seen: set[str] = set()
    for info in sorted((i for i in infos if "missing" not in i), key=lambda i: i["name"]):
        top = {c.split(" :: ")[1] for c in info["classifiers"] or [] if c.startswith("Topic :: ")}
        users = pypi_users(info) if len(top) == 1 else []
        if not users:  # before the description's markup is removed, the most work per package
            continue
        summary = " ".join((info["summary"] or "").split())
        text = f"{summary}. {plain_description(info['description'])}"[:text_chars].strip(" .")
        if any(c.isalnum() for c in text) and text.lower() not in seen:
            seen.add(text.lower())
            out.append({"id": info["name"], "users": users, "text": text, "label": top.pop()})
    kept = {label for label, _ in collections.Counter(row["label"] for row in out).most_common(topics)}
    return [row for row in out if row["label"] in kept]


def disjoint(items: list[dict], excluded: list[dict]) -> list[dict]:
    """The records of `items` whose id and text (in lower case, as `pypi_records` compares them) no
    record of `excluded` has: a second corpus that shares no record with the first."""
    ids, texts = {row["id"] for row in excluded}, {row["text"].lower() for row in excluded}
    return [item for item in items if item["id"] not in ids and item["text"].lower() not in texts]


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
    parser.add_argument("--source", choices=("changelog", "debian", "pypi"), default="changelog")
    parser.add_argument("--deb", help="changelog: a python3.11-doc .deb (default: apt-get download it)")
    parser.add_argument("--sources", help="debian: Sources.xz of bookworm main (default: fetched)")
    parser.add_argument("--translations", help="debian: Translation-en.xz of bookworm main (default: fetched)")
    parser.add_argument("--sections", type=int, default=12, help="debian: the most common sections kept as labels")
    parser.add_argument("--packages", type=int, default=150_000, help="pypi: project names sampled (seeded)")
    parser.add_argument("--topics", type=int, default=10, help="pypi: the most common topics kept as labels")
    parser.add_argument("--seed", type=int, default=0, help="pypi: the seed of the names' sample")
    parser.add_argument(
        "--exclude", help="a corpus (JSON Lines) whose records (by id) and texts are left out: a disjoint second one"
    )
    parser.add_argument("--cache", help="pypi: JSON Lines of the fetched metadata (default: in a temporary folder)")
    parser.add_argument("--threads", type=int, default=48, help="pypi: concurrent requests")
    parser.add_argument("--cached-only", action="store_true", help="pypi: the --cache file's packages, no network")
    args = parser.parse_args()
    if args.cached_only and not (args.cache and os.path.exists(args.cache)):
        parser.error(f"--cached-only reads an existing --cache file, not {args.cache!r}")
    directory = tempfile.mkdtemp()
    if args.source == "changelog":
        deb = args.deb
        if deb is None:
            subprocess.run(["apt-get", "download", "python3.11-doc"], cwd=directory, check=True)
            (deb,) = glob.glob(os.path.join(directory, "python3.11-doc_*.deb"))
        items, inputs = records(changelog_from_deb(deb)), [deb]
    elif args.source == "pypi" and args.cached_only:
        items, inputs = pypi_records(list(cached_pypi(args.cache).values()), args.topics), [args.cache]
    elif args.source == "pypi":
        names = sorted(pypi_names())
        sample = np.random.default_rng(args.seed).choice(len(names), min(args.packages, len(names)), replace=False)
        sample = sorted(sample)
        cache = args.cache or os.path.join(directory, "pypi.jsonl")
        items, inputs = pypi_records(fetch_pypi([names[i] for i in sample], cache, args.threads), args.topics), [cache]
    else:
        sources = args.sources or _fetched(f"{DEBIAN}/source/Sources.xz", directory)
        translations = args.translations or _fetched(f"{DEBIAN}/i18n/Translation-en.xz", directory)
        with lzma.open(sources, "rt", encoding="utf-8") as file, lzma.open(translations, "rt", encoding="utf-8") as t:
            items, inputs = debian_records(file.read(), t.read(), args.sections), [sources, translations]
    if args.exclude:
        items = disjoint(items, [json.loads(line) for line in open(args.exclude, encoding="utf-8")])
        inputs.append(args.exclude)
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
