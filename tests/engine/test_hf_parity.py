"""Token parity with transformers on checkpoints that transformers itself wrote.

Each tiny model is built with transformers' config class and `save_pretrained`, so config.json is
in the installed transformers' (5.x) format: RoPE in `rope_parameters`, `dtype`, `layer_types`.
The same directory with config.json rewritten in the 4.x format (top-level `rope_theta`,
`rope_scaling`, `torch_dtype`, no `layer_types`) must give the same tokens. Every case sets a
field whose default would give other numbers (rope_theta, a scaling type, head_dim, biases, tied
or untied head), so a field read the wrong way fails the 1e-3 logprob check, not just by luck.

The bundled SmolLM2 re-saved by transformers (5.x format) is the real-model check, with chat
prompts through `triollm.LLM`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from test_parity import assert_parity, engine_greedy, hf_greedy, tiny_prompts
from tinymodel import make_transformers_model

from triollm.engine.loading.model_config import ModelConfig

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # The defect that started this: theta only in rope_parameters.
    "llama-theta": ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}),
    "llama-linear-bias-tied": (
        "LlamaForCausalLM",
        {
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0},
            "attention_bias": True,  # q, k, v and o_proj
            "mlp_bias": True,
            "tie_word_embeddings": True,
        },
    ),
    "llama-llama3-headdim": (
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 500000.0,
            },
            "head_dim": 32,
        },
    ),
    "llama-yarn": (
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 16.0,
                "rope_theta": 50000.0,
            }
        },
    ),
    "llama-dynamic": (
        "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 20000.0}},
    ),
    "mistral-window-mqa": (
        "MistralForCausalLM",
        {
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_window": 4096,  # >= max_model_len: changes nothing
            "num_key_value_heads": 1,
            "head_dim": 32,
        },
    ),
    "qwen2-bias-window": (
        "Qwen2ForCausalLM",
        {
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "use_sliding_window": True,
            "sliding_window": 256,  # >= max_model_len, on layer 1 only
            "max_window_layers": 1,
            "rms_norm_eps": 1e-6,
        },
    ),
}
GENERATIONS = ("5.x", "4.x")
PROMPTS = tiny_prompts()[:4]


def to_legacy(config: dict[str, Any]) -> dict[str, Any]:
    """config.json as transformers 4.x wrote it (rope_theta + rope_scaling, torch_dtype)."""
    legacy = dict(config, transformers_version="4.46.0")
    rope = dict(legacy.pop("rope_parameters"))
    legacy["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    # linear and dynamic in the oldest spelling ("type"), the others as 4.4x wrote them.
    legacy["rope_scaling"] = (
        None if kind == "default" else {("type" if kind in ("linear", "dynamic") else "rope_type"): kind, **rope}
    )
    legacy["torch_dtype"] = legacy.pop("dtype")
    legacy.pop("layer_types", None)
    return legacy


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    dirs: dict[tuple[str, str], Path] = {}
    for i, (name, (arch, overrides)) in enumerate(CASES.items()):
        new = make_transformers_model(tmp_path_factory.mktemp(name), arch, seed=10 + i, **overrides)
        old = tmp_path_factory.mktemp(f"{name}-legacy")
        for f in new.iterdir():
            shutil.copy(f, old / f.name)
        config = json.loads((new / "config.json").read_text())
        (old / "config.json").write_text(json.dumps(to_legacy(config), indent=2))
        dirs[name, "5.x"], dirs[name, "4.x"] = new, old
    return dirs


def test_saved_configs_are_in_each_generations_format(model_dirs: dict[tuple[str, str], Path]) -> None:
    new = json.loads((model_dirs["llama-theta", "5.x"] / "config.json").read_text())
    assert new["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert "rope_theta" not in new and "rope_scaling" not in new and new["dtype"] == "float32"
    old = json.loads((model_dirs["llama-theta", "4.x"] / "config.json").read_text())
    assert old["rope_theta"] == 100000.0 and "rope_parameters" not in old and old["torch_dtype"] == "float32"


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_parity_with_transformers(model_dirs: dict[tuple[str, str], Path], case: str, generation: str) -> None:
    path = model_dirs[case, generation]
    ours, _ = engine_greedy(path, PROMPTS, "chunked")
    assert_parity(ours, hf_greedy(path, PROMPTS))


def test_both_generations_parse_to_the_same_config(model_dirs: dict[tuple[str, str], Path]) -> None:
    for case in CASES:
        new = ModelConfig.from_pretrained(model_dirs[case, "5.x"], max_model_len=160)
        old = ModelConfig.from_pretrained(model_dirs[case, "4.x"], max_model_len=160)
        assert {**vars(new), "path": None} == {**vars(old), "path": None}, case


# ------------------------------------------------------------------------------ bundled model

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


@pytest.fixture(scope="module")
def resaved_bundled_dir(bundled_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled SmolLM2 loaded by transformers and written back by its save_pretrained."""
    import transformers

    out = tmp_path_factory.mktemp("smollm2-resaved")
    model = transformers.AutoModelForCausalLM.from_pretrained(bundled_model_dir, dtype=torch.float32)
    model.save_pretrained(out)
    for f in bundled_model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.slow
def test_bundled_model_resaved_by_transformers_chat_parity(resaved_bundled_dir: Path) -> None:
    import transformers

    from triollm import LLM, SamplingParams

    config = json.loads((resaved_bundled_dir / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 100000.0 and "rope_theta" not in config
    new_tokens = 24
    hf_tok = transformers.AutoTokenizer.from_pretrained(resaved_bundled_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(resaved_bundled_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: EOS neither stops nor is banned
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with LLM(str(resaved_bundled_dir), max_model_len=512, multiprocess=False) as llm:
        outs = llm.chat(CHATS, params, use_tqdm=False)
    for chat, out in zip(CHATS, outs):
        ids = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert out.prompt_token_ids == list(ids)
        with torch.inference_mode():
            ref = model.generate(
                torch.tensor([ids]),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        assert list(out.outputs[0].token_ids) == ref[0, len(ids) :].tolist()
