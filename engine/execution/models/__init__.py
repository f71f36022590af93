"""The decoder families, by `architectures[0]`, and `load_model`: the native class, or with
`model_impl` "transformers" (resolved at load, engine/loading/hf_config.py) transformers' own
modeling code over the paged cache (transformers_backend.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.layers.linear import Linear
from triollm.engine.execution.models.base import CausalLM
from triollm.engine.execution.models.deepseek import DeepseekForCausalLM
from triollm.engine.execution.models.gemma import Gemma2ForCausalLM
from triollm.engine.execution.models.gpt_neox import GPTNeoXForCausalLM
from triollm.engine.execution.models.gpt_oss import GptOssForCausalLM
from triollm.engine.execution.models.hybrid import (
    BambaForCausalLM,
    FalconH1ForCausalLM,
    GraniteMoeHybridForCausalLM,
    Lfm2ForCausalLM,
    Qwen3NextForCausalLM,
)
from triollm.engine.execution.models.llama import LlamaForCausalLM, Phi3ForCausalLM
from triollm.engine.execution.models.llama4 import Llama4ForCausalLM
from triollm.engine.execution.models.moe import MoEForCausalLM
from triollm.engine.execution.models.olmo2 import Olmo2ForCausalLM
from triollm.engine.execution.models.phi import PhiForCausalLM
from triollm.engine.execution.models.phimoe import PhimoeForCausalLM
from triollm.engine.execution.models.stablelm import StableLmForCausalLM
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.loading.weights import load_weights, materialize, quantize_model

if TYPE_CHECKING:
    from triollm.engine.distributed.collectives import Collectives

__all__ = ["MODELS", "CausalLM", "load_model"]

MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "GraniteForCausalLM": LlamaForCausalLM,
    "GemmaForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma2ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "MixtralForCausalLM": MoEForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
    "Qwen2MoeForCausalLM": MoEForCausalLM,
    "Glm4MoeForCausalLM": MoEForCausalLM,
    "OlmoeForCausalLM": MoEForCausalLM,
    "GraniteMoeForCausalLM": MoEForCausalLM,
    "GraniteMoeSharedForCausalLM": MoEForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "PhimoeForCausalLM": PhimoeForCausalLM,
    "Llama4ForCausalLM": Llama4ForCausalLM,
    "GPTNeoXForCausalLM": GPTNeoXForCausalLM,
    "PhiForCausalLM": PhiForCausalLM,
    "StableLmForCausalLM": StableLmForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "FalconH1ForCausalLM": FalconH1ForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
}


def load_model(
    cfg: ModelConfig,
    device: str | torch.device = "cpu",
    shard: TPShard | None = None,
    comm: Collectives | None = None,
) -> CausalLM:
    """The model on `device`; with `shard` (and its `comm`), only this rank's slices."""
    if cfg.model_impl == "transformers":
        from triollm.engine.execution.models.transformers_backend import load_transformers_model

        if shard is not None:
            raise ValueError("tensor_parallel_size: the Transformers backend runs on one rank; allowed: 1")
        return load_transformers_model(cfg, device)
    with torch.device("meta"):
        model = MODELS[cfg.architecture](cfg, shard)
    if cfg.quantization == "gguf":  # the blocks as shipped: their dense copies are never read
        quantize_model(model, "gguf", cfg.path)
    materialize(model, device, cfg.dtype)
    model.requires_grad_(False)
    model.to(device)
    load_weights(model, cfg.path)
    model.to_device(device)
    model.eval()
    if cfg.quantization in ("int8", "int4"):  # quantized from the dense weights just loaded
        quantize_model(model, cfg.quantization, cfg.path)
    model.pack_linears()
    if comm is not None:
        model.comm = comm
        for m in model.modules():
            if isinstance(m, Linear) and m.cols is not None:  # row-parallel layers
                m.comm = comm
    model.decode_stack = model.make_decode_stack()
    return model
