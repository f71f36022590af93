"""GPTQ, AWQ, compressed-tensors and FP8 checkpoints: `quantization_config` read once, and each
quantized linear's tensors turned into the kernels' `QuantWeight` (kernels/quant.py) as shipped.

The integer formats all store, per output row and group of G input columns, unsigned b-bit
codes q, a scale s and a zero z, with weight = s * (q - z). A QuantWeight holds, per block of 32
input columns, d and m with weight = d * q + m: a group of G = 32k columns is k blocks sharing
d = s and m = -s * z, and the codes are kept as stored. Only the layouts differ:

- GPTQ: codes `qweight` int32 `[K/p, N]`, packed along K (value j at bit b*j); zeros `qzeros`
  int32 `[K/G, N/p]`, packed along N (`checkpoint_format: gptq`, v1 / AutoGPTQ, stores z - 1,
  `gptq_v2` z); scales `scales` fp16 `[K/G, N]`; `g_idx` int32 `[K]`, each input column's group.
- AWQ (GEMM): codes `qweight` int32 `[K, N/8]`, packed along N in the order 0 2 4 6 1 3 5 7;
  zeros `qzeros` `[K/G, N/8]`, the same order; scales `scales` fp16 `[K/G, N]`.
- compressed-tensors `pack-quantized`: codes `weight_packed` int32 `[N, K/p]`, packed along K,
  signed codes + 2^(b-1); zeros `weight_zero_point` packed along N (asymmetric only); scales
  `weight_scale` `[N, K/G]`, `[N, 1]` per channel.
- compressed-tensors `int-quantized`: codes `weight` int8 `[N, K]`, signed; zeros
  `weight_zero_point` int8; scales `weight_scale`.

(p = 32 / b codes per int32.) GPTQ's `desc_act` and compressed-tensors' `actorder: group` give
input columns their groups out of order (`g_idx`): the columns are sorted by group once here,
and the layer reads its input in that order (layers/quantized.py, QuantLinear's `perm`).

FP8 weights (compressed-tensors `float-quantized`, and `quant_method: fp8`) are dequantized into
dense layers of the model's dtype: an e4m3 value times its float scale is exact in fp32.
Requantizing them to int8 blocks instead would round every weight a second time, on a grid unlike
e4m3's; `quantization="int8"` asks for exactly that (a quarter of fp32's bytes, the quantized
kernels). Activation quantization (W8A8) is not applied: the dense layers keep full-precision
activations, the quantized kernels their own int8 blocks, as vLLM's weight-only fallback does on
GPUs without FP8 or int8 units.

Exact: the codes; scales in float16 (GPTQ and AWQ ship fp16, a bf16 scale within float16's
range converts exactly; fp32 scales round to the nearest float16); m = -s * z, rounded to
float16 once (exact for symmetric schemes, whose z is a power of two). Refused with a
ValueError naming the field: other methods, bits other than 4 and 8, group sizes other than -1
and multiples of 32, marlin and sparse storage, per-module overrides, quantized KV caches.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from triollm.kernels.quant import BLOCK, QuantWeight

__all__ = [
    "ALIASES",
    "METHODS",
    "CheckpointQuant",
    "IntLinear",
    "SchemeGroup",
    "WeightScheme",
    "parse_quantization_config",
    "quantized_modules",
    "read_linear",
]

# vLLM's `--quantization` spellings of the methods read here, and the kernel-named aliases
# vLLM also accepts for them (its Marlin kernels; here the same CPU kernels).
METHODS = ("gptq", "awq", "fp8", "compressed-tensors")
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
_CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized")
_AWQ_COLUMN = [0, 4, 1, 5, 2, 6, 3, 7]  # the nibble holding column j of each group of 8
# The tensors of one quantized module, by format (those present are consumed).
_TENSORS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "pack-quantized": ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx"),
    "int-quantized": ("weight", "weight_scale", "weight_zero_point", "weight_g_idx"),
    "float-quantized": ("weight", "weight_scale", "weight_zero_point"),
    "fp8": ("weight", "weight_scale", "weight_scale_inv"),
}
_ACTIVATION_TENSORS = ("input_scale", "input_zero_point")  # static activation scales: unused
# The tensors that mark a module as quantized, by method.
_MARKERS = {
    "gptq": ("qweight",),
    "awq": ("qweight",),
    "compressed-tensors": ("weight_packed", "weight_scale"),
    "fp8": ("weight_scale_inv", "weight_scale"),
}


@dataclass(frozen=True)
class WeightScheme:
    """How one linear layer's weight is stored (module note)."""

    format: str  # "gptq", "awq", "pack-quantized", "int-quantized", "float-quantized" or "fp8"
    bits: int
    group_size: int | None = None  # input columns per scale, -1: all; None: as the scale's shape says
    symmetric: bool = True
    block: tuple[int, int] | None = None  # FP8 block scales: (rows, columns) per scale

    @property
    def dense(self) -> bool:
        """Whether this weight is dequantized at load (FP8) rather than kept in blocks."""
        return self.format in ("float-quantized", "fp8")


