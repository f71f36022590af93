"""`triollm bench`: throughput and latency (offline), pipeline (the actor layer), serve (a
client), quality (quantized weights against the dense model), soak (a mixed hostile load with leak
checks), moe (the routed-experts block by expert count), lora (adapters against the base model),
step (where a batch-N decode step's time goes, against its floors), embed (LLM.embed beside
sentence-transformers), vision (time to first token with an image, cold and repeated).

The rule: a benchmark uses what a user can: `triollm`'s exports (`LLM`, `AsyncLLM`, `EngineArgs`,
`SamplingParams`), the HTTP server (serve and soak are clients of `triollm serve`), the vLLM
paths (`triollm.lora.request`) and `triollm.testing`. An import from below that surface says at
the import, in one line, why it may not: the offline yardsticks drive the engine directly
(`SyncEngine`: no portal, no actors, each step timed; step also wraps its phases), quality
sends its children resolved configs, and moe times one layer alone. Nothing in the server
package imports a benchmark but the CLI, which registers these commands.
"""

from __future__ import annotations

from typing import Any

from triollm.bench.embed import add_embed_parser
from triollm.bench.latency import add_latency_parser
from triollm.bench.lora import add_lora_parser
from triollm.bench.moe import add_moe_parsers
from triollm.bench.pipeline import add_pipeline_parser
from triollm.bench.quality import add_quality_parser
from triollm.bench.serve import add_serve_bench_parser
from triollm.bench.soak import add_soak_parser
from triollm.bench.step import add_step_parser
from triollm.bench.throughput import add_throughput_parsers
from triollm.bench.vision import add_vision_parser

__all__ = ["add_bench_parser"]


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser(
        "bench", help="benchmarks (throughput, latency, pipeline, serve, quality, soak, moe, lora, step, embed, vision)"
    )
    kinds = bench.add_subparsers(dest="bench", required=True)
    add_throughput_parsers(kinds)
    add_latency_parser(kinds)
    add_pipeline_parser(kinds)
    add_serve_bench_parser(kinds)
    add_quality_parser(kinds)
    add_soak_parser(kinds)
    add_moe_parsers(kinds)
    add_lora_parser(kinds)
    add_step_parser(kinds)
    add_embed_parser(kinds)
    add_vision_parser(kinds)
