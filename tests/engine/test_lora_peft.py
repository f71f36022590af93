"""lora/peft.py: PEFT adapter checkpoints read and checked, every refusal naming its field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from triollm.lora.peft import LORA_MODULES, read_adapter_config, read_adapter_weights
from triollm.lora.request import LoRARequest


def _adapter(path: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "bias": "none"}
    cfg.update(config or {})
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is None:
        key = "base_model.model.model.layers.{}.self_attn.{}.lora_{}.weight"
        tensors = {}
        for layer in range(2):
            for m, out in (("q_proj", 16), ("v_proj", 8)):
                tensors[key.format(layer, m, "A")] = torch.randn(4, 16)
                tensors[key.format(layer, m, "B")] = torch.randn(out, 4)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def test_config_read_with_scaling(tmp_path: Path) -> None:
    cfg = read_adapter_config(_adapter(tmp_path / "a"))
    assert (cfg.rank, cfg.alpha, cfg.target_modules, cfg.scaling) == (4, 8.0, ("q_proj", "v_proj"), 2.0)
    rs = read_adapter_config(_adapter(tmp_path / "b", {"use_rslora": True}))
    assert rs.scaling == 8 / 2  # alpha / sqrt(r)
    assert (
        read_adapter_config(_adapter(tmp_path / "c", {"target_modules": "all-linear"})).target_modules == LORA_MODULES
    )
    regex = read_adapter_config(_adapter(tmp_path / "d", {"target_modules": r".*\.(q|k)_proj"}))
    assert regex.target_modules == ("q_proj", "k_proj")
    weights = read_adapter_weights(cfg, num_layers=2)
    assert sorted(weights) == [(0, "q_proj"), (0, "v_proj"), (1, "q_proj"), (1, "v_proj")]
    a, b = weights[(0, "v_proj")]
    assert a.shape == (4, 16) and b.shape == (8, 4) and a.dtype == torch.float32


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"alpha_pattern": {"q_proj": 8}}, "alpha_pattern"),
        ({"layers_to_transform": [0]}, "layers_to_transform"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"lora_bias": True}, "lora_bias"),
        ({"target_parameters": ["experts.gate_up_proj"]}, "target_parameters"),
        ({"bias": "all"}, "bias"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"r": 0}, "r must be"),
        ({"r": 64}, "max_lora_rank"),
        ({"lora_alpha": "x"}, "lora_alpha"),
        ({"target_modules": ["embed_tokens"]}, "target_modules"),
        ({"target_modules": "nothing_here"}, "target_modules"),
        ({"use_rslora": "yes"}, "use_rslora"),
    ],
)
def test_config_refusals_name_the_field(tmp_path: Path, config: dict, field: str) -> None:
    path = _adapter(tmp_path / "a", config)
    with pytest.raises(ValueError, match=field) as err:
        read_adapter_config(path, max_lora_rank=16)
    assert str(path) in str(err.value)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lora_path.*not a LoRA adapter directory"):
        read_adapter_config(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="is not a LoRA adapter directory"):
        read_adapter_config(empty)
    pickled = _adapter(tmp_path / "bin")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(ValueError, match="safe_serialization"):
        read_adapter_config(pickled)
    bad = _adapter(tmp_path / "json")
    (bad / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_adapter_config(bad)
    truncated = _adapter(tmp_path / "trunc")
    (truncated / "adapter_model.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(ValueError, match="could not be read"):
        read_adapter_weights(read_adapter_config(truncated), 2)


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ({"base_model.model.model.embed_tokens.lora_embedding_A": torch.randn(4, 8)}, "not a LoRA A/B"),
        ({"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.randn(4, 16)}, "not in target_modules"),
        ({"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.randn(4, 16)}, "layer 9"),
        ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(3, 16)}, "rank r=4"),
        ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 16)}, "without its pair"),
    ],
)
def test_weights_refusals(tmp_path: Path, tensors: dict, match: str) -> None:
    cfg = read_adapter_config(_adapter(tmp_path / "a", tensors=tensors))
    with pytest.raises(ValueError, match=match):
        read_adapter_weights(cfg, num_layers=2)


def test_lora_request_fields() -> None:
    r = LoRARequest("sql", 3, "/adapters/sql")
    assert (r.adapter_id, r.name, r.path) == (3, "sql", "/adapters/sql")
    for bad, field in (
        ({"lora_int_id": 0}, "lora_int_id"),
        ({"lora_name": ""}, "lora_name"),
        ({"lora_path": ""}, "lora_path"),
    ):
        kwargs = {"lora_name": "sql", "lora_int_id": 3, "lora_path": "/x", **bad}
        with pytest.raises(ValueError, match=field):
            LoRARequest(**kwargs)  # type: ignore[arg-type]
