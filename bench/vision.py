"""`triollm bench vision`: time to first token of a prompt with an image, cold and with the same
image again (issue 45: a repeated image is a prefix-cache hit and the vision tower does not run).

Each round takes a new random image (`--image-size`, pixels drawn from the round's seed) and
sends the same prompt twice: the first request encodes the image and prefills every position
(cold), the second finds the prompt's blocks in the prefix cache, keyed by the image's content
hash, and prefills only what follows the last cached block (hit). `max_tokens=1`, so a request's
time is its time to first token: from `add_request` (the image decoded, resized and split into
patches by the checkpoint's processor) to the finished output. The tower's own counter
(`VisionTower.num_runs`) says how many images each request encoded, and the output's
`num_cached_tokens` how many prompt positions came from the cache. A round before the timed ones
warms the kernels (it is not counted). Printed: the medians of the cold and hit times, their
ratio, the prompt's length and the images encoded per request of each kind.

The engine runs in this process (`SyncEngine`), with prefix caching on whatever the model's
default, so that the tower's counter can be read; the figures are the engine's, not the HTTP
server's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

from triollm import EngineArgs, SamplingParams
from triollm.engine.processing.chat_images import image_placeholder  # Not public: the model's placeholder text
from triollm.engine.sync_engine import SyncEngine  # Not public: in this process, to read the tower's counter

__all__ = ["add_vision_parser", "run_vision"]


def add_vision_parser(kinds: Any) -> None:
    p = kinds.add_parser("vision", help="time to first token with an image, cold and repeated (a prefix-cache hit)")
    p.add_argument(
        "--image-size", type=int, default=448, help="the square image's side in pixels (default: %(default)s)"
    )
    p.add_argument("--rounds", type=int, default=3, help="timed rounds, each a new image (default: %(default)s)")
    p.add_argument(
        "--text",
        default="Describe this image in detail.",
        help="the prompt's text after the image (default: %(default)r)",
    )
    p.add_argument("--output-json", default=None, help="also write the report to this file")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_vision)


def _image(seed: int, size: int) -> Any:
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 255, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def run_vision(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise ValueError("--rounds: must be at least 1")
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.enable_prefix_caching is False:
        raise ValueError("--no-enable-prefix-caching: this benchmark measures prefix-cache hits")
    engine = SyncEngine.from_engine_args(dataclasses.replace(engine_args, enable_prefix_caching=True))
    vision = getattr(engine.core.executor.runner, "vision", None)  # the model runner's tower, if any
    if vision is None:
        raise ValueError(f"model: {args.model} is not a vision-language model (it has no vision tower)")
    prompt_text = image_placeholder(engine.config.model, engine.tokenizer, "model") + " " + args.text
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def request(image: Any) -> dict[str, Any]:
        runs = vision.num_runs
        start = time.perf_counter()
        engine.add_request({"prompt": prompt_text, "multi_modal_data": {"image": image}}, params)
        done = []
        while engine.has_unfinished_requests():
            done += [out for out in engine.step() if out.finished]
        took = time.perf_counter() - start
        [out] = done
        return {
            "seconds": took,
            "prompt_tokens": len(out.prompt_token_ids or []),
            "cached_tokens": out.num_cached_tokens or 0,
            "images_encoded": vision.num_runs - runs,
        }

    request(_image(10_000, args.image_size))  # warm-up, not counted
    rounds = []
    for r in range(args.rounds):
        image = _image(r, args.image_size)
        rounds.append({"cold": request(image), "hit": request(image)})
    cold = statistics.median(x["cold"]["seconds"] for x in rounds)
    hit = statistics.median(x["hit"]["seconds"] for x in rounds)
    report = {
        "model": args.model,
        "image_size": args.image_size,
        "prompt_tokens": rounds[0]["cold"]["prompt_tokens"],
        "cold_ttft_s": cold,
        "hit_ttft_s": hit,
        "hit_over_cold": hit / cold,
        "rounds": rounds,
    }
    print(f"prompt: {report['prompt_tokens']} tokens ({args.image_size} x {args.image_size} image + text)")
    for i, x in enumerate(rounds):
        c, h = x["cold"], x["hit"]
        print(
            f"round {i}: cold {c['seconds'] * 1e3:.1f} ms ({c['images_encoded']} image encoded, {c['cached_tokens']} "
            f"cached); same image {h['seconds'] * 1e3:.1f} ms ({h['images_encoded']} encoded, "
            f"{h['cached_tokens']} cached)"
        )
    print(f"median TTFT: cold {cold * 1e3:.1f} ms, same image {hit * 1e3:.1f} ms: {hit / cold:.3f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)
    return 0