@dataclass(frozen=True)
class SchemeGroup:
    """A compressed-tensors config group: the modules it covers and their weights' scheme."""

    targets: tuple[str, ...]  # "Linear" (every linear layer), a module name, or "re:<regex>"
    weights: WeightScheme


@dataclass(frozen=True)
class CheckpointQuant:
    """config.json's `quantization_config`, checked (`parse_quantization_config`)."""

    method: str  # one of METHODS
    groups: tuple[SchemeGroup, ...]
    ignore: tuple[str, ...] = ()  # modules kept in float, matched as `targets` are
    zero_offset: int = 0  # added to stored zeros: GPTQ v1 stores zero - 1

    def scheme(self, module: str) -> WeightScheme | None:
        """The scheme of checkpoint module `module` (e.g. `model.layers.0.self_attn.q_proj`);
        None where `ignore` lists it or no group targets it."""
        if any(_matches(module, t) for t in self.ignore):
            return None
        for group in self.groups:
            if any(_matches(module, t) for t in group.targets):
                return group.weights
        return None


def _matches(module: str, target: str) -> bool:
    """compressed-tensors' matching: `re:` prefixes a regex (re.match), "Linear" is the class of
    every module that holds a quantized weight, anything else a module name."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target in ("Linear", module)


# ------------------------------------------------------------------------------ the config


def parse_quantization_config(raw: object) -> CheckpointQuant:
    """config.json's `quantization_config`; a ValueError naming the field it cannot honour."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"quantization_config: expected a JSON object, got {raw!r}")
    method = raw.get("quant_method")
    if method not in METHODS:
        raise ValueError(
            f"quantization_config.quant_method: {method!r} is not supported; supported: {', '.join(METHODS)}"
        )
    parse = {"gptq": _gptq, "awq": _awq, "fp8": _fp8, "compressed-tensors": _compressed_tensors}[method]
    return parse(raw)


def _choice(
    raw: Mapping[str, Any], key: str, allowed: tuple[Any, ...], default: Any, where: str = "quantization_config"
) -> Any:
    value = raw.get(key, default)
    if isinstance(value, bool) != isinstance(allowed[0], bool) or value not in allowed:
        raise ValueError(f"{where}.{key}: {value!r} is not supported; supported: {', '.join(map(str, allowed))}")
    return value


def _group_size(raw: Mapping[str, Any], key: str, default: int, where: str = "quantization_config") -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or (value > 0 and value % BLOCK == 0)):
        raise ValueError(
            f"{where}.{key}: {value!r} is not supported; supported: -1 (one group per row) or a multiple of {BLOCK}"
        )
    return value


def _single(method: str, scheme: WeightScheme, zero_offset: int = 0) -> CheckpointQuant:
    return CheckpointQuant(method, (SchemeGroup(("Linear",), scheme),), zero_offset=zero_offset)


def _gptq(raw: Mapping[str, Any]) -> CheckpointQuant:
    bits = _choice(raw, "bits", (4, 8), None)
    group = _group_size(raw, "group_size", 128)
    key = "checkpoint_format" if "checkpoint_format" in raw else "format"
    fmt = _choice(raw, key, ("gptq", "gptq_v2"), "gptq")
    _choice(raw, "is_marlin_format", (False,), False)
    _choice(raw, "pack_dtype", ("int32", "torch.int32"), "int32")  # GPTQModel can pack into int16 / int8
    if raw.get("dynamic"):
        raise ValueError("quantization_config.dynamic: per-module overrides are not supported; supported: null or {}")
    sym = _choice(raw, "sym", (True, False), True)
    _choice(raw, "desc_act", (True, False), False)  # g_idx says which columns are in which group
    return _single("gptq", WeightScheme("gptq", bits, group, sym), zero_offset=1 if fmt == "gptq" else 0)


