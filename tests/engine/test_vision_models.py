"""Vision-language checkpoints against transformers' own classes: greedy tokens and logprobs.

Gemma 3's `Gemma3ForConditionalGeneration` serves text-only requests with its decoder (the
wrapper's head has no final soft-capping, which `Gemma3ForCausalLM` would apply: the tiny model
sets one, so reading the text config as a causal LM's would change the tokens).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from test_parity import NEW_TOKENS, assert_parity, engine_greedy, hf_greedy, tiny_prompts
from vision_models import (
    chatml,
    data_url,
    gemma3_ids,
    llava_reference,
    make_gemma3_vlm,
    make_llava,
    random_image,
)
from vision_models import gemma3_reference as gemma3_images_reference

from triollm.engine.loading.model_config import ModelConfig

PROMPTS = tiny_prompts()


@pytest.fixture(scope="module")
def gemma3_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # No attention soft-capping (Gemma 3 has none; transformers' SDPA path would ignore it).
    return make_gemma3_vlm(tmp_path_factory.mktemp("gemma3-vlm"), seed=5, final_logit_softcapping=3.0)


@pytest.fixture(scope="module")
def gemma3_reference(gemma3_vlm: Path) -> list[tuple[list[int], list[float]]]:
    return hf_greedy(gemma3_vlm, PROMPTS)


def test_gemma3_vlm_reads_its_text_config(gemma3_vlm: Path) -> None:
    cfg = ModelConfig.from_pretrained(gemma3_vlm, max_model_len=160)
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert cfg.multimodal is not None and cfg.multimodal.architecture == "Gemma3ForConditionalGeneration"
    assert (cfg.num_layers, cfg.head_dim, cfg.sliding_window) == (2, 16, 9)
    assert cfg.final_softcap is None and cfg.attn_softcap is None
    assert cfg.tie_word_embeddings


@pytest.mark.parametrize("regime", ["chunked", "prefix"])
def test_gemma3_vlm_text_only_greedy_parity(gemma3_vlm: Path, gemma3_reference, regime: str) -> None:
    ours, _ = engine_greedy(gemma3_vlm, PROMPTS, regime)
    assert_parity(ours, gemma3_reference)


def test_gemma3_vlm_text_only_through_llm(gemma3_vlm: Path, gemma3_reference) -> None:
    from triollm import LLM, SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(gemma3_vlm), max_model_len=160, multiprocess=False, model_impl="triollm") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [ref[0] for ref in gemma3_reference[:4]]


def test_gemma3_vlm_refusals(gemma3_vlm: Path, tmp_path: Path) -> None:
    import json

    with pytest.raises(ValueError, match="model_impl: 'transformers' runs causal LMs, not Gemma3ForConditional"):
        ModelConfig.from_pretrained(gemma3_vlm, max_model_len=64, model_impl="transformers")
    config = json.loads((gemma3_vlm / "config.json").read_text())
    config["text_config"]["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="text_config.model_type: .* needs 'gemma3_text'"):
        ModelConfig.from_pretrained(tmp_path, max_model_len=64)


# ---------------------------------------------------------------------------------------- LLaVA

IMAGE_PROMPTS = [
    "The capital of <image> is",  # one image
    "<image> and <image>: count one, two, three",  # two images, the first at position 0
    "def add(a, b): return a + b",  # text only
]


IMAGES = [[random_image(1, (40, 50))], [random_image(2, (64, 32)), random_image(3, (28, 28))], []]


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llava(tmp_path_factory.mktemp("llava"), seed=3)


@pytest.fixture(scope="module")
def llava_references(llava: Path) -> list[list[int]]:
    return [llava_reference(llava, text, images) for text, images in zip(IMAGE_PROMPTS, IMAGES)]


def _mm_prompt(text: str, images: list[Any]) -> dict[str, Any]:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}


def test_llava_greedy_parity_through_llm(llava: Path, llava_references: list[list[int]]) -> None:
    """One and two images and text only, batched; an 8-token budget cuts prefill chunks through
    the images' 16 positions."""
    from triollm import LLM, SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [_mm_prompt(t, i) for t, i in zip(IMAGE_PROMPTS, IMAGES)]
    # In a child process: the images cross the wire to the engine core.
    with LLM(str(llava), max_model_len=160, max_num_batched_tokens=8, multiprocess=True) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        single = llm.generate({"prompt": IMAGE_PROMPTS[0], "multi_modal_data": {"image": IMAGES[0][0]}}, params)
    assert [list(o.outputs[0].token_ids) for o in outs] == llava_references
    assert list(single[0].outputs[0].token_ids) == llava_references[0]


