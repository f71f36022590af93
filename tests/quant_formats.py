"""Tiny GPTQ, AWQ, compressed-tensors and FP8 checkpoints in their published layouts, for tests.

Written from the formats' own code, not from triollm's reader (engine/loading/quant_checkpoints.py),
so the two check each other:

- GPTQ: AutoGPTQ's `QuantLinear.pack` (qweight packed along the input, qzeros along the
  output, zero - 1 stored in v1) and its torch dequantization; `desc_act` groups assigned in a
  random column order, `g_idx[perm[j]] = j // group_size` as GPTQ's act order does.
- AWQ: AutoAWQ's `WQLinear_GEMM.from_linear` (order map 0 2 4 6 1 3 5 7) and vLLM's
  `awq_dequantize` reference (shifts 0 16 4 20 8 24 12 28).
- compressed-tensors: `pack_to_int32` / `unpack_from_int32` (signed codes + 2^(b-1), value i
  of each word at bit b*i; zero points packed along the output rows), int8 and FP8 weights.

`FORMATS` names each checkpoint kind a test builds; `write_quantized(src, dst, kind)` quantizes
the linear layers of the tiny model in `src` (tests/tinymodel.py) into `dst` with the
config.json `quantization_config` a real checkpoint of that kind has, and returns the
dequantized weights (the format's own formula) by checkpoint name, from which `write_dense`
makes the plain fp32 reference checkpoint.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
_AWQ_SHIFTS = [0, 16, 4, 20, 8, 24, 12, 28]  # column j of 8 sits at bit _AWQ_SHIFTS[j]


@dataclass(frozen=True)
class Kind:
    method: str  # "gptq", "awq", "ct-pack", "ct-int8", "ct-fp8", "fp8-block"
    bits: int = 4
    group: int = 32  # -1: one group per row
    sym: bool = True
    desc_act: bool = False
    v2: bool = False  # GPTQ checkpoint_format gptq_v2 (zeros stored as they are)


FORMATS = {
    "gptq-4bit-g32-sym": Kind("gptq", 4, 32, True),
    "gptq-4bit-g64-asym-act": Kind("gptq", 4, 64, False, desc_act=True),
    "gptq-4bit-g32-asym-act-v2": Kind("gptq", 4, 32, False, desc_act=True, v2=True),
    "gptq-8bit-g-1-sym": Kind("gptq", 8, -1, True),
    "awq-4bit-g32": Kind("awq", 4, 32, False),
    "awq-4bit-g64": Kind("awq", 4, 64, False),
    "ct-w4a16-g32": Kind("ct-pack", 4, 32, True),
    "ct-w4a16-g64-asym": Kind("ct-pack", 4, 64, False),
    "ct-w8a8-int8": Kind("ct-int8", 8, -1, True),
    "ct-fp8-dynamic": Kind("ct-fp8", 8, -1, True),
    "fp8-block": Kind("fp8-block", 8, 32, True),
}


# ------------------------------------------------------------------------------ quantizing


def _act_order(k: int, group: int, gen: torch.Generator) -> torch.Tensor:
    """g_idx for act order: columns visited in a random order, group j // group_size."""
    perm = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
    return g_idx