def _awq(raw: Mapping[str, Any]) -> CheckpointQuant:
    bits = _choice(raw, "bits" if "bits" in raw else "w_bit", (4,), None)
    group = _group_size(raw, "group_size" if "group_size" in raw else "q_group_size", 128)
    version = raw.get("version", "gemm")
    if not isinstance(version, str) or version.lower() != "gemm":
        raise ValueError(f"quantization_config.version: {version!r} is not supported; supported: gemm")
    _choice(raw, "zero_point", (True,), True)
    return _single("awq", WeightScheme("awq", bits, group, symmetric=False))


def _fp8(raw: Mapping[str, Any]) -> CheckpointQuant:
    _choice(raw, "activation_scheme", ("dynamic", "static"), "dynamic")
    block = raw.get("weight_block_size")
    if block is not None and not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(
            f"quantization_config.weight_block_size: {block!r} is not supported; supported: null or [rows, columns]"
        )
    return _single("fp8", WeightScheme("fp8", 8, block=None if block is None else (block[0], block[1])))


def _compressed_tensors(raw: Mapping[str, Any]) -> CheckpointQuant:
    _choice(raw, "quantization_status", ("compressed",), "compressed")
    sparsity = raw.get("sparsity_config")
    if sparsity and isinstance(sparsity, Mapping) and sparsity.get("format", "dense") != "dense":
        raise ValueError(
            f"quantization_config.sparsity_config: {sparsity.get('format')!r} is not supported; supported: dense"
        )
    for key in ("kv_cache_scheme", "transform_config"):
        if raw.get(key):
            raise ValueError(f"quantization_config.{key}: not supported; supported: null")
    groups = raw.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(f"quantization_config.config_groups: expected a non-empty object, got {groups!r}")
    parsed = tuple(
        _ct_group(f"quantization_config.config_groups.{name}", group, raw.get("format"))
        for name, group in groups.items()
    )
    ignore = raw.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise ValueError(f"quantization_config.ignore: expected a list of module names, got {ignore!r}")
    return CheckpointQuant("compressed-tensors", parsed, tuple(ignore))


def _ct_group(where: str, group: object, default_format: object) -> SchemeGroup:
    if not isinstance(group, Mapping):
        raise ValueError(f"{where}: expected an object, got {group!r}")
    targets = group.get("targets")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{where}.targets: expected a list of module names, got {targets!r}")
    fmt = group.get("format") or default_format
    fmt = "int-quantized" if fmt == "naive-quantized" else fmt  # its older name
    if fmt not in _CT_FORMATS:
        field = f"{where}.format" if group.get("format") else "quantization_config.format"
        raise ValueError(f"{field}: {fmt!r} is not supported; supported: {', '.join(_CT_FORMATS)}")
    w = group.get("weights")
    if not isinstance(w, Mapping):
        raise ValueError(
            f"{where}.weights: expected the weights' scheme (activation-only quantization is not supported), got {w!r}"
        )
    wh = f"{where}.weights"
    kind = _choice(w, "type", ("float",) if fmt == "float-quantized" else ("int",), "int", wh)
    bits = _choice(w, "num_bits", (8,) if kind == "float" else (4, 8), 8, wh)
    _choice(w, "dynamic", (False,), False, wh)
    strategies = ("tensor", "channel", "group", "block") if kind == "float" else ("tensor", "channel", "group")
    strategy = _choice(w, "strategy", strategies, "tensor", wh)
    symmetric = _choice(w, "symmetric", (True,) if kind == "float" else (True, False), True, wh)
    group_size = _group_size(w, "group_size", 128, wh) if strategy == "group" and kind == "int" else None
    block = None
    if strategy == "block":
        shape = w.get("block_structure")
        if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(b, int) and b > 0 for b in shape)):
            raise ValueError(f"{wh}.block_structure: {shape!r} is not supported; supported: [rows, columns]")
        block = (shape[0], shape[1])
    acts = group.get("input_activations")
    if acts is not None:
        if not isinstance(acts, Mapping):
            raise ValueError(f"{where}.input_activations: expected an object or null, got {acts!r}")
        _choice(acts, "num_bits", (8,), 8, f"{where}.input_activations")
    if group.get("output_activations") is not None:
        raise ValueError(f"{where}.output_activations: not supported; supported: null")
    return SchemeGroup(tuple(targets), WeightScheme(fmt, bits, group_size, symmetric, block))


