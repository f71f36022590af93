"""Reading a checkpoint into a model: names mapped to modules, stacked pieces, per-rank slices.

The model is built on the meta device; `materialize` gives every parameter still on meta real
(uninitialised) storage of the model's dtype on the target device, and `load_weights` fills it
from the safetensors files, tensor by tensor, never holding a second copy of the model:

1. the model's `remap` turns a checkpoint name into ours (drops `model.`, maps Mixtral's
   `block_sparse_moe.w1` to `mlp.gate_proj`, ...) or skips it (rotary buffers, a tied head);
2. an expert's tensor (`...experts.{e}.gate_proj.weight`, or transformers 5's stacked
   `experts.gate_up_proj`) goes to its `FusedMoE` (layers/moe.py);
3. a name the model stacks (`q_proj` -> piece 0 of `qkv_proj`, STACKED in models/base.py) goes to
   that piece, and a tensor the checkpoint already holds stacked (Phi-3's `qkv_proj`,
   `fused_pieces`) is cut into its pieces;
4. the module's `load` copies only this rank's rows or columns (layers/linear.py): a safetensors
   slice reads just those bytes.

Every parameter must be filled, every piece of it: a tensor the model has no place for, a missing
one, or one of the wrong shape is a `ValueError` naming it. `quantize_model` swaps the decoder
layers' projections for quantized ones (layers/quantized.py) before loading ("gguf": the GGUF's
own blocks, whose dense copies are then never read) or after it ("int8"/"int4").

A checkpoint with a `quantization_config` (GPTQ, AWQ, compressed-tensors, FP8:
quant_checkpoints.py) is read in a first pass, module by module: run by its own method, each
decoder projection (and an untied lm_head) becomes a QuantLinear of the checkpoint's codes,
the pieces of a stacked one (q|k|v, gate|up) concatenated; FP8 weights, experts, routers and
any other quantized tensor are dequantized into their dense layer. Run with quantization
"none", "int8" or "int4", every quantized weight is dequantized (exactly, in fp32) and loads as
a float checkpoint's would. A stacked projection whose pieces cannot share one QuantLinear
(different bits, or act-order permutations that differ) is dequantized too, with a warning: it
computes the same, in more bytes. The dense pass then skips the tensors read there; biases,
norms and embeddings load as usual.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn

from triollm.engine.execution.layers.linear import Linear
from triollm.engine.execution.layers.moe import FusedMoE, load_expert_weight
from triollm.engine.execution.layers.quantized import (
    GGUFQuantized,
    QuantEmbedding,
    QuantLinear,
)
from triollm.engine.loading.quant_checkpoints import (
    CheckpointQuant,
    IntLinear,
    WeightScheme,
    module_tensors,
    quantized_modules,
    read_linear,
)
from triollm.kernels.quant import BLOCK, QuantWeight

if TYPE_CHECKING:
    from triollm.engine.execution.models.base import CausalLM

__all__ = ["checkpoint_files", "load_weights", "materialize", "quantize_model"]

_EXPERT_KINDS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
logger = logging.getLogger("triollm")


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    # The GGUF import's quantized blocks are read by quantize_model, not here.
    files = sorted(f for f in path.glob("*.safetensors") if f.name != "gguf_quantized.safetensors")
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {path}")
    return files


def materialize(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> None:
    """Give every parameter on the meta device real, uninitialised storage (`dtype`, `device`)."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                setattr(
                    module,
                    name,
                    nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device), requires_grad=False),
                )


class _Rows:
    """A view of a checkpoint tensor from row `offset` on: one piece of a stacked tensor."""

    def __init__(self, source: Any, offset: int) -> None:
        self.source, self.offset = source, offset

    def __getitem__(self, key: Any) -> torch.Tensor:
        first = key[0] if isinstance(key, tuple) else key
        shifted = slice(first.start + self.offset, first.stop + self.offset)
        return self.source[(shifted, *key[1:]) if isinstance(key, tuple) else shifted]  # type: ignore[no-any-return]


