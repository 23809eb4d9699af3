"""The pages' code blocks run as the docs' convention says (`code_blocks`): one test per page, and the
runner's own tests on small pages of its own."""

from __future__ import annotations

import glob
import os
import re

import pytest
from code_blocks import BlockFailed, blocks, run_page
from conftest import ROOT

pytestmark = pytest.mark.docs

PAGES = sorted(
    os.path.relpath(path, ROOT)
    for pattern in ("README.md", "docs/tutorials/*.md", "docs/how-to/*.md")
    for path in glob.glob(os.path.join(ROOT, pattern))
)


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_the_code_blocks_of_a_page_run(page, tmp_path):
    with open(os.path.join(ROOT, page), encoding="utf-8") as handle:
        run_page(page, handle.read(), str(tmp_path), ROOT)


FAKE = """# A page

```python
for factor in (6,):  # an indented line keeps its indentation
    answer = factor * 7
```

<!-- file: job.yaml -->
```yaml
run_dir: out
```

```bash
test -f job.yaml && test "$MADP_REPO" = "{repo}" && madp --help >/dev/null
python -c "print('from bash')" > printed.txt
```

```python
assert answer == 42  # the page's namespace
assert open("printed.txt").read() == "from bash\\n"  # its directory
```

<!-- not-run: needs a cluster -->
```bash
exit 1
```

```text
not run
```
"""


def test_the_runner_runs_a_page_in_order_in_one_directory_and_one_namespace(tmp_path):
    ran = run_page("fake.md", FAKE.format(repo=ROOT), str(tmp_path), ROOT)
    assert ran == ["fake.md:4", "fake.md:10", "fake.md:14", "fake.md:19"]
    with open(tmp_path / "work" / "job.yaml", encoding="utf-8") as handle:
        assert handle.read() == "run_dir: out\n"  # the file block, written


@pytest.mark.parametrize("language, failing", [("bash", "no-such-command"), ("python", "1 / 0")])
def test_a_failing_block_fails_the_page_by_its_line(tmp_path, language, failing):
    page = f"# Title\n\n```{language}\nx = 1\n```\n\n```{language}\n\n{failing}\n```\n"
    if language == "bash":
        page = page.replace("x = 1", "x=1")
    with pytest.raises(BlockFailed, match=r"^fake\.md:8: ") as failed:
        run_page("fake.md", page, str(tmp_path), ROOT)
    assert re.search(r"fake\.md.{0,12}line 9\b", str(failed.value))  # the error names the page's line


@pytest.mark.parametrize("mark", ["<!-- not-run -->", "<!-- not-run: -->", "<!-- not-run:   -->", "<!-- file: -->"])
def test_a_mark_without_its_reason_or_name_fails(tmp_path, mark):
    with pytest.raises(BlockFailed, match=r"^fake\.md:3: .* needs a"):
        run_page("fake.md", f"# Title\n\n{mark}\n```bash\ntrue\n```\n", str(tmp_path), ROOT)


def test_a_file_block_stays_inside_the_pages_directory(tmp_path):
    with pytest.raises(BlockFailed, match="inside the page's directory"):
        run_page("fake.md", "<!-- file: ../x.yaml -->\n```yaml\na: 1\n```\n", str(tmp_path), ROOT)


def test_blocks_are_read_with_their_language_line_and_mark():
    text = "intro\n\n<!-- not-run: a GPU -->\n\n````bash\necho ```\n````\n\n  ```python\n  x = 1\n  ```\n"
    assert blocks("p.md", text) == [
        ("bash", "echo ```\n", 6, None, "a GPU"),
        ("python", "x = 1\n", 10, None, None),
    ]