def minmax(
    w: torch.Tensor, kind: Kind, g_idx: torch.Tensor, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group: unsigned codes [N, K], scale [N, G] (stored in `scale_dtype`) and integer zero
    [N, G], AutoGPTQ's min-max quantizer (symmetric: zero 2^(b-1))."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    maxq = (1 << kind.bits) - 1
    scale = torch.empty(n, groups)
    zero = torch.empty(n, groups)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if kind.sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        s = ((hi - lo) / maxq).clamp_min(1e-6).to(scale_dtype).float()  # the scale as stored
        z = torch.full_like(s, float((maxq + 1) // 2)) if kind.sym else torch.round(-lo / s)
        if kind.method == "gptq" and not kind.v2:
            z = z.clamp(1, maxq)  # v1 stores zero - 1: a zero of 0 cannot be written
        scale[:, g], zero[:, g] = s, z.clamp(0, maxq)
    codes = torch.round(w / scale[:, g_idx.long()] + zero[:, g_idx.long()]).clamp(0, maxq).to(torch.int64)
    return codes, scale.to(scale_dtype), zero.to(torch.int64)


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ's qweight packing: row r of the result holds rows r*p .. r*p+p-1 of `values`."""
    per = 32 // bits
    v = values.to(torch.int64)
    out = torch.zeros(v.shape[0] // per, v.shape[1], dtype=torch.int64)
    for j in range(per):
        out |= v[j::per] << (bits * j)
    return _as_int32(out)


def _pack_cols(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """Packing along columns: word c holds columns c*p + order[i] at bit bits*i."""
    per = 32 // bits
    order = order or list(range(per))
    v = values.to(torch.int64)
    out = torch.zeros(v.shape[0], v.shape[1] // per, dtype=torch.int64)
    for i in range(per):
        out |= v[:, order[i] :: per] << (bits * i)
    return _as_int32(out)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> the int32 tensor a checkpoint stores."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def quantize_linear(
    w: torch.Tensor, kind: Kind, gen: torch.Generator, g_idx: torch.Tensor | None = None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One [N, K] weight in `kind`'s layout: its tensors (without the module prefix) and the
    weight they dequantize to by the format's own formula."""
    n, k = w.shape
    group = k if kind.group == -1 else kind.group
    if g_idx is None:
        g_idx = _act_order(k, group, gen) if kind.desc_act else (torch.arange(k) // group).to(torch.int32)
    if kind.method in ("gptq", "awq"):
        codes, scale, zero = minmax(w, kind, g_idx, torch.float16)
        if kind.method == "gptq":
            stored = zero - (0 if kind.v2 else 1)
            t = {
                "qweight": _pack_rows(codes.T, kind.bits),
                "qzeros": _pack_cols(stored.T, kind.bits),
                "scales": scale.T.contiguous(),
                "g_idx": g_idx,
            }
            return t, dequantize_gptq(t, kind.bits, v1=not kind.v2)
        t = {
            "qweight": _pack_cols(codes.T, 4, _AWQ_ORDER),
            "qzeros": _pack_cols(zero.T, 4, _AWQ_ORDER),
            "scales": scale.T.contiguous(),
        }
        return t, dequantize_awq(t, group)
    if kind.method == "ct-pack":
        codes, scale, zero = minmax(w, kind, g_idx, torch.bfloat16)
        t = {
            "weight_packed": _pack_cols(codes, kind.bits),
            "weight_scale": scale,
            "weight_shape": torch.tensor([n, k]),
        }
        if not kind.sym:
            t["weight_zero_point"] = _pack_cols(zero.T, kind.bits).T.contiguous()  # packed along the rows
        return t, dequantize_ct_packed(t, kind.bits)
    if kind.method == "ct-int8":
        scale = (w.abs().amax(1, keepdim=True) / 127).to(torch.bfloat16)
        q = torch.round(w / scale.float()).clamp(-128, 127).to(torch.int8)
        return {"weight": q, "weight_scale": scale}, q.float() * scale.float()
    if kind.method == "ct-fp8":
        scale = (w.abs().amax(1, keepdim=True) / 448).to(torch.bfloat16)
        q = (w / scale.float()).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": scale}, q.float() * scale.float()
    # quant_method fp8 with weight_block_size [32, 32]: weight_scale_inv per block (a multiplier)
    blocks = w.view(n // 32, 32, k // 32, 32)
    inv = blocks.abs().amax((1, 3)) / 448
    q = (blocks / inv[:, None, :, None]).view(n, k).to(torch.float8_e4m3fn)
    expanded = inv.repeat_interleave(32, 0).repeat_interleave(32, 1)
    return {"weight": q, "weight_scale_inv": inv}, q.float() * expanded


# ------------------------------------------------------------------------------ dequantizing


def dequantize_gptq(t: dict[str, torch.Tensor], bits: int, v1: bool) -> torch.Tensor:
    """AutoGPTQ's torch path: weight[n, k] = scales[g, n] * (q[k, n] - (qzeros[g, n] + 1)), g = g_idx[k]."""
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    qw, qz = t["qweight"], t["qzeros"]
    q = ((qw.unsqueeze(1) >> shifts.view(1, -1, 1)) & mask).reshape(-1, qw.shape[1])  # [K, N]
    z = ((qz.unsqueeze(2) >> shifts.view(1, 1, -1)) & mask).reshape(qz.shape[0], -1) + (1 if v1 else 0)
    g = t["g_idx"].long()
    return (t["scales"].float()[g] * (q - z[g]).float()).T.contiguous()


def dequantize_awq(t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    """vLLM's awq_dequantize reference: column j of each 8 at bit _AWQ_SHIFTS[j]."""
    shifts = torch.tensor(_AWQ_SHIFTS, dtype=torch.int32)

    def unpack(x: torch.Tensor) -> torch.Tensor:
        return ((x.unsqueeze(-1) >> shifts) & 0xF).reshape(x.shape[0], -1)

    q, z = unpack(t["qweight"]), unpack(t["qzeros"])  # [K, N], [K/G, N]
    s = t["scales"].float()
    rows = torch.arange(q.shape[0]) // group
    return ((q - z[rows]).float() * s[rows]).T.contiguous()


def dequantize_ct_packed(t: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    """compressed-tensors' unpack_from_int32 and dequantize: (q - zero_point) * scale per group."""
    per, mask, offset = 32 // bits, (1 << bits) - 1, 1 << (bits - 1)
    packed = t["weight_packed"]
    n, k = (int(v) for v in t["weight_shape"])
    q = torch.zeros(packed.shape[0], packed.shape[1] * per, dtype=torch.int32)
    for i in range(per):
        q[:, i::per] = (packed >> (bits * i)) & mask
    q = q[:, :k] - offset
    scale = t["weight_scale"].float()
    zp = torch.zeros(scale.shape, dtype=torch.int32)
    if "weight_zero_point" in t:
        packed_zp = t["weight_zero_point"]
        unpacked = torch.zeros(packed_zp.shape[0] * per, packed_zp.shape[1], dtype=torch.int32)
        for i in range(per):
            unpacked[i::per] = (packed_zp >> (bits * i)) & mask
        zp = unpacked[:n] - offset
    cols = torch.arange(k) // (k // scale.shape[1])
    return (q - zp[:, cols]).float() * scale[:, cols]


# ------------------------------------------------------------------------------ checkpoints


def quantization_config(kind: Kind) -> dict[str, object]:
    """config.json's `quantization_config` as the quantizers write it."""
    if kind.method == "gptq":
        return {
            "quant_method": "gptq", "bits": kind.bits, "group_size": kind.group, "desc_act": kind.desc_act,
            "sym": kind.sym, "static_groups": False, "true_sequential": True, "damp_percent": 0.01,
            "checkpoint_format": "gptq_v2" if kind.v2 else "gptq", "model_name_or_path": None,
        }  # fmt: skip
    if kind.method == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": kind.group,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    if kind.method == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    weights: dict[str, object] = {
        "num_bits": kind.bits,
        "type": "int",
        "symmetric": kind.sym,
        "dynamic": False,
        "observer": "minmax",
    }
    fmt, acts = "pack-quantized", None
    if kind.method == "ct-pack":
        weights |= {"strategy": "group", "group_size": kind.group, "actorder": None}
    elif kind.method == "ct-int8":
        weights |= {"strategy": "channel", "group_size": None}
        fmt, acts = (
            "int-quantized",
            {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
        )
    else:
        weights |= {"type": "float", "strategy": "channel", "group_size": None}
        fmt, acts = (
            "float-quantized",
            {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True},
        )
    return {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                      "output_activations": None, "format": fmt}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None,
    }  # fmt: skip


def write_quantized(
    src: Path, dst: Path, kind: Kind, *, seed: int = 0, shared_act_order: bool = True, lm_head: bool = False
) -> dict[str, torch.Tensor]:
    """The tiny model in `src`, its decoder linears quantized as `kind` (module note), into
    `dst`; returns every dequantized weight by checkpoint name ("...q_proj.weight").

    Act order: the modules reading the same input (q, k, v; gate, up) share one g_idx, as
    GPTQ's Hessian of that input gives them (`shared_act_order=False`: each its own).
    `lm_head`: the head quantized too (GPTQ's `lm_head: true`)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    dense = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    shared: dict[str, torch.Tensor] = {}
    for name, w in dense.items():
        prefix, _, leaf = name.rpartition(".")
        module = prefix.rpartition(".")[2]
        if leaf != "weight" or (module not in _LINEARS and not (lm_head and name == "lm_head.weight")):
            out[name] = w
            continue
        key = prefix.rpartition(".")[0] + {"k_proj": ".q_proj", "v_proj": ".q_proj", "up_proj": ".gate_proj"}.get(
            module, "." + module
        )
        g_idx = shared.get(key) if shared_act_order else None
        tensors, deq = quantize_linear(w, kind, gen, g_idx)
        if kind.desc_act and g_idx is None:
            shared[key] = tensors["g_idx"]
        out.update({f"{prefix}.{k}": v.clone() for k, v in tensors.items()})
        dequantized[name] = deq
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    quant = quantization_config(kind) | ({"lm_head": True} if lm_head else {})
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return dequantized


def write_dense(src: Path, dst: Path, dequantized: dict[str, torch.Tensor]) -> Path:
    """The plain fp32 checkpoint of `src` with its linears replaced by `dequantized`."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    weights = load_file(str(src / "model.safetensors")) | dequantized
    save_file(
        {k: v.contiguous() for k, v in weights.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"}
    )
    return dst