def load_weights(model: CausalLM, path: Path) -> None:
    """Fill the model's parameters from the checkpoint in `path` (module note)."""
    filled: dict[str, set[Any]] = {}
    files = checkpoint_files(path)
    read: set[str] = set()
    quant = model.cfg.checkpoint_quant
    if quant is not None:
        with _Tensors(files) as tensors:
            read = _load_quantized(model, quant, tensors, filled)
    modules = dict(model.named_modules())
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name in read:
                    continue
                ours = model.remap(name)
                if ours is None:
                    continue
                where = _load_one(model, modules, ours, f.get_slice(name))
                if where is None:
                    raise ValueError(f"model: unexpected tensor {name!r} in {file.name}")
                param, pieces = where
                filled.setdefault(param, set()).update(pieces)
    missing = [
        name
        for name, count in _expected(model).items()
        if len(filled.get(name, ())) < count
    ]
    if missing:
        raise ValueError(f"model: checkpoint in {path} lacks tensors: {', '.join(sorted(missing)[:5])}")


class _Tensors:
    """Every tensor of a checkpoint's files by name, opened once (quant_checkpoints.Tensors)."""

    def __init__(self, files: list[Path]) -> None:
        self._files, self._stack = files, ExitStack()
        self._where: dict[str, Any] = {}

    def __enter__(self) -> _Tensors:
        for file in self._files:
            f = self._stack.enter_context(safe_open(str(file), framework="pt"))
            self._where.update(dict.fromkeys(f.keys(), f))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def get(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)  # type: ignore[no-any-return]


def _load_quantized(
    model: CausalLM, quant: CheckpointQuant, tensors: _Tensors, filled: dict[str, set[Any]]
) -> set[str]:
    """The first pass over a quantized checkpoint (module note); the names of the tensors read."""
    keep = model.cfg.quantization == quant.method
    read: set[str] = set()
    stacks: dict[str, dict[int | None, tuple[str, WeightScheme, str]]] = {}
    dense: list[tuple[str, WeightScheme, str]] = []
    for prefix, scheme in quantized_modules(tensors, quant).items():
        read.update(module_tensors(tensors, prefix, scheme))
        ours = model.remap(f"{prefix}.weight")
        if ours is None:
            continue  # a tied lm_head: the embedding is the head
        path, piece = _target(model, ours)
        if keep and not scheme.dense and _keeps_quantized(model, path):
            stacks.setdefault(path, {})[piece] = (prefix, scheme, ours)
        else:
            dense.append((prefix, scheme, ours))
    for path, pieces in stacks.items():
        if not _quantize_from_checkpoint(model, path, pieces, tensors, quant.zero_offset):
            dense.extend(pieces.values())
    modules = dict(model.named_modules())
    for prefix, scheme, ours in dense:
        weight = read_linear(tensors, prefix, scheme, quant.zero_offset)
        where = _load_one(model, modules, ours, weight.dequantize() if isinstance(weight, IntLinear) else weight)
        if where is None:
            raise ValueError(f"model: unexpected quantized tensors of {prefix!r} in the checkpoint")
        filled.setdefault(where[0], set()).update(where[1])
    return read


def _target(model: CausalLM, ours: str) -> tuple[str, int | None]:
    """The module a checkpoint weight (our name) goes to, and which piece of it: None where the
    checkpoint holds the module's pieces fused (Phi-3)."""
    path, _, _ = ours.rpartition(".")
    owner, _, sub = path.rpartition(".")
    if sub in model.stacked:
        stacked, piece = model.stacked[sub]
        return (f"{owner}.{stacked}" if owner else stacked), piece
    return path, None if model.fused_pieces(path) is not None else 0


def _keeps_quantized(model: CausalLM, path: str) -> bool:
    """Where a checkpoint's quantized weight stays quantized: the decoder layers' projections
    (experts and routers stay dense, as with int8/int4) and an untied lm_head."""
    if path == "lm_head":
        return model.lm_head is not None
    return path.startswith("layers.") and ".experts" not in path and not path.endswith(".gate")


