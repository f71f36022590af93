"""Quantized checkpoints of one model, in each format `triollm bench quality --checkpoints` measures.

    .venv/bin/python docs/bench/make_quant_checkpoints.py OUT [--model M] [--gguf SRC.gguf] [--formats a,b]

From an HF-format model directory (`--model`; default: the bundled SmolLM2-135M-Instruct's dense
import, the one `EngineArgs().create_engine_config().model.path` names: its GGUF dequantized to
fp32), into OUT:

* HF directories (tests/quant_formats.py, the published layouts and `quantization_config`s):
  GPTQ 4-bit g128 symmetric, and with `desc_act` (a random act order in `g_idx`); AWQ 4-bit g128
  (GEMM); compressed-tensors W4A16 g128 (`pack-quantized`), int8 per channel (`int-quantized`)
  and FP8 e4m3 per channel (`float-quantized`). Groups of 128 where the input widths allow it:
  AWQ and compressed-tensors need groups that divide every width (SmolLM2-135M's are 576 and
  1536), so there the group is the largest power of two from 128 down to 32 that does, and the
  directory says which (`awq-4bit-g64`); GPTQ's `g_idx` carries a short last group as real
  GPTQ checkpoints do.
* GGUF files (tests/tiny_gguf.py `requantize_gguf`, K-quants by tests/kquant_ref.py): the GGUF
  `--gguf` (default: the bundled one, or `--model` when it is a .gguf) with its metadata and
  tokenizer, every tensor requantized from its own dequantized values: `Q4_K_M` and `Q5_K_M` as
  llama.cpp mixes them (Q6_K for the output, or the tied embedding, and for attn_v and ffn_down
  in the layers `_use_more_bits` picks; the base type elsewhere), and `Q6_K` throughout. A row
  of a width that is not a multiple of 256 cannot hold K-quant super-blocks; llama.cpp falls
  back to Q5_0 / Q5_1 / Q8_0 there, which would leave Q5_0 and Q5_1 tensors dense in triollm,
  so here the fallback is the nearest block type triollm keeps with at least as many bits
  (`FALLBACK`: Q4_1, Q8_0, Q8_0). On SmolLM2-135M only ffn_down (1536 wide) is a K-quant.

Every quantizer rounds to nearest (min-max per group; no GPTQ Hessian, AWQ scaling or llama.cpp
scale search): the bench measures how faithfully the engine runs each format, not how good a
quantizer is. Prints the paths as a `--checkpoints` argument.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
from gguf import GGMLQuantizationType as T
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from quant_formats import Kind, write_quantized  # noqa: E402
from tiny_gguf import requantize_gguf  # noqa: E402

HF_FORMATS = {
    "gptq-4bit-g128-sym": Kind("gptq", 4, 128, True),
    "gptq-4bit-g128-sym-act": Kind("gptq", 4, 128, True, desc_act=True),
    "awq-4bit-g128": Kind("awq", 4, 128, False),
    "ct-w4a16-g128": Kind("ct-pack", 4, 128, True),
    "ct-int8-channel": Kind("ct-int8", 8, -1, True),
    "ct-fp8-channel": Kind("ct-fp8", 8, -1, True),
}
GGUF_MIXES = {
    "Q4_K_M": (T.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M),
    "Q5_K_M": (T.Q5_K, gguf.LlamaFileType.MOSTLY_Q5_K_M),
    "Q6_K": (T.Q6_K, gguf.LlamaFileType.MOSTLY_Q6_K),
}
FORMATS = (*HF_FORMATS, *GGUF_MIXES)
FALLBACK = {T.Q4_K: T.Q4_1, T.Q5_K: T.Q8_0, T.Q6_K: T.Q8_0}  # rows not a multiple of 256 wide


def group_for(kind: Kind, widths: set[int]) -> int | None:
    """The group size `kind` is written with: its own where every input width takes it (GPTQ:
    any multiple of 32, a short last group in g_idx), else the largest power of two from it down
    to 32 that divides every width; None where none does."""
    if kind.group == -1 or (kind.method == "gptq" and all(w % 32 == 0 for w in widths)):
        return kind.group
    group = kind.group
    while group >= 32:
        if all(w % group == 0 for w in widths):
            return group
        group //= 2
    return None


def _use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get Q6_K in a _M mix."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def kquant_types(mix: str, tensors: set[str], layers: int) -> dict[str, T]:
    """The block type of each 2-D tensor name in `mix` (before the width fallback)."""
    base = GGUF_MIXES[mix][0]
    types = {}
    for name in tensors:
        kind = base
        if name == "output.weight" or (name == "token_embd.weight" and "output.weight" not in tensors):
            kind = T.Q6_K
        elif name.endswith(("attn_v.weight", "ffn_down.weight")) and _use_more_bits(int(name.split(".")[1]), layers):
            kind = T.Q6_K
        types[name] = kind
    return types


def write_gguf(src: Path, out: Path, mix: str) -> dict[str, T]:
    """`src` requantized as `mix` into `out`; the type of each tensor written."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    types = kquant_types(mix, {t.name for t in reader.tensors if len(t.shape) == 2}, layers)
    del reader

    def choose(name: str, shape: tuple[int, ...]) -> T:
        if len(shape) != 2:
            return T.F32
        kind = types[name]
        return FALLBACK[kind] if shape[1] % 256 else kind

    return requantize_gguf(src, out, choose, GGUF_MIXES[mix][1])