# ------------------------------------------------------------------------------ the tensors


class Tensors(Protocol):
    """A checkpoint's tensors by name (all its safetensors files)."""

    def __contains__(self, name: object) -> bool: ...

    def get(self, name: str) -> torch.Tensor: ...


def quantized_modules(names: Iterable[str], quant: CheckpointQuant) -> dict[str, WeightScheme]:
    """The checkpoint modules that hold quantized tensors (by the tensors that mark them), with
    their schemes; a ValueError for one that no config group covers."""
    markers = _MARKERS[quant.method]
    found: dict[str, WeightScheme] = {}
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in markers or prefix in found:
            continue
        scheme = quant.scheme(prefix)
        if scheme is None:
            raise ValueError(
                f"quantization_config: {prefix} holds quantized tensors ({name}), but no config group "
                "targets it or `ignore` lists it"
            )
        found[prefix] = scheme
    return found


def module_tensors(tensors: Tensors, prefix: str, scheme: WeightScheme) -> list[str]:
    """The names of `prefix`'s tensors that `read_linear` reads (or drops); its bias is not one."""
    leaves = (*_TENSORS[scheme.format], *_ACTIVATION_TENSORS)
    return [f"{prefix}.{leaf}" for leaf in leaves if f"{prefix}.{leaf}" in tensors]