def _quantize_from_checkpoint(
    model: CausalLM,
    path: str,
    pieces: dict[int | None, tuple[str, WeightScheme, str]],
    tensors: _Tensors,
    zero_offset: int,
) -> bool:
    """Replace Linear `path` by a QuantLinear of the checkpoint's pieces; False (nothing replaced)
    where they cannot share one (module note)."""
    dense = model.get_submodule(path)
    if not isinstance(dense, Linear):
        return False
    order: list[int | None] = [None] if None in pieces else list(range(len(dense.rows)))
    if set(order) != set(pieces):
        return False  # some pieces stored in float: the layer stays dense
    parts = [read_linear(tensors, pieces[i][0], pieces[i][1], zero_offset) for i in order]
    assert all(isinstance(p, IntLinear) for p in parts)  # FP8 (dense) weights never get here
    ints = [p for p in parts if isinstance(p, IntLinear)]
    first = ints[0].perm
    same_perm = all(
        p.perm is None if first is None else p.perm is not None and torch.equal(p.perm, first) for p in ints
    )
    if len({p.bits for p in ints}) != 1 or not same_perm:
        logger.warning("%s: its pieces differ in bits or act order; dequantized to %s", path, model.cfg.dtype)
        return False
    weight = QuantWeight.cat([p.quant_weight(pieces[i][0]) for p, i in zip(ints, order, strict=True)])
    if weight.shape != (dense.out_features, dense.in_features):
        raise ValueError(
            f"model: the quantized {path} is {list(weight.shape)}, expected [{dense.out_features}, {dense.in_features}]"
        )
    bias = None if dense.bias is None else dense.bias.detach()  # loaded by the dense pass
    quant = QuantLinear(weight, bias, ints[0].perm)
    quant.rows, quant.cols = dense.rows, dense.cols
    owner, _, attr = path.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attr, quant)
    return True


def _load_one(model: CausalLM, modules: dict[str, nn.Module], name: str, source: Any) -> tuple[str, list[Any]] | None:
    """Load one tensor; (the parameter it filled, which pieces of it), None if it has no place."""
    if ".experts." in name:
        return _load_expert(modules, name, source)
    path, _, leaf = name.rpartition(".")
    owner, _, sub = path.rpartition(".")
    piece = 0
    if sub in model.stacked:
        ours, piece = model.stacked[sub]
        path = f"{owner}.{ours}" if owner else ours
    module = modules.get(path)
    if module is None:
        return None
    if isinstance(module, QuantLinear | QuantEmbedding) and leaf == "weight":
        return f"{path}.weight", [0]  # already quantized from the GGUF's blocks
    if leaf == "bias" and getattr(module, "bias_elsewhere", False):
        return f"{path}.bias", [piece]  # a row-parallel bias that rank 0 adds
    if leaf not in dict(module.named_parameters(recurse=False)):
        return None
    loader = getattr(module, "load", None)
    if loader is None:
        return None
    fused = model.fused_pieces(path)
    if fused is not None and sub not in model.stacked:  # one checkpoint tensor, several pieces
        offset = 0
        for i, rows in enumerate(fused):
            loader(leaf, i, _Rows(source, offset))
            offset += rows
        return f"{path}.{leaf}", list(range(len(fused)))
    loader(leaf, piece, source)
    return f"{path}.{leaf}", [piece]


