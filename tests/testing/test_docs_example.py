"""docs/testing.md's worked example is a test: every `<!-- file: NAME -->` block of the doc is
written to a temporary directory, which is then a project of its own, and pytest runs there in
a fresh interpreter (its own conftest, its own `filterwarnings = ["error"]`, anyio's plugin and
triollm.testing's, as a user would have them). The doc's text is the tested code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "testing.md"
FILE_BLOCK = re.compile(r"<!-- file: (?P<name>[\w./-]+) -->\n```\w*\n(?P<body>.*?)\n```", re.S)


def doc_files() -> dict[str, str]:
    return {m["name"]: m["body"] + "\n" for m in FILE_BLOCK.finditer(DOC.read_text())}


def test_the_doc_holds_the_whole_example() -> None:
    files = doc_files()
    assert set(files) == {
        "pyproject.toml", "conftest.py", "test_quickstart.py", "streaming_app.py", "test_streaming_app.py"
    }
    assert 'filterwarnings = ["error"]' in files["pyproject.toml"]
    assert "triollm.testing.pytest_plugin" in files["conftest.py"]


def test_the_docs_example_passes(tmp_path: Path) -> None:
    for name, body in doc_files().items():
        (tmp_path / name).write_text(body)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    # The quick start and the disconnect test on both backends, the hypothesis test once (trio
    # under MockClock); nothing else in the summary (no warnings, no skips).
    assert re.search(r"^5 passed in [\d.]+s", output, re.M), output
