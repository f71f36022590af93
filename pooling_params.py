"""`vllm.pooling_params`, for scripts that import from there: the parameters of a pooling request.

A re-export only; the definition lives in `triollm.engine.pooling_params`.
"""

from __future__ import annotations

from triollm.engine.pooling_params import PoolingParams

__all__ = ["PoolingParams"]