def _load_expert(modules: dict[str, nn.Module], name: str, source: Any) -> tuple[str, list[Any]] | None:
    prefix, _, rest = name.partition(".experts.")
    moe = modules.get(f"{prefix}.experts")
    if not isinstance(moe, FusedMoE):
        return None
    parts = rest.split(".")
    if len(parts) == 1 and parts[0] in ("gate_up_proj", "down_proj"):  # transformers 5's stacked form
        kind = "gate_up" if parts[0] == "gate_up_proj" else "down"
        load_expert_weight(moe, kind, None, source[:])
        param = "w13" if kind == "gate_up" else "w2"
        pieces = [(k, e) for e in range(moe.num_experts) for k in (("gate", "up") if kind == "gate_up" else ("down",))]
        return f"{prefix}.experts.{param}", pieces
    if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in _EXPERT_KINDS or parts[2] != "weight":
        return None
    expert, kind = int(parts[0]), _EXPERT_KINDS[parts[1]]
    if expert >= moe.num_experts:
        return None
    load_expert_weight(moe, kind, expert, source[:])
    return f"{prefix}.experts.{'w2' if kind == 'down' else 'w13'}", [(kind, expert)]


def _expected(model: nn.Module) -> dict[str, int]:
    """Every parameter the checkpoint must fill, with how many pieces it has."""
    out: dict[str, int] = {}
    for path, module in model.named_modules():
        for leaf, _ in module.named_parameters(recurse=False):
            name = f"{path}.{leaf}" if path else leaf
            if isinstance(module, FusedMoE):
                out[name] = module.num_experts * (2 if leaf == "w13" else 1)
            elif isinstance(module, Linear | QuantLinear) and hasattr(module, "rows"):
                out[name] = len(module.rows)
            else:
                out[name] = 1
    return out


def quantize_model(model: CausalLM, scheme: str, path: Path) -> None:
    """Replace the decoder layers' linear layers (and a tied embedding in a block format) in place
    by quantized ones (layers/quantized.py)."""
    with GGUFQuantized(path, model.remap) if scheme == "gguf" else nullcontext(None) as kept:
        _quantize_layers(model, scheme, kept)


def _quantize_layers(model: CausalLM, scheme: str, gguf: GGUFQuantized | None) -> None:
    bits = {"int8": 8, "int4": 4}.get(scheme)
    narrow: list[str] = []
    unstack: dict[str, list[str]] = {}
    for theirs, (ours, _) in model.stacked.items():
        unstack.setdefault(ours, []).append(theirs)
    for name, dense in list(model.layers.named_modules(prefix="layers")):
        if not isinstance(dense, Linear):
            continue
        owner_name, _, attr = name.rpartition(".")
        if ".experts" in owner_name or attr == "gate":
            continue  # experts and routers stay dense
        if scheme == "gguf":
            names = [f"model.{owner_name}.{p}.weight" for p in unstack.get(attr, [attr])]
            assert gguf is not None
            if not all(n in gguf for n in names):
                continue  # stored as floats in the GGUF: stays dense
            weight = QuantWeight.cat([gguf[n] for n in names])
        elif dense.weight.shape[1] % BLOCK:
            narrow.append(name)  # no whole blocks along its input (DeepSeek's 24-wide q_lora): dense
            continue
        else:
            assert bits is not None
            weight = QuantWeight.quantize(dense.weight.detach(), bits)
        bias = None if dense.bias is None else dense.bias.detach()  # gguf: on meta, loaded later
        quant = QuantLinear(weight, bias)
        quant.rows, quant.cols = dense.rows, dense.cols  # the bias loads as the dense one would
        setattr(model.get_submodule(owner_name), attr, quant)
    if narrow:
        logger.info("quantization: %d layers whose input width is not a multiple of %d stay dense (%s, ...)",
                    len(narrow), BLOCK, narrow[0])
    if gguf is None:
        return
    embedding = gguf.get("model.embed_tokens.weight")
    if model.lm_head is None and embedding is not None:
        model.embed_tokens = QuantEmbedding(embedding, model.cfg.dtype)
        model.packed_tied_head = model.blocked_tied_head = None
    elif model.lm_head is not None and "lm_head.weight" in gguf:
        head = QuantLinear(gguf["lm_head.weight"], None)
        head.rows, head.cols = model.lm_head.rows, None
        model.lm_head = head