def test_llava_one_token_chunks_feed_the_image(llava: Path, llava_references: list[list[int]]) -> None:
    """A one-token budget: every prompt position, the image's included, runs as a decode row
    (a one-token chunk), and the image's features still replace its positions' embeddings."""
    from triollm import LLM, SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(str(llava), max_model_len=160, max_num_batched_tokens=1, multiprocess=False) as llm:
        [out] = llm.generate(_mm_prompt(IMAGE_PROMPTS[0], IMAGES[0]), params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == llava_references[0]


def test_llava_repeated_image_is_a_prefix_cache_hit(llava: Path) -> None:
    """The same image again: its blocks come from the prefix cache and the vision tower does
    not run; another image behind the same text: a miss from the image's first block on."""
    from triollm import SamplingParams
    from triollm.engine.config import EngineArgs
    from triollm.engine.sync_engine import SyncEngine

    text = "<image> " + "The quick brown fox jumps over the lazy dog. " * 2
    engine = SyncEngine.from_engine_args(
        EngineArgs(model=str(llava), max_model_len=160, enable_prefix_caching=True, block_size=16)
    )
    vision = engine.core.executor.runner.vision
    assert vision is not None
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def run(image: Any) -> Any:
        engine.add_request({"prompt": text, "multi_modal_data": {"image": image}}, params)
        done = []
        while engine.has_unfinished_requests():
            done += [out for out in engine.step() if out.finished]
            engine.core.check_integrity()  # the block hashes include the image spans
        return done[0]

    first = run(random_image(7, (30, 30)))
    assert vision.num_runs == 1 and first.num_cached_tokens == 0
    again = run(random_image(7, (30, 30)))  # equal pixels, another object
    assert vision.num_runs == 1
    assert again.num_cached_tokens >= 32 and again.outputs[0].token_ids == first.outputs[0].token_ids
    other = run(random_image(8, (30, 30)))
    assert vision.num_runs == 2 and other.num_cached_tokens == 0
    assert list(other.outputs[0].token_ids) == llava_reference(llava, text, [random_image(8, (30, 30))])


def test_llava_mm_processor_kwargs_reach_the_image_processor(llava: Path) -> None:
    from triollm import SamplingParams
    from triollm.engine.config import EngineArgs
    from triollm.engine.sync_engine import SyncEngine

    engine = SyncEngine.from_engine_args(EngineArgs(model=str(llava), max_model_len=160))
    image = random_image(31, (50, 40))
    prompt = {"prompt": IMAGE_PROMPTS[0], "multi_modal_data": {"image": image}}
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    [plain] = engine.generate(prompt, params)
    [raw] = engine.generate({**prompt, "mm_processor_kwargs": {"do_normalize": False}}, params)
    assert list(raw.outputs[0].token_ids) == llava_reference(llava, IMAGE_PROMPTS[0], [image], do_normalize=False)
    assert raw.outputs[0].token_ids != plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="mm_processor_kwargs: expected a JSON object"):
        engine.generate({**prompt, "mm_processor_kwargs": ["do_normalize"]}, params)