@dataclass
class IntLinear:
    """One linear layer's integer weight, read: weight[:, perm[j]] = scale * (codes[:, j] - zero)
    with `scale` and `zero` per block of 32 codes."""

    codes: torch.Tensor  # int32 [N, K], unsigned, in `perm`'s column order
    scale: torch.Tensor  # float32 [N, K/32]
    zero: torch.Tensor  # float32 [N, K/32], integer-valued
    bits: int
    perm: torch.Tensor | None  # int64 [K]: the input column of each code column; None: in order

    def quant_weight(self, where: str) -> QuantWeight:
        """The kernels' form: d = scale and m = -scale * zero in float16 (module note)."""
        d, m = self.scale.half(), (-self.scale * self.zero).half()
        if not (torch.isfinite(d).all() and torch.isfinite(m).all()):
            raise ValueError(f"{where}: a scale (or scale * zero) exceeds float16's range; use quantization='none'")
        n, k = self.codes.shape
        if self.bits == 8:
            q = self.codes.to(torch.uint8)
        else:
            blocks = self.codes.view(n, k // BLOCK, BLOCK).to(torch.uint8)
            q = (blocks[..., :16] | (blocks[..., 16:] << 4)).reshape(n, k // 2)
        return QuantWeight(q.contiguous(), d.contiguous(), m.contiguous(), self.bits)

    def dequantize(self) -> torch.Tensor:
        """The exact weight in fp32 `[N, K]`, input columns in the checkpoint's order."""
        n, k = self.codes.shape
        blocks = self.codes.view(n, k // BLOCK, BLOCK).float() - self.zero.unsqueeze(-1)
        w = (blocks * self.scale.unsqueeze(-1)).view(n, k)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


def read_linear(tensors: Tensors, prefix: str, scheme: WeightScheme, zero_offset: int = 0) -> IntLinear | torch.Tensor:
    """Module `prefix`'s weight: an IntLinear, or (FP8) the dequantized fp32 weight `[N, K]`."""
    if scheme.format == "gptq":
        return _gptq_linear(tensors, prefix, scheme, zero_offset)
    if scheme.format == "awq":
        return _awq_linear(tensors, prefix, scheme)
    if scheme.format == "pack-quantized":
        return _packed_linear(tensors, prefix, scheme)
    if scheme.format == "int-quantized":
        return _int_linear(tensors, prefix, scheme)
    return _fp8_linear(tensors, prefix, scheme)


def _get(tensors: Tensors, name: str, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"model: the checkpoint lacks {name}, which its quantization_config implies")
    t = tensors.get(name)
    if t.dtype not in dtypes:
        raise ValueError(f"model: {name} is {t.dtype}, expected {' or '.join(str(d) for d in dtypes)}")
    return t


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32/bits codes (value j at bit bits*j), laid out along `dim`."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    if dim == 0:
        out = (packed.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)
        return out.reshape(packed.shape[0] * per, packed.shape[1])
    out = (packed.unsqueeze(2) >> shifts.view(1, 1, per)) & ((1 << bits) - 1)
    return out.reshape(packed.shape[0], packed.shape[1] * per)


def _grouped(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g_idx: torch.Tensor, bits: int, where: str
) -> IntLinear:
    """codes `[N, K]`, scale and zero `[N, groups]`, g_idx `[K]` (each column's group) -> blocks."""
    n, k = codes.shape
    if k % BLOCK:
        raise ValueError(f"{where}: {k} input columns are not a multiple of {BLOCK}")
    if g_idx.shape != (k,) or g_idx.min() < 0 or g_idx.max() >= scale.shape[1]:
        raise ValueError(f"{where}: g_idx does not give each of the {k} input columns one of {scale.shape[1]} groups")
    perm = torch.argsort(g_idx, stable=True)
    blocks = g_idx[perm].view(k // BLOCK, BLOCK)
    if not (blocks == blocks[:, :1]).all():
        raise ValueError(
            f"{where}: group_size: groups must be whole blocks of {BLOCK} input columns (once sorted by g_idx)"
        )
    group = blocks[:, 0]
    if torch.equal(perm, torch.arange(k)):
        return IntLinear(codes, scale[:, group], zero[:, group], bits, None)
    return IntLinear(codes[:, perm].contiguous(), scale[:, group], zero[:, group], bits, perm)


def _in_order(k: int, groups: int, where: str) -> torch.Tensor:
    if groups <= 0 or k % groups:
        raise ValueError(f"{where}: {groups} scale groups do not divide {k} input columns")
    return torch.arange(k) // (k // groups)


def _gptq_linear(tensors: Tensors, prefix: str, scheme: WeightScheme, zero_offset: int) -> IntLinear:
    bits, where = scheme.bits, prefix
    qweight = _get(tensors, f"{prefix}.qweight", (torch.int32,))
    k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
    scales = _get(tensors, f"{prefix}.scales", _FLOATS).float()
    zeros = _unpack(_get(tensors, f"{prefix}.qzeros", (torch.int32,)), bits, 1)[:, :n] + zero_offset
    if scales.shape[1] != n or zeros.shape != scales.shape:
        raise ValueError(f"{where}: scales {tuple(scales.shape)} and qzeros do not fit qweight {tuple(qweight.shape)}")
    if f"{prefix}.g_idx" in tensors:
        g_idx = _get(tensors, f"{prefix}.g_idx", (torch.int32, torch.int64)).long()
    else:
        g_idx = _in_order(k, scales.shape[0], where)
    return _grouped(_unpack(qweight, bits, 0).T, scales.T, zeros.T.float(), g_idx, bits, where)


def _awq_linear(tensors: Tensors, prefix: str, scheme: WeightScheme) -> IntLinear:
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return _unpack(t, 4, 1).view(t.shape[0], t.shape[1], 8)[..., _AWQ_COLUMN].reshape(t.shape[0], t.shape[1] * 8)

    codes = unpack(_get(tensors, f"{prefix}.qweight", (torch.int32,)))  # [K, N]
    zeros = unpack(_get(tensors, f"{prefix}.qzeros", (torch.int32,)))
    scales = _get(tensors, f"{prefix}.scales", _FLOATS).float()
    (k, n), groups = codes.shape, scales.shape[0]
    if scales.shape[1] != n or zeros.shape != scales.shape:
        raise ValueError(f"{prefix}: scales {tuple(scales.shape)} and qzeros do not fit qweight [{k}, {n // 8}]")
    return _grouped(codes.T, scales.T, zeros.T.float(), _in_order(k, groups, prefix), 4, prefix)


def _scales(tensors: Tensors, prefix: str, n: int) -> torch.Tensor:
    """weight_scale as `[N, groups]` (a per-tensor scale as one group)."""
    scale = _get(tensors, f"{prefix}.weight_scale", _FLOATS).float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(n, 1)
    scale = scale.view(-1, 1) if scale.dim() == 1 else scale
    if scale.shape[0] != n:
        raise ValueError(f"{prefix}.weight_scale: shape {tuple(scale.shape)} does not fit {n} output rows")
    return scale


def _ct_zeros(tensors: Tensors, prefix: str, scheme: WeightScheme, scale: torch.Tensor) -> torch.Tensor:
    """The zero points as unsigned codes `[N, groups]` (signed zero + 2^(bits-1))."""
    offset = 1 << (scheme.bits - 1)
    name = f"{prefix}.weight_zero_point"
    if scheme.symmetric or name not in tensors:
        return torch.full(scale.shape, float(offset))
    zp = _get(tensors, name, (torch.int8, torch.int32))
    if zp.dtype == torch.int32 and scheme.format == "pack-quantized":  # packed along the output rows
        zp = _unpack(zp, scheme.bits, 0)[: scale.shape[0]]
    else:
        zp = zp.int() + offset
    zp = zp.float()
    if zp.numel() == 1:
        zp = zp.reshape(1, 1).expand(scale.shape)
    if zp.shape != scale.shape:
        raise ValueError(f"{name}: shape {tuple(zp.shape)} does not fit weight_scale {tuple(scale.shape)}")
    return zp


def _ct_blocks(tensors: Tensors, prefix: str, scheme: WeightScheme, codes: torch.Tensor) -> IntLinear:
    n, k = codes.shape
    scale = _scales(tensors, prefix, n)
    zero = _ct_zeros(tensors, prefix, scheme, scale)
    if f"{prefix}.weight_g_idx" in tensors:
        g_idx = _get(tensors, f"{prefix}.weight_g_idx", (torch.int32, torch.int64)).long()
    else:
        g_idx = _in_order(k, scale.shape[1], prefix)
    return _grouped(codes, scale.contiguous(), zero.contiguous(), g_idx, scheme.bits, prefix)


def _packed_linear(tensors: Tensors, prefix: str, scheme: WeightScheme) -> IntLinear:
    packed = _get(tensors, f"{prefix}.weight_packed", (torch.int32,))
    codes = _unpack(packed, scheme.bits, 1)
    if f"{prefix}.weight_shape" in tensors:
        n, k = (int(v) for v in tensors.get(f"{prefix}.weight_shape").tolist())
        if n != codes.shape[0] or not 0 < k <= codes.shape[1]:
            raise ValueError(f"{prefix}.weight_shape: [{n}, {k}] does not fit weight_packed {tuple(packed.shape)}")
        codes = codes[:, :k]
    return _ct_blocks(tensors, prefix, scheme, codes.contiguous())


def _int_linear(tensors: Tensors, prefix: str, scheme: WeightScheme) -> IntLinear:
    weight = _get(tensors, f"{prefix}.weight", (torch.int8,)).int()
    lo, hi = -(1 << (scheme.bits - 1)), (1 << (scheme.bits - 1)) - 1
    if weight.numel() and (weight.min() < lo or weight.max() > hi):
        raise ValueError(f"{prefix}.weight: values outside [{lo}, {hi}] for num_bits {scheme.bits}")
    return _ct_blocks(tensors, prefix, scheme, weight - lo)


def _fp8_linear(tensors: Tensors, prefix: str, scheme: WeightScheme) -> torch.Tensor:
    weight = _get(tensors, f"{prefix}.weight", (torch.float8_e4m3fn, torch.float8_e5m2)).float()
    n, k = weight.shape
    name = f"{prefix}.weight_scale_inv" if f"{prefix}.weight_scale_inv" in tensors else f"{prefix}.weight_scale"
    scale = _get(tensors, name, _FLOATS).float()
    if scale.numel() == 1:
        return weight * scale.reshape(())
    scale = scale.view(-1, 1) if scale.dim() == 1 else scale
    rows, cols = scale.shape
    if scheme.block is not None:
        rb, cb = scheme.block
    elif n % rows == 0 and k % cols == 0:
        rb, cb = n // rows, k // cols
    else:
        raise ValueError(f"{name}: shape {tuple(scale.shape)} does not divide the weight's [{n}, {k}]")
    if -(-n // rb) != rows or -(-k // cb) != cols:
        raise ValueError(f"{name}: shape {tuple(scale.shape)} does not fit [{n}, {k}] in blocks of [{rb}, {cb}]")
    return weight * scale.repeat_interleave(rb, 0)[:n].repeat_interleave(cb, 1)[:, :k]
