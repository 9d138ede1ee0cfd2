"""The product's files state what is true now: no dated runs, run letters, numbered rounds of work
or mentions of who tried it in README.md, docs/, code comments or test names (history is git's), and the
README stays short enough to read as a newcomer's first page."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Built from pieces so that this file does not match itself.
HISTORY = re.compile("|".join([r"session [0-9]", "test" + "er", r"run [A-Z]\b"]), re.IGNORECASE)
TEXT = (".md", ".py", ".cc", ".h", ".cu", ".cuh", ".sh", ".txt", ".yaml", ".cmake")


def _files():
    yield os.path.join(REPO, "README.md")
    for top in ("docs", "csrc", "python", "integration", "tests", "include", "scripts", "benchmarks"):
        for d, dirs, files in os.walk(os.path.join(REPO, top)):
            dirs[:] = [x for x in dirs if x not in ("__pycache__", "data")]
            for f in files:
                if f.endswith(TEXT):
                    yield os.path.join(d, f)


def test_no_history_in_product_files():
    hits = []
    for path in _files():
        with open(path, encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                if HISTORY.search(line):
                    hits.append(f"{os.path.relpath(path, REPO)}:{n}: {line.strip()[:120]}")
    assert not hits, "\n".join(hits)


def test_readme_is_short():
    with open(os.path.join(REPO, "README.md")) as fh:
        n = sum(1 for _ in fh)
    assert n < 150, f"README.md has {n} lines"