def test_llava_image_requests_refused(llava: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    import shutil

    from triollm import LLM, SamplingParams

    params = SamplingParams(max_tokens=2)
    two = {
        "prompt": "<image> <image>",
        "multi_modal_data": {"image": [random_image(1, (9, 9)), random_image(2, (9, 9))]},
    }
    with LLM(str(llava), max_model_len=160, multiprocess=False, limit_mm_per_prompt={"image": 1}) as llm:
        with pytest.raises(ValueError, match="limit_mm_per_prompt: 2 images exceed the limit of 1"):
            llm.generate(two, params)
        with pytest.raises(ValueError, match="multi_modal_data: 1 images but the prompt has 0 image placeholders"):
            llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": random_image(1, (9, 9))}}, params)
        with pytest.raises(ValueError, match=r"multi_modal_data.image\[0\]: expected a PIL.Image.Image, got str"):
            llm.generate({"prompt": "<image>", "multi_modal_data": {"image": "cat.png"}}, params)
        with pytest.raises(ValueError, match="multi_modal_data: the prompt holds image placeholders .* but no images"):
            llm.generate({"prompt": "<image> alone"}, params)
        with pytest.raises(ValueError, match="multi_modal_data: expected {'image'"):
            llm.generate({"prompt": "<image>", "multi_modal_data": {"video": []}}, params)
    with LLM(str(tiny_model_dir), max_model_len=64, multiprocess=False) as llm:
        with pytest.raises(ValueError, match="multi_modal_data: LlamaForCausalLM is a text-only model"):
            llm.generate({"prompt": "x", "multi_modal_data": {"image": random_image(1, (9, 9))}}, params)
    with pytest.raises(ValueError, match="limit_mm_per_prompt: unsupported modalities \\['video'\\]"):
        LLM(str(llava), max_model_len=160, multiprocess=False, limit_mm_per_prompt={"video": 1})
    bare = tmp_path / "llava-without-processor"
    shutil.copytree(llava, bare)
    (bare / "preprocessor_config.json").unlink()
    with pytest.raises(ValueError, match="has no preprocessor_config.json"):
        LLM(str(bare), max_model_len=160, multiprocess=False)


# -------------------------------------------------------------------------------- Gemma 3 images

GEMMA3_PROMPTS = [
    "The capital of <start_of_image> is",  # one image
    "<start_of_image> and <start_of_image>: count one, two, three",  # two images, the first at the start
    "def add(a, b): return a + b",  # text only
]
GEMMA3_IMAGES = [[random_image(1, (40, 50))], [random_image(2, (64, 32)), random_image(3, (28, 28))], []]


@pytest.fixture(scope="module")
def gemma3_image_references(gemma3_vlm: Path) -> list[list[int]]:
    return [gemma3_images_reference(gemma3_vlm, t, i) for t, i in zip(GEMMA3_PROMPTS, GEMMA3_IMAGES)]


@pytest.mark.parametrize("budget", [8, 2048])
def test_gemma3_images_greedy_parity_through_llm(
    gemma3_vlm: Path, gemma3_image_references: list[list[int]], budget: int
) -> None:
    """One and two images and text only, batched, against transformers (its bidirectional
    token_type_ids mask over each image's 4 positions); an 8-token budget makes prefill chunks
    that must stop before an image or take it whole."""
    from triollm import LLM, SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [_mm_prompt(t, i) for t, i in zip(GEMMA3_PROMPTS, GEMMA3_IMAGES)]
    with LLM(str(gemma3_vlm), max_model_len=160, max_num_batched_tokens=budget, multiprocess=budget == 8) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == gemma3_image_references
    ids, _ = gemma3_ids(gemma3_vlm, GEMMA3_PROMPTS[0])
    assert list(outs[0].prompt_token_ids) == ids  # <start_of_image> expanded as Gemma3Processor does


def test_gemma3_images_need_the_bidirectional_mask(
    gemma3_vlm: Path, gemma3_image_references: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the spans on the prefill plan (causal image positions), the tokens differ."""
    from triollm import LLM, SamplingParams
    from triollm.engine.execution import model_runner

    monkeypatch.setattr(model_runner, "_bidirectional_spans", lambda meta, prefills: None)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(str(gemma3_vlm), max_model_len=160, multiprocess=False) as llm:
        outs = llm.generate([_mm_prompt(t, i) for t, i in zip(GEMMA3_PROMPTS[:2], GEMMA3_IMAGES)], params)
    assert [list(o.outputs[0].token_ids) for o in outs] != gemma3_image_references[:2]


def test_gemma3_prefill_chunks_never_cut_an_image(gemma3_vlm: Path) -> None:
    """With a 5-token budget every chunk ends before an image or holds all of its 4 positions."""
    from triollm import SamplingParams
    from triollm.engine.config import EngineArgs
    from triollm.engine.sync_engine import SyncEngine

    engine = SyncEngine.from_engine_args(EngineArgs(model=str(gemma3_vlm), max_model_len=160, max_num_batched_tokens=5))
    engine.add_request(_mm_prompt(GEMMA3_PROMPTS[1], GEMMA3_IMAGES[1]), SamplingParams(max_tokens=2))
    scheduler, chunks = engine.core.scheduler, []
    schedule = scheduler.schedule

    def spy() -> Any:
        out = schedule()
        chunks.extend((s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled if s.num_new_tokens > 1)
        return out

    scheduler.schedule = spy  # type: ignore[method-assign]
    while engine.has_unfinished_requests():
        engine.step()
    _, types = gemma3_ids(gemma3_vlm, GEMMA3_PROMPTS[1])
    starts = [i for i, t in enumerate(types) if t and not (i and types[i - 1])]
    spans = [(a, a + 4) for a in starts]
    assert len(spans) == 2 and all(types[a:b] == [1] * 4 for a, b in spans)
    assert all(not (a < c + n < b) and not (a < c < b) for c, n in chunks for a, b in spans)
    assert [c for c, _ in chunks] == sorted(c for c, _ in chunks) and sum(n for _, n in chunks) >= len(types) - 1


def test_gemma3_image_passes_a_small_prefill_budget(gemma3_vlm: Path, gemma3_image_references: list[list[int]]) -> None:
    """A prefill budget smaller than an image (decodes keep it small under load) does not hold
    the image back: its chunk takes all of it, within max_num_batched_tokens."""
    from triollm import SamplingParams
    from triollm.engine.config import EngineArgs
    from triollm.engine.sync_engine import SyncEngine

    engine = SyncEngine.from_engine_args(
        EngineArgs(model=str(gemma3_vlm), max_model_len=160, max_num_batched_tokens=16)
    )
    scheduler = engine.core.scheduler
    scheduler._prefill_budget = lambda *args: 2  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine.add_request(_mm_prompt(GEMMA3_PROMPTS[0], GEMMA3_IMAGES[0]), params)
    done = []
    for _ in range(64):
        done += [out for out in engine.step() if out.finished]
        if not engine.has_unfinished_requests():
            break
    assert len(done) == 1 and list(done[0].outputs[0].token_ids) == gemma3_image_references[0]


def test_gemma3_chat_with_image_parts(gemma3_vlm: Path) -> None:
    """`LLM.chat`: image parts render as `<start_of_image>` where they stand."""
    from triollm import LLM, SamplingParams

    first, second = random_image(11, (33, 47)), random_image(12, (20, 60))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image_url", "image_url": {"url": data_url(first)}},
                {"type": "image_pil", "image_pil": second},
                {"type": "text", "text": "count one, two"},
            ],
        }
    ]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(str(gemma3_vlm), max_model_len=160, multiprocess=False) as llm:
        [out] = llm.chat(messages, params, use_tqdm=False)
    text = chatml("Look:\n<start_of_image>\n<start_of_image>\ncount one, two")
    assert list(out.outputs[0].token_ids) == gemma3_images_reference(gemma3_vlm, text, [first, second])


@contextmanager
def threaded_server(routes: dict[str, tuple[int, bytes, float]]) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 in a thread: path -> (status, body, seconds to wait first)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            status, body, wait = routes[self.path]
            time.sleep(wait)
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except OSError:
                pass  # the client gave up

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_gemma3_chat_fetches_http_image_urls(gemma3_vlm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`LLM.chat` fetches an http URL (blocking, in the caller's thread); a 404 and a response
    later than VLLM_IMAGE_FETCH_TIMEOUT are ValueErrors naming the part."""
    import io

    from triollm import LLM, SamplingParams

    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "0.3")
    image = random_image(13, (30, 40))
    png = io.BytesIO()
    image.save(png, format="PNG")
    routes = {"/a.png": (200, png.getvalue(), 0.0), "/gone.png": (404, b"", 0.0), "/slow.png": (200, b"", 1.0)}

    def chat(url: str) -> list[dict[str, Any]]:
        parts = [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": url}}]
        return [{"role": "user", "content": parts}]

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with threaded_server(routes) as base, LLM(str(gemma3_vlm), max_model_len=160, multiprocess=False) as llm:
        [out] = llm.chat(chat(f"{base}/a.png"), params, use_tqdm=False)
        for path, text in (("/gone.png", "gave HTTP 404"), ("/slow.png", "took longer than 0.3 s")):
            with pytest.raises(ValueError, match=rf"messages\[0\].content\[1\].image_url: .*{text}"):
                llm.chat(chat(base + path), params, use_tqdm=False)
    expected = gemma3_images_reference(gemma3_vlm, chatml("Look:\n<start_of_image>"), [image])
    assert list(out.outputs[0].token_ids) == expected


def test_gemma3_repeated_image_is_a_prefix_cache_hit(gemma3_vlm: Path) -> None:
    """The same image again: a prefix-cache hit through the image's block, and the tower does
    not run; another image: a miss from the block holding its first position."""
    from triollm import SamplingParams
    from triollm.engine.config import EngineArgs
    from triollm.engine.sync_engine import SyncEngine

    text = "<start_of_image> " + "The quick brown fox jumps over the lazy dog. " * 2
    engine = SyncEngine.from_engine_args(
        EngineArgs(model=str(gemma3_vlm), max_model_len=160, enable_prefix_caching=True, block_size=8)
    )
    vision = engine.core.executor.runner.vision
    assert vision is not None
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def run(image: Any) -> Any:
        engine.add_request({"prompt": text, "multi_modal_data": {"image": image}}, params)
        done = []
        while engine.has_unfinished_requests():
            done += [out for out in engine.step() if out.finished]
            engine.core.check_integrity()
        return done[0]

    first = run(random_image(7, (30, 30)))
    assert vision.num_runs == 1 and first.num_cached_tokens == 0
    assert list(first.outputs[0].token_ids) == gemma3_images_reference(gemma3_vlm, text, [random_image(7, (30, 30))])
    again = run(random_image(7, (30, 30)))
    assert vision.num_runs == 1
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == first.outputs[0].token_ids
    other = run(random_image(8, (30, 30)))
    assert vision.num_runs == 2 and other.num_cached_tokens == 0
    assert list(other.outputs[0].token_ids) == gemma3_images_reference(gemma3_vlm, text, [random_image(8, (30, 30))])


def test_gemma3_image_refusals(gemma3_vlm: Path, tmp_path: Path) -> None:
    import json

    from triollm import LLM, SamplingParams

    with pytest.raises(ValueError, match="max_num_batched_tokens: 3 is smaller than the 4 positions of one image"):
        LLM(str(gemma3_vlm), max_model_len=160, max_num_batched_tokens=3, multiprocess=False)
    with LLM(str(gemma3_vlm), max_model_len=160, multiprocess=False) as llm:
        with pytest.raises(ValueError, match="multi_modal_data: 1 images but the prompt has 0 image placeholders"):
            llm.generate(
                {"prompt": "x", "multi_modal_data": {"image": random_image(1, (9, 9))}}, SamplingParams(max_tokens=2)
            )
    config = json.loads((gemma3_vlm / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors", "preprocessor_config.json"):
        (tmp_path / name).symlink_to(gemma3_vlm / name)
    (tmp_path / "config.json").write_text(json.dumps({**config, "mm_tokens_per_image": 9}))
    with pytest.raises(ValueError, match="mm_tokens_per_image: 9 must be the square of a divisor of the 4 patches"):
        LLM(str(tmp_path), max_model_len=160, multiprocess=False)
    # Without its image processor a Gemma 3 checkpoint still serves text; images are refused.
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "preprocessor_config.json").unlink()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(str(tmp_path), max_model_len=160, multiprocess=False) as llm:
        [text] = llm.generate(GEMMA3_PROMPTS[2], params, use_tqdm=False)
        assert list(text.outputs[0].token_ids) == gemma3_images_reference(gemma3_vlm, GEMMA3_PROMPTS[2], [])
        with pytest.raises(ValueError, match="multi_modal_data: .* serves text only here: .* no preprocessor_config"):
            llm.generate(_mm_prompt(GEMMA3_PROMPTS[0], GEMMA3_IMAGES[0]), params)


def test_llava_chat_with_image_parts(llava: Path) -> None:
    """`LLM.chat`: an `image_url` part (a data URL) and an `image_pil` part render as `<image>`
    where they stand (text parts joined by newlines), the images in order."""
    from triollm import LLM, SamplingParams

    first, second = random_image(11, (33, 47)), random_image(12, (20, 60))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image_url", "image_url": {"url": data_url(first)}},
                {"type": "image_pil", "image_pil": second},
                {"type": "text", "text": "count one, two"},
            ],
        }
    ]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(str(llava), max_model_len=160, multiprocess=False) as llm:
        [out] = llm.chat(messages, params, use_tqdm=False)
    expected = llava_reference(llava, chatml("Look:\n<image>\n<image>\ncount one, two"), [first, second])
    assert list(out.outputs[0].token_ids) == expected


