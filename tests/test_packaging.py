"""Every package directory of the source tree is listed in pyproject.toml, so a wheel (not only
an editable install) carries it."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
SKIP = {"tests", "docs", "build", ".venv", ".git"}


def test_every_package_is_listed() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"triollm"}
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts and (rel.parts[0] in SKIP or rel.parts[0].startswith(".")):
            continue
        found.add(".".join(("triollm", *rel.parts)))
    assert listed == found


def test_native_kernel_sources_ship_with_the_package() -> None:
    """kernels/cpu_native.py compiles kernels/csrc/*.cpp (and their headers) at run time: a
    wheel must carry them, and the build must list every source."""
    from triollm.kernels import cpu_native

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    sources = sorted(p.name for p in (ROOT / "kernels" / "csrc").glob("*.cpp"))
    assert sources and data.get("triollm.kernels") == ["csrc/*.cpp", "csrc/*.h"]
    assert sorted(p.name for p in cpu_native._SOURCES) == sources
