"""The resolved `EngineConfig` on the wire, for an engine core that runs elsewhere.

The parent resolves `EngineArgs` once (`create_engine_config()`: the machine's CPU features, the
model's files, the environment) and hands an engine core started in a child process, a Ray
actor or a data-parallel rank the result itself, so the two sides cannot disagree about dtype,
quantization, threads or the KV cache's dtype. What a child legitimately runs with differently
(multiprocess off, its share of the threads, its rank) the parent sets with
`dataclasses.replace` before encoding; the receiver only decodes.

The config is a tree of frozen dataclasses, which msgspec encodes and decodes natively, checking
every field's type on the way in (an error names the field's path, `$.model.dtype`). The two leaf
types it does not know travel as strings: a `torch.dtype` by its name (`"bfloat16"`), a
`pathlib.Path` as its text. MessagePack rather than JSON: every float comes back bit for bit,
`inf` included, which JSON cannot say.

Rejected: sending the user's arguments and re-running `create_engine_config()` in the child (the
old way; a second resolution once made the bundled model run fp32 in the child while the parent
had chosen quantized); pickle (code runs on load, and no field is checked).
"""

from __future__ import annotations

from pathlib import Path, PurePath
from typing import Any

import msgspec
import torch

from triollm.engine.config import EngineConfig

__all__ = ["dec_hook", "decode_config", "enc_hook", "encode_config"]


def enc_hook(obj: Any) -> Any:
    """The config's leaf types msgspec does not know, as strings."""
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    if isinstance(obj, PurePath):
        return str(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__} in an engine config")


def dec_hook(type_: type, obj: Any) -> Any:
    """Back from `enc_hook`'s strings; anything else is refused (msgspec names the field)."""
    if type_ is torch.dtype:
        dtype = getattr(torch, obj, None) if isinstance(obj, str) else None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{obj!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
        return dtype
    if type_ is Path:
        if not isinstance(obj, str):
            raise ValueError(f"expected a path string, got {type(obj).__name__}")
        return Path(obj)
    raise NotImplementedError(f"cannot decode {type_!r} in an engine config")


_encoder = msgspec.msgpack.Encoder(enc_hook=enc_hook)
_decoder = msgspec.msgpack.Decoder(EngineConfig, dec_hook=dec_hook)


def encode_config(config: EngineConfig) -> bytes:
    """`config` as MessagePack; `decode_config` gives back an equal `EngineConfig`."""
    return _encoder.encode(config)


def decode_config(data: bytes) -> EngineConfig:
    """The `EngineConfig` that `encode_config` encoded. Raises `ValueError` naming the field
    that does not fit (a config from another version of triollm, say)."""
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"engine config: {exc}") from None
