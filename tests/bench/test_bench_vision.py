"""`triollm bench vision` on a tiny random LLaVA: each round's first request encodes its image
and finds nothing cached, the same image again is served from the prefix cache without running
the tower (the counts the benchmark reports are the tower's own counter and the outputs'
`num_cached_tokens`, so a benchmark that stopped measuring a hit would fail here). Speed is not
checked: the lead measures it (docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vision_models import make_llava

from triollm.api.cli import main


def test_bench_vision_reports_a_hit_without_the_tower(tmp_path: Path) -> None:
    model = make_llava(tmp_path / "llava")
    out = tmp_path / "vision.json"
    rc = main([
        "bench", "vision", "--model", str(model), "--rounds", "2", "--image-size", "40",
        "--max-model-len", "256", "--output-json", str(out),
    ])  # fmt: skip
    assert rc == 0
    res = json.loads(out.read_text())
    assert len(res["rounds"]) == 2 and res["prompt_tokens"] > 16  # 16 image positions + text
    for r in res["rounds"]:
        assert r["cold"]["images_encoded"] == 1 and r["cold"]["cached_tokens"] == 0
        assert r["hit"]["images_encoded"] == 0 and r["hit"]["cached_tokens"] >= 16
        assert r["cold"]["prompt_tokens"] == r["hit"]["prompt_tokens"] == res["prompt_tokens"]
    assert res["hit_over_cold"] == pytest.approx(res["hit_ttft_s"] / res["cold_ttft_s"])


def test_bench_vision_refuses_a_text_model(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "vision", "--model", str(tiny_model_dir), "--rounds", "1"])
    assert rc == 2 and "is not a vision-language model" in capsys.readouterr().err
