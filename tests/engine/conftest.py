"""Fixtures shared by the engine tests: the tiny model's tokenizer and model config."""

from __future__ import annotations

from pathlib import Path

import pytest

from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.processing.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model_config(tiny_model_dir: Path) -> ModelConfig:
    return ModelConfig.from_pretrained(tiny_model_dir, max_model_len=64)
