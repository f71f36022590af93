"""The frontend: the sans-IO request table (frontend.py) with its input and output halves."""

from __future__ import annotations

from triollm.engine.frontend.frontend import (
    Frontend,
    OutputSink,
    Phase,
    ProcessedOutputs,
    RequestState,
    TableStatistics,
)
from triollm.engine.frontend.input import (
    GENERATE_ON_POOLING,
    POOLING_ON_GENERATE,
    POOLING_PLACEHOLDER,
    InputProcessor,
    ProcessedRequest,
    core_request_ids,
    input_size,
)
from triollm.engine.frontend.lora import LORA_NOT_ENABLED, LoRAChecker

__all__ = [
    "GENERATE_ON_POOLING",
    "POOLING_ON_GENERATE",
    "POOLING_PLACEHOLDER",
    "Frontend",
    "TableStatistics",
    "InputProcessor",
    "LORA_NOT_ENABLED",
    "LoRAChecker",
    "OutputSink",
    "Phase",
    "ProcessedOutputs",
    "ProcessedRequest",
    "RequestState",
    "core_request_ids",
    "input_size",
]