def test_shipped_configs_split() -> None:
    """llava-hf/llava-1.5-7b-hf's and google/gemma-3-4b-it's config.json shapes: sparse text
    configs filled with transformers' defaults, the image geometry read."""
    from triollm.engine.loading.hf_config import parse_hf_config
    from triollm.engine.loading.multimodal_config import split_multimodal

    llava = {
        "architectures": ["LlavaForConditionalGeneration"],
        "image_token_index": 32000,
        "model_type": "llava",
        "pad_token_id": 32001,
        "projector_hidden_act": "gelu",
        "text_config": {
            "architectures": ["LlamaForCausalLM"],
            "max_position_embeddings": 4096,
            "model_type": "llama",
            "rms_norm_eps": 1e-05,
            "torch_dtype": "float16",
            "vocab_size": 32064,
        },
        "torch_dtype": "float16",
        "vision_config": {"hidden_size": 1024, "image_size": 336, "model_type": "clip_vision_model", "patch_size": 14},
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
    }
    text, spec = split_multimodal(llava)
    assert spec is not None and (spec.image_token_id, spec.tokens_per_image, spec.takes_images) == (32000, 576, True)
    cfg = parse_hf_config(text, "triollm")
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == ("LlamaForCausalLM", 32, 4096, 32064)
    gemma = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "eos_token_id": [1, 106],
        "mm_tokens_per_image": 256,
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "torch_dtype": "bfloat16",
    }
    text, spec = split_multimodal(gemma)
    assert spec is not None and (spec.tokens_per_image, spec.takes_images, spec.bidirectional) == (256, True, True)
    assert (spec.prompt_token_id, spec.image_token_id, spec.end_id) == (255999, 262144, 256000)
    cfg = parse_hf_config(text, "triollm")
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (34, 8, 4, 256)
    assert cfg.tie_word_embeddings and cfg.rope.factor == 8.0 and text["eos_token_id"] == [1, 106]
    for bad, match in (
        ({**llava, "vision_feature_layer": [-2, -5]}, "vision_feature_layer: expected one layer index"),
        ({**llava, "vision_feature_select_strategy": "cls"}, "vision_feature_select_strategy: 'cls'"),
        ({**llava, "image_token_index": 40000}, "image_token_index: 40000 lies outside the vocabulary"),
        ({**llava, "text_config": {"model_type": "qwen2"}}, "text_config.model_type: .* needs 'llama'"),
    ):
        with pytest.raises(ValueError, match=match):
            split_multimodal(bad)
