"""`triollm bench step` on a tiny random model (dense) and on the bundled one (Q4_1 blocks: the
native decoder stack runs the forward): every part of the step is in the JSON, the timed phases
are positive and disjoint (they add up to no more than the step), the floors are positive, and
bad sizes and a run past max_model_len are refused naming the flags. Speed is not checked here:
the lead measures it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from triollm.api.cli import main
from triollm.engine.execution.layers.quantized import DecodeStack

PHASES = ("forward", "logits", "sampling", "schedule", "inputs", "update", "frontend")
PARTS = (*PHASES, "linears", "attention_and_rest", "other_python", "python_around_step", "step")
PROJECTIONS = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def _bench(model: Path, out: Path, *extra: str) -> dict:
    rc = main([
        "bench", "step", "--model", str(model), "--num-threads", "1", "--json", str(out), *extra,
    ])  # fmt: skip
    assert rc == 0
    return json.loads(out.read_text())


def _check_parts(res: dict, layers: int) -> None:
    parts = res["parts"]
    assert set(PARTS) <= set(parts)
    for key in PHASES + ("linears", "step"):
        assert parts[key]["ms"] > 0, key
    timed = sum(parts[key]["ms"] for key in PHASES)
    assert timed <= parts["step"]["ms"]  # disjoint phases inside the step
    assert parts["other_python"]["ms"] == pytest.approx(parts["step"]["ms"] - timed)
    outside = parts["forward"]["ms"] + parts["logits"]["ms"] + parts["sampling"]["ms"]
    assert parts["python_around_step"]["ms"] == pytest.approx(parts["step"]["ms"] - outside)
    linears = res["linears"]
    assert set(linears) == PROJECTIONS
    assert all(v["layers"] == layers and v["ms"] > 0 and v["floor_ms"] > 0 for v in linears.values())
    assert parts["linears"]["ms"] == pytest.approx(sum(v["ms"] for v in linears.values()))
    assert parts["attention_and_rest"]["ms"] == pytest.approx(parts["forward"]["ms"] - parts["linears"]["ms"])
    for key in ("linears", "attention_and_rest", "forward", "logits", "step"):
        assert parts[key]["floor_ms"] > 0, key
    assert parts["logits"]["lm_head_alone_ms"] > 0
    assert res["gemm_peak_flops"] > 0 and res["bandwidth_bytes_per_s"] > 0
    assert res["threads"] == 1 and "model_name" in res["cpu"]


def test_tiny_model_writes_every_part(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = _bench(tiny_model_dir, tmp_path / "step.json", "--batch", "4", "--input-len", "16", "--steps", "3",
                 "--warmup", "1")  # fmt: skip
    assert (res["batch"], res["steps"], res["dtype"]) == (4, 3, "float32")
    # The first timed step feeds position 16 + 1 warm-up + the token of the prompt's last step.
    assert 16 < res["context_first"] < res["context_reached"] <= 16 + 1 + 3 + 2
    _check_parts(res, layers=2)
    assert all(v["format"] == "float32" for v in res["linears"].values())
    table = capsys.readouterr().out
    assert "| part | ms / step | % of step | floor ms |" in table
    for label in ("qkv_proj x2", "attention, norms, rotary, KV write", "whole step", "measured GEMM peak"):
        assert label in table


def test_bundled_model_times_the_native_stack(
    bundled_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0
    native = DecodeStack.__call__

    def counted(self: DecodeStack, *args: Any) -> Any:
        nonlocal calls
        calls += 1
        return native(self, *args)

    monkeypatch.setattr(DecodeStack, "__call__", counted)
    # The imported folder alone loads dense: `--quantization gguf` keeps the GGUF's Q4_1 blocks.
    res = _bench(bundled_model_dir, tmp_path / "step.json", "--quantization", "gguf", "--batch", "2",
                 "--input-len", "16", "--steps", "2", "--warmup", "1", "--max-model-len", "256")  # fmt: skip
    _check_parts(res, layers=res["num_layers"])
    assert all(v["format"] == "q4" for v in res["linears"].values())
    assert res["gemm_peak_dtype"] == "float32"
    assert calls >= 1 + 1 + 2  # the first all-decode step, the warm-up and the timed steps


@pytest.mark.parametrize("flag", ["--batch", "--input-len", "--steps"])
def test_sizes_must_be_positive(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], flag: str) -> None:
    assert main(["bench", "step", "--model", str(tiny_model_dir), flag, "0"]) == 2
    assert f"{flag}: must be at least 1, got 0" in capsys.readouterr().err


def test_a_run_past_max_model_len_is_refused(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The tiny model holds 512 positions: 500 + 5 warm-up + 20 timed + 1 do not fit.
    assert main(["bench", "step", "--model", str(tiny_model_dir), "--input-len", "500", "--batch", "2"]) == 2
    err = capsys.readouterr().err
    assert "--input-len + --warmup + --steps: 526 tokens exceed max_model_len (512)" in err
    assert "--max-model-len 526" in err
