"""Configs checked at load (issue 42, item 4): a `ValueError` naming the field and the allowed
values, never a dead engine at the first step.

The reported case first: an OLMo 2 checkpoint written by transformers' own `save_pretrained`
whose `eos_token_id` (the config class default, 50279) lies outside its 384-token vocabulary was
accepted, and the first step that banned the stop token (`min_tokens`) killed the engine core
with `IndexError: index 50279 is out of bounds`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tinymodel import make_tiny_model, make_transformers_model

from triollm.engine.loading.model_config import ModelConfig


def test_olmo2_eos_outside_vocabulary_is_refused_at_load(tmp_path: Path) -> None:
    from triollm import LLM

    path = make_transformers_model(tmp_path / "olmo2", "Olmo2ForCausalLM", eos_token_id=50279)
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == 50279
    with pytest.raises(ValueError, match=r"eos_token_id \(config.json\): 50279 is outside the vocabulary; "
                       r"allowed: 0 to 383"):  # fmt: skip
        LLM(model=str(path), max_model_len=64)


def test_in_vocabulary_tokens_still_serve(tmp_path: Path) -> None:
    """The same checkpoint with its stop token in the vocabulary loads and stops on it."""
    from triollm import LLM, SamplingParams

    path = make_transformers_model(tmp_path / "olmo2", "Olmo2ForCausalLM")
    llm = LLM(model=str(path), max_model_len=64)
    try:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, min_tokens=2))
        assert len(out[0].outputs[0].token_ids) >= 2
    finally:
        llm.shutdown()


def _write(tmp_path: Path, config: dict[str, Any] | None = None, generation: dict[str, Any] | None = None) -> Path:
    path = make_tiny_model(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | (config or {})))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


REFUSED = [
    ({"eos_token_id": 384}, None, r"eos_token_id \(config.json\): 384 is outside the vocabulary; allowed: 0 to 383"),
    ({"eos_token_id": [0, 1000]}, None, r"eos_token_id \(config.json\): 1000 is outside"),
    ({"eos_token_id": "2"}, None, r"eos_token_id \(config.json\): expected an integer token id or a list"),
    (None, {"eos_token_id": 999}, r"eos_token_id \(generation_config.json\): 999 is outside"),
    ({"bos_token_id": 400}, None, r"bos_token_id \(config.json\): 400 is outside"),
    (None, {"bos_token_id": -2}, r"bos_token_id \(generation_config.json\): -2 is outside"),
    ({"pad_token_id": 50000}, None, r"pad_token_id \(config.json\): 50000 is outside"),
    ({"num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": None}, None,
     r"num_attention_heads: 5 does not divide hidden_size 64 .*allowed: a divisor of 64"),
    ({"num_key_value_heads": 3}, None, r"num_key_value_heads: 3 does not divide num_attention_heads 4; allowed"),
    ({"rope_scaling": {"rope_type": "proportional", "factor": 2.0}}, None, r"rope_type.*proportional"),
]  # fmt: skip


@pytest.mark.parametrize(("config", "generation", "match"), REFUSED, ids=[m.split("\\")[0][:24] for *_, m in REFUSED])
def test_bad_configs_are_refused_at_load(
    tmp_path: Path, config: dict[str, Any] | None, generation: dict[str, Any] | None, match: str
) -> None:
    path = _write(tmp_path, config, generation)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_pretrained(path, max_model_len=64)


def test_accepted_special_tokens(tmp_path: Path) -> None:
    """A list of stop tokens in the vocabulary, null ids and the old "no pad" -1 load."""
    path = _write(tmp_path, {"eos_token_id": [0, 2], "bos_token_id": None, "pad_token_id": -1}, {"eos_token_id": 1})
    cfg = ModelConfig.from_pretrained(path, max_model_len=64)
    assert cfg.eos_token_ids == (1, 0, 2) and cfg.bos_token_id is None


def test_generation_config_folder_is_checked(tmp_path: Path) -> None:
    path = _write(tmp_path)
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": 4000}))
    with pytest.raises(ValueError, match=r"eos_token_id \(.*gen/generation_config.json\): 4000 is outside"):
        ModelConfig.from_pretrained(path, max_model_len=64, generation_config=str(other))
