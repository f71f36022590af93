"""Weight-only quantized linear layers: weights kept in 32-weight blocks, read once per token.

`QuantWeight` holds a `[N, K]` weight as unsigned codes `q` (4 bits, two per byte in GGML's
nibble order, or 8 bits) with a float16 scale `d` and offset `m` per block: weight = d * q + m.
That one form covers GGUF's Q4_1 (as shipped), Q4_0 (m = -8 d), Q8_0 (q = w + 128,
m = -128 d), Q5_1 and Q5_0 (m = -16 d; their 5-bit codes held in 8 bits, exactly), IQ4_NL and
IQ4_XS (`bits=IQ4`: 4-bit indices whose codes are `IQ4_CODES[index]`, 8-bit), and what
`quantization="int4"` (asymmetric, group 32: Q4_1's scheme) and `quantization="int8"`
(symmetric, one scale per output channel) make from float weights.

`PackedWeight` is the same bits in the kernel's layout (rows in groups of 16, codes interleaved
for 512-bit registers), made once at load. `packed_linear` runs the native kernel
(kernels/csrc/quant_linear.cpp: int8 activations per block, integer dot products with AMX
tiles (from 32 rows), AVX-512 VNNI or AVX2, whichever the CPU has, as llama.cpp does, IQ4's
indices looked up with a byte shuffle; plain loops elsewhere) where the native
kernels are built, else a dense product of the dequantized weight (no compiler: slow, still
right). `reference_linear` is the kernel's arithmetic in torch, for tests.

Large inputs on AMX (`tile_linear`): where the CPU has AMX bf16 tiles, an input of at least
`TILE_MIN_ROWS` rows (a step's tokens: decodes, prompt chunks, or both) takes another kernel: each
block dequantized once per call into bf16 tiles, the activations rounded to bf16, fp32 sums over
the whole input, no per-block scaling. From 32 rows on it takes 0.6-0.9x the int8 AMX path's
time, from 256 rows about half (docs/benchmarks.md "AMX Xeon"); below ~24 rows its pass over
every weight costs more than it saves. Each kernel gives a row the same bits at every row count
on its side of the threshold, but a request's numbers now depend on the size of the steps it
runs in, so on such a CPU they are not independent of its neighbours by default: the model runner
allows the tiles (`tiles=True`, its layers' `tiles`) only without `VLLM_BATCH_INVARIANT=1`
(kernels/batch_invariant.py) and without a forced $TRIOLLM_CPU_ISA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from triollm.kernels import cpu_native
from triollm.kernels.envs import forced_cpu_isa
from triollm.kernels.kquants import IQ4, IQ4_CODES, KQUANT_TYPES, decode_kquant

__all__ = [
    "BLOCK",
    "IQ4",
    "QUANT_GGML_TYPES",
    "PackedWeight",
    "QuantWeight",
    "TILE_MIN_ROWS",
    "packed_linear",
    "tiles_available",
    "quantize_activations",
    "reference_linear",
    "tile_linear",
]

BLOCK = 32
# GGML block layouts (gguf.GGMLQuantizationType values): bytes per block of 32 weights.
GGML_Q4_0, GGML_Q4_1, GGML_Q5_0, GGML_Q5_1, GGML_Q8_0 = 2, 3, 6, 7, 8
_BLOCK_BYTES = {GGML_Q4_0: 18, GGML_Q4_1: 20, GGML_Q5_0: 22, GGML_Q5_1: 24, GGML_Q8_0: 34}
QUANT_GGML_TYPES = frozenset(_BLOCK_BYTES) | KQUANT_TYPES  # K-quants: kernels/kquants.py
_IQ4_CODES = torch.from_numpy(IQ4_CODES).to(torch.int32)
# Rows from which an input takes the bf16 tiles where they are allowed (module note). Measured on a
# 2-core AMX Xeon, tile time / int8 AMX time over SmolLM2-135M's four linears and its head
# (docs/bench/quant_paths.py): 16 rows 0.91-1.28x, 24 rows 0.88-0.97x, 32 rows 0.68-0.94x,
# 64 rows 0.59-0.73x.
TILE_MIN_ROWS = 32


@dataclass
class QuantWeight:
    q: torch.Tensor  # uint8 [N, K/2] (bits 4 and IQ4) or [N, K] (bits 8)
    d: torch.Tensor  # float16 [N, K/32]
    m: torch.Tensor  # float16 [N, K/32]
    bits: int  # the code format: 4, 8 or IQ4 (4-bit indices into IQ4_CODES)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.d.shape[1] * BLOCK

    def codes(self) -> torch.Tensor:
        """The unsigned codes as int32 `[N, K]`, in weight order (IQ4: its indices looked up)."""
        if self.bits == 8:
            return self.q.to(torch.int32)
        nibbles = self.nibbles()
        return _IQ4_CODES[nibbles] if self.bits == IQ4 else nibbles

    def nibbles(self) -> torch.Tensor:
        """The 4-bit values as stored (bits 4: the codes; IQ4: the indices), int32 `[N, K]`."""
        n, k = self.shape
        blocks = self.q.view(n, k // BLOCK, 16).to(torch.int32)
        return torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).view(n, k)

    def widened(self) -> QuantWeight:
        """The same weight as 8-bit codes (exact: the same codes, scales and offsets)."""
        return self if self.bits == 8 else QuantWeight(self.codes().to(torch.uint8), self.d, self.m, 8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        codes = self.codes().view(n, k // BLOCK, BLOCK).float()
        w = codes * self.d.float().unsqueeze(-1) + self.m.float().unsqueeze(-1)
        return w.view(n, k).to(dtype)

    def rows(self, index: torch.Tensor | Sequence[int]) -> QuantWeight:
        idx = torch.as_tensor(index, dtype=torch.long)
        return QuantWeight(self.q[idx], self.d[idx], self.m[idx], self.bits)

    @staticmethod
    def cat(parts: Sequence[QuantWeight]) -> QuantWeight:
        """Row-wise concatenation (fused projections); every part has the same K and bits."""
        if len({p.bits for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
            raise ValueError("quantization: fused projections need the same block format and width")
        q, d, m = (torch.cat([getattr(p, f) for p in parts]) for f in ("q", "d", "m"))
        return QuantWeight(q, d, m, parts[0].bits)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_ggml(cls, raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> QuantWeight:
        """GGUF block bytes (the reader's uint8 array) of a `[N, K]` tensor, kept quantized."""
        n, k = shape
        if ggml_type in KQUANT_TYPES:
            return cls(*decode_kquant(raw, ggml_type, shape))
        if ggml_type not in _BLOCK_BYTES:
            raise ValueError(
                f"quantization: GGML type {ggml_type} is not kept quantized (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, "
                f"Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS are)"
            )
        size = _BLOCK_BYTES[ggml_type]
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, size)
        d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16).reshape(n, k // BLOCK))
        if ggml_type == GGML_Q4_1:
            m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16).reshape(n, k // BLOCK))
            q = torch.from_numpy(blocks[..., 4:].copy().reshape(n, k // 2))
            return cls(q, d, m, 4)
        if ggml_type == GGML_Q4_0:
            q = torch.from_numpy(blocks[..., 2:].copy().reshape(n, k // 2))
            return cls(q, d, (d.float() * -8.0).half(), 4)
        if ggml_type in (GGML_Q5_0, GGML_Q5_1):
            return cls._from_q5(blocks, ggml_type, d, shape)
        q8 = blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 128
        return cls(torch.from_numpy(q8.astype(np.uint8).reshape(n, k)), d, (d.float() * -128.0).half(), 8)

    @classmethod
    def _from_q5(cls, blocks: np.ndarray, ggml_type: int, d: torch.Tensor, shape: tuple[int, int]) -> QuantWeight:
        """Q5_0 / Q5_1 blocks (d, [m], 32 high bits, 16 bytes of low nibbles) as 8-bit codes: weight
        i of a block is its low nibble (byte i % 16, low half first) plus bit i of the high bits
        times 16; Q5_0's codes are centred on 16."""
        n, k = shape
        if ggml_type == GGML_Q5_1:
            m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16).reshape(n, k // BLOCK))
            rest = blocks[..., 4:]
        else:
            m, rest = (d.float() * -16.0).half(), blocks[..., 2:]
        high = rest[..., 0:4].copy().view("<u4")  # [n, blocks, 1]
        low = rest[..., 4:]
        codes = np.concatenate([low & 0x0F, low >> 4], axis=-1)
        codes |= (((high >> np.arange(BLOCK, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
        return cls(torch.from_numpy(codes.reshape(n, k)), d, m, 8)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bits: int) -> QuantWeight:
        """int4: asymmetric per block of 32 (scale and minimum); int8: symmetric, one scale per
        output channel (stored per block). K must be a multiple of 32."""
        n, k = weight.shape
        if k % BLOCK:
            raise ValueError(f"quantization: input width {k} is not a multiple of {BLOCK}")
        w = weight.detach().float().view(n, k // BLOCK, BLOCK)
        if bits == 8:
            d = (w.abs().amax(dim=(1, 2)) / 127.0).clamp_min(1e-12).half()  # fp16 first: codes use it
            codes = torch.round(w / d.float().view(n, 1, 1)).clamp(-127, 127) + 128
            d = d.view(n, 1).expand(n, k // BLOCK).contiguous()
            return cls(codes.to(torch.uint8).view(n, k), d, (d.float() * -128.0).half(), 8)
        if bits != 4:
            raise ValueError(f"quantization: bits must be 4 or 8, got {bits}")
        lo, hi = w.amin(-1), w.amax(-1)
        d = ((hi - lo) / 15.0).clamp_min(1e-12).half()
        m = lo.half()
        codes = torch.round((w - m.float().unsqueeze(-1)) / d.float().unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
        packed = codes[..., :16] | (codes[..., 16:] << 4)
        return cls(packed.reshape(n, k // 2).contiguous(), d, m, 4)


@dataclass
class PackedWeight:
    """A QuantWeight in the kernel's layout (kernels/csrc/quant_linear.cpp): output rows in groups
    of 16 (the last padded with zero rows), each block's codes interleaved so that 16 rows x 4
    codes fill one 512-bit register; scales and offsets `[groups, blocks, 16]`. The same bits,
    reordered once at load."""

    qp: torch.Tensor  # uint8 [G, K/32, 256] (bits 4 and IQ4: nibbles) or [G, K/32, 512] (bits 8)
    dp: torch.Tensor  # float16 [G, K/32, 16]
    mp: torch.Tensor  # float16 [G, K/32, 16]
    bits: int
    n: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.qp.shape[1] * BLOCK

    @classmethod
    def pack(cls, w: QuantWeight) -> PackedWeight:
        n, k = w.shape
        nb, groups = k // BLOCK, -(-n // 16)
        pad = groups * 16 - n
        # The codes as bytes (8-bit: as stored; 4-bit and IQ4: the nibbles unpacked), never widened:
        # a 49152 x 576 embedding as int32 was a 113 MB copy (and twice that in temporaries) at load.
        if w.bits == 8:
            codes = w.q.view(torch.uint8) if w.q.dtype == torch.int8 else w.q.to(torch.uint8)
        else:
            stored = w.q.view(n, nb, 16)
            codes = torch.cat([stored & 0x0F, stored >> 4], dim=-1).view(n, k)
        d, m = w.d, w.m
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad, k)])
            d, m = torch.cat([d, d.new_zeros(pad, nb)]), torch.cat([m, m.new_zeros(pad, nb)])
        c = codes.view(groups, 16, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [g, block, step, lane, byte]
        if w.bits != 8:
            qp = (c[:, :, :4] | (c[:, :, 4:] << 4)).to(torch.uint8).reshape(groups, nb, 256)
        else:
            qp = c.to(torch.uint8).reshape(groups, nb, 512)

        def lanes(t: torch.Tensor) -> torch.Tensor:
            return t.view(groups, 16, nb).permute(0, 2, 1).contiguous()

        return cls(qp.contiguous(), lanes(d), lanes(m), w.bits, n)

    def dequantize_rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `index` of the weight, dense `[len(index), K]` (an embedding lookup)."""
        g, lane = index // 16, index % 16
        groups, nb = self.qp.shape[:2]
        if self.bits == 8:
            codes = self.qp.view(groups, nb, 8, 16, 4)[g, :, :, lane, :]  # [R, block, step, byte]
        else:
            v = self.qp.view(groups, nb, 4, 16, 4)[g, :, :, lane, :]
            codes = torch.cat([v & 0x0F, v >> 4], dim=2)
            if self.bits == IQ4:
                codes = _IQ4_CODES[codes.long()]
        d = self.dp[g, :, lane].float().unsqueeze(-1)  # [R, block, 1]
        m = self.mp[g, :, lane].float().unsqueeze(-1)
        w = codes.reshape(len(index), nb, BLOCK).float() * d + m
        return w.reshape(len(index), nb * BLOCK).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.dequantize_rows(torch.arange(self.n, device=self.qp.device), dtype)


def packed_linear(
    x: torch.Tensor,
    w: PackedWeight,
    bias: torch.Tensor | None = None,
    *,
    isa: str = "auto",
    tiles: bool = False,
) -> torch.Tensor:
    """`x @ W.T (+ bias)` for x `[..., K]` over a PackedWeight, in x's dtype (fp32 inside).
    `isa`: the kernel's path, "auto" (the best this CPU runs, or $TRIOLLM_CPU_ISA) or one of
    cpu_native.QUANT_ISAS by name (tests compare them). `tiles`: the caller allows the AMX bf16
    tiles, taken from `TILE_MIN_ROWS` rows on (module note; the caller checks `tiles_available`)."""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k).float()
    if tiles and flat.shape[0] >= TILE_MIN_ROWS and x.device.type == "cpu":
        out = tile_linear(flat, w)
    else:
        out = _int8_linear(flat, w, isa)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*lead, w.n)


def _int8_linear(flat: torch.Tensor, w: PackedWeight, isa: str) -> torch.Tensor:
    if flat.device.type == "cpu" and cpu_native.available():
        return torch.ops.triollm_cpu.quant_linear_packed(flat, w.qp, w.dp, w.mp, w.bits, w.n, isa)
    return flat @ w.dequantize().to(flat.device).T


def tile_linear(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """`x @ W.T` for x `[M, K]` fp32 by the AMX bf16 tile kernel (module note); only where
    `tiles_available()`."""
    return torch.ops.triollm_cpu.quant_linear_bf16(x, w.qp, w.dp, w.mp, w.bits, w.n)


def packed_swiglu(x: torch.Tensor, w: PackedWeight) -> torch.Tensor | None:
    """silu(x @ Wg.T) * (x @ Wu.T) for a fused gate/up PackedWeight (gate outputs first, then
    up), in one pass of the AMX bf16 tile kernel (`quant_swiglu_bf16`: the gate and up sums never
    leave it, where `packed_linear` then `silu_and_mul` write and read back [M, 2I] fp32), where
    the tiles take x (`TILE_MIN_ROWS` rows on; the caller allows them) and the intermediate size
    is a multiple of 16; None elsewhere. Each output is the unfused tile path's, bit for bit."""
    if x.dim() != 2 or x.shape[0] < TILE_MIN_ROWS or x.device.type != "cpu" or w.n % 32:
        return None
    return torch.ops.triollm_cpu.quant_swiglu_bf16(x.float(), w.qp, w.dp, w.mp, w.bits, w.n).to(x.dtype)


def tiles_available() -> bool:
    """Whether large inputs may take the bf16 tiles in this process: the native kernels are built,
    the CPU has AMX bf16 tiles (and the kernel's leave to use them), and no path is forced."""
    return cpu_native.available() and not forced_cpu_isa() and bool(torch.ops.triollm_cpu.bf16_tiles())


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x `[M, K]` fp32 -> int8 codes, per-block scale amax/127, and scale * sum(codes): the
    kernel's activation quantization (round half to even)."""
    m, k = x.shape
    blocks = x.float().view(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    codes = torch.round(blocks * inv.unsqueeze(-1)).to(torch.int8)
    return codes.view(m, k), d, d * codes.sum(-1, dtype=torch.int32).float()


def reference_linear(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The kernel's arithmetic in torch: integer block sums (exact, int64), scaled in fp64."""
    n, k = w.shape
    qx, dx, sx = quantize_activations(x)
    xb = qx.view(-1, k // BLOCK, BLOCK).long()
    wb = w.codes().view(n, k // BLOCK, BLOCK).long()
    dots = torch.einsum("mbj,nbj->mnb", xb, wb).double()  # [M, N, blocks]
    scaled = dots * w.d.double().unsqueeze(0) * dx.double().unsqueeze(1)
    offsets = sx.double().unsqueeze(1) * w.m.double().unsqueeze(0)
    return (scaled + offsets).sum(-1).float()