def linear_widths(model_dir: Path) -> set[int]:
    """The input widths of the decoder's matrices (those `write_quantized` quantizes among them)."""
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        shapes = [f.get_slice(name).get_shape() for name in f.keys() if name.startswith("model.layers.")]
    return {shape[1] for shape in shapes if len(shape) == 2}


def write_checkpoints(
    out: Path, model_dir: Path, gguf_src: Path | None, formats: list[str], seed: int = 0
) -> list[Path]:
    """Each of `formats` (FORMATS) of the model in `model_dir` (GGUF mixes from `gguf_src`)
    written into `out`; the paths written."""
    from triollm.engine.loading.model_config import QUANTIZED_FILE

    out.mkdir(parents=True, exist_ok=True)
    widths = linear_widths(model_dir)
    written = []
    for name in formats:
        if name in GGUF_MIXES:
            if gguf_src is None:
                print(f"skipping {name}: no GGUF to requantize (--gguf)", file=sys.stderr)
                continue
            path = out / f"{gguf_src.stem.split('.')[0]}-{name}.gguf"
            types = write_gguf(gguf_src, path, name)
            counts = {k.name: list(types.values()).count(k) for k in dict.fromkeys(types.values())}
            print(f"{path}: {', '.join(f'{n} x{c}' for n, c in counts.items())}", file=sys.stderr)
        else:
            kind = HF_FORMATS[name]
            group = group_for(kind, widths)
            if group is None:
                print(
                    f"skipping {name}: no group of 32..{kind.group} divides the input widths {sorted(widths)}",
                    file=sys.stderr,
                )
                continue
            path = out / name.replace(f"g{kind.group}", f"g{group}")
            write_quantized(model_dir, path, Kind(kind.method, kind.bits, group, kind.sym, kind.desc_act), seed=seed)
            (path / QUANTIZED_FILE).unlink(missing_ok=True)  # a GGUF import's blocks: not this checkpoint's
            print(f"{path}: {name.replace(f'g{kind.group}', f'g{group}')}", file=sys.stderr)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="the directory to write the checkpoints into")
    p.add_argument("--model", default=None, help="an HF-format model directory or a .gguf (default: the bundled model)")
    p.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help=(
            "the GGUF the K-quant files requantize (default: --model if a .gguf, else the bundled one if --model is "
            "unset)"
        ),
    )
    p.add_argument(
        "--formats", default=",".join(FORMATS), help=f"comma-separated, from {', '.join(FORMATS)} (default: all)"
    )
    p.add_argument("--cache-dir", default=None, help="where a .gguf model is imported (default: triollm's cache)")
    p.add_argument("--seed", type=int, default=0, help="the act order's random column order")
    ns = p.parse_args(argv)
    from triollm.engine.loading.model_files import bundled_gguf_path, resolve_model

    formats = [f.strip() for f in ns.formats.split(",") if f.strip()]
    for f in formats:
        if f not in FORMATS:
            p.error(f"--formats: {f!r} is not one of {', '.join(FORMATS)}")
    model_dir = resolve_model(ns.model, Path(ns.cache_dir) if ns.cache_dir else None)
    gguf_src = ns.gguf
    if gguf_src is None and (ns.model is None or ns.model.lower().endswith(".gguf")):
        gguf_src = bundled_gguf_path() if ns.model is None else Path(ns.model)
    paths = write_checkpoints(ns.out, model_dir, gguf_src, formats, ns.seed)
    print("--checkpoints " + ",".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
