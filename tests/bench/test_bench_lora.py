"""`triollm bench lora` on the tiny model: both engines run and the ratios are reported; the
random adapters it writes are PEFT checkpoints that lora/peft.py reads whole."""

from __future__ import annotations

import json
from pathlib import Path

from triollm.api.cli import main
from triollm.bench.lora import write_random_adapter


def test_bench_lora_reports_both_ratios(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    rc = main([
        "bench", "lora", "--model", str(tiny_model_dir), "--num-prompts", "8", "--min-input-len", "8",
        "--max-input-len", "24",
        "--max-output-len", "12", "--min-output-len", "4", "--num-adapters", "2", "--rank", "8",
        "--decode-tokens", "8", "--output-json", str(out), "--num-threads", "1",
    ])  # fmt: skip
    assert rc == 0
    res = json.loads(out.read_text())
    for key in (
        "base/output_tokens_per_s",
        "lora/output_tokens_per_s",
        "base/batch1_ms_per_token",
        "lora/batch1_ms_per_token",
    ):
        assert res[key] > 0, key
    assert res["ratio/throughput"] == res["lora/output_tokens_per_s"] / res["base/output_tokens_per_s"]


def test_random_adapter_is_a_valid_peft_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    from triollm.engine.loading.model_config import ModelConfig
    from triollm.lora.peft import read_adapter_config, read_adapter_weights

    model = ModelConfig.from_pretrained(tiny_model_dir, "float32", None, "cpu", "auto")
    path = write_random_adapter(tmp_path / "a", model, 8, 0)
    cfg = read_adapter_config(path, max_lora_rank=8)
    assert cfg.rank == 8 and len(cfg.target_modules) == 7
    weights = read_adapter_weights(cfg, model.num_layers)
    assert len(weights) == 7 * model.num_layers
