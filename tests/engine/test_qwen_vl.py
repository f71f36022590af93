"""Qwen2-VL and Qwen2.5-VL against transformers' own classes: greedy tokens with images of
dynamic resolution and M-RoPE positions.

The checkpoints are tiny random `Qwen2VLForConditionalGeneration` /
`Qwen2_5_VLForConditionalGeneration` written by `save_pretrained` (fp32; a ViT of 4 x 4 patches
merged 2 x 2, Qwen2.5-VL's with a window attention block and a full one; a 2-layer Qwen2 decoder
with `mrope_section` [2, 3, 3] over its 8 rotary half-dims) beside the tiny byte-level tokenizer
with Qwen's three vision tokens added and a `Qwen2VLImageProcessor` bounded to 64..2304 pixels,
so a 40 x 50 image is 30 positions, 64 x 32 is 32 and 28 x 28 is 16.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from vision_models import _redraw, chatml, data_url, random_image, tiny_text_config, write_image_tokenizer

from triollm.engine.execution.mrope import mrope_positions, mrope_rows
from triollm.engine.request import ImageFeature

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # one image in a prompt, as vLLM's Qwen2-VL examples
PROMPTS = [
    f"The capital of {IMAGE} is",  # one image
    f"{IMAGE} and {IMAGE}: count one, two, three",  # two images of different sizes, the first at the start
    "def add(a, b): return a + b",  # text only
]
IMAGES = [[random_image(1, (40, 50))], [random_image(2, (64, 32)), random_image(3, (28, 28))], []]
NEW_TOKENS = 16


def make_qwen_vl(path: Path, family: str, seed: int) -> Path:
    import transformers

    eos, (start, end, pad), vocab = write_image_tokenizer(path, VISION_TOKENS)
    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = tiny_text_config(vocab, eos, rope_parameters=mrope)
    ids = {"image_token_id": pad, "vision_start_token_id": start, "vision_end_token_id": end}
    cls: Any
    if family == "qwen2_vl":
        vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 4, "mlp_ratio": 2}
        cfg: Any = transformers.Qwen2VLConfig(
            text_config=text, vision_config={**vision, "patch_size": 4, "spatial_merge_size": 2}, **ids
        )
        cls = transformers.Qwen2VLForConditionalGeneration
    else:
        vision = {
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "out_hidden_size": 64,
            "window_size": 16, "fullatt_block_indexes": [1],
        }  # fmt: skip
        cfg = transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config={**vision, "patch_size": 4, "spatial_merge_size": 2}, **ids
        )
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    model = cls(cfg).to(torch.float32)
    _redraw(model, seed)
    model.save_pretrained(path)
    transformers.Qwen2VLImageProcessor(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8, max_pixels=48 * 48
    ).save_pretrained(path)
    return path


def qwen_ids(path: Path, text: str, grids: list[list[int]]) -> list[int]:
    """The prompt's ids as Qwen2VLProcessor makes them: each `<|image_pad|>` repeated
    grid_t * grid_h * grid_w / 4 times."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    pad = tok.token_to_id("<|image_pad|>")
    sizes = iter(t * h * w // 4 for t, h, w in grids)
    ids: list[int] = []
    for t in tok.encode(text).ids:
        ids += [pad] * next(sizes) if t == pad else [t]
    return ids


def qwen_reference(path: Path, text: str, images: list[Any], **processor_kwargs: Any) -> list[int]:
    """transformers' wrapper, greedy, 16 tokens: the checkpoint's image processor's patches and
    grids, `mm_token_type_ids` marking the image positions (its get_rope_index reads them)."""
    import transformers

    config = json.loads((path / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    kwargs: dict[str, Any] = {}
    grids: list[list[int]] = []
    if images:
        processor = transformers.AutoImageProcessor.from_pretrained(path)
        batch = processor(images=images, return_tensors="pt", **processor_kwargs)
        kwargs = {"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"]}
        grids = batch["image_grid_thw"].tolist()
    ids = qwen_ids(path, text, grids)
    if images:
        kwargs["mm_token_type_ids"] = torch.tensor([[int(t == config["image_token_id"]) for t in ids]])
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
            pad_token_id=0, **kwargs,
        )  # fmt: skip
    return list(out[0, len(ids) :].tolist())


@pytest.fixture(scope="module", params=FAMILIES)
def qwen_vl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Seeds whose greedy tokens vary (no token repeated throughout).
    return make_qwen_vl(
        tmp_path_factory.mktemp(request.param), request.param, seed={"qwen2_vl": 4}.get(request.param, 3)
    )


@pytest.fixture(scope="module")
def references(qwen_vl: Path) -> list[list[int]]:
    return [qwen_reference(qwen_vl, text, images) for text, images in zip(PROMPTS, IMAGES)]


def _prompt(text: str, images: list[Any]) -> dict[str, Any]:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}


def _params() -> Any:
    from triollm import SamplingParams

    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_config_reads_the_qwen2_decoder(qwen_vl: Path) -> None:
    from triollm.engine.loading.model_config import ModelConfig

    cfg = ModelConfig.from_pretrained(qwen_vl, max_model_len=256)
    mm = cfg.multimodal
    assert cfg.architecture == "Qwen2ForCausalLM" and mm is not None and mm.takes_images
    assert (mm.spatial_merge, mm.mrope_section, cfg.num_layers, cfg.head_dim) == (2, (2, 3, 3), 2, 16)
    assert cfg.sliding_window is None and not cfg.tie_word_embeddings


def test_greedy_parity_through_llm(qwen_vl: Path, references: list[list[int]]) -> None:
    """One image, two images of different sizes and text only, batched, in a child process
    (the images' grids cross the wire): transformers' tokens, and the placeholders expanded as
    Qwen2VLProcessor expands them."""
    from triollm import LLM

    with LLM(str(qwen_vl), max_model_len=256, multiprocess=True) as llm:
        outs = llm.generate([_prompt(t, i) for t, i in zip(PROMPTS, IMAGES)], _params(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == references
    assert len(set(references[0])) > 3  # the test model's tokens vary
    assert list(outs[0].prompt_token_ids) == qwen_ids(qwen_vl, PROMPTS[0], [[1, 10, 12]])  # 30 positions
    assert list(outs[1].prompt_token_ids) == qwen_ids(qwen_vl, PROMPTS[1], [[1, 16, 8], [1, 8, 8]])


@pytest.mark.parametrize("budget", [7, 1])
def test_chunked_prefill_cuts_through_images(qwen_vl: Path, references: list[list[int]], budget: int) -> None:
    """A 7-token budget cuts prefill chunks through the images' positions (the decoder attends
    causally over them, so the scheduler may, as for LLaVA); a 1-token budget feeds every prompt
    position as a decode row. Each chunk's M-RoPE positions are a slice of the prompt's."""
    from triollm import LLM

    with LLM(str(qwen_vl), max_model_len=256, max_num_batched_tokens=budget, multiprocess=False) as llm:
        prompts = PROMPTS if budget > 1 else PROMPTS[:1]
        outs = llm.generate([_prompt(t, i) for t, i in zip(prompts, IMAGES)], _params(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == references[: len(prompts)]


def test_m_rope_positions_matter(qwen_vl: Path, references: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """With plain 1-D positions the image prompts give other tokens; text only is unchanged."""
    from triollm import LLM
    from triollm.engine.execution import model_runner

    def plain(table: torch.Tensor, delta: int, start: int, count: int) -> torch.Tensor:
        return torch.arange(start, start + count).expand(3, -1)

    monkeypatch.setattr(model_runner, "mrope_rows", plain)
    with LLM(str(qwen_vl), max_model_len=256, multiprocess=False) as llm:
        outs = llm.generate([_prompt(t, i) for t, i in zip(PROMPTS, IMAGES)], _params(), use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert tokens[0] != references[0] and tokens[1] != references[1] and tokens[2] == references[2]


def test_preempted_requests_recompute_their_positions(qwen_vl: Path, references: list[list[int]]) -> None:
    """Too few KV blocks for the three requests at once: some are preempted and recomputed
    (their outputs fed again at index + delta), with transformers' tokens."""
    from triollm import LLM

    with LLM(
        str(qwen_vl), max_model_len=112, multiprocess=False, block_size=16, num_gpu_blocks_override=8,
        enable_prefix_caching=False,
    ) as llm:  # fmt: skip
        outs = llm.generate([_prompt(t, i) for t, i in zip(PROMPTS, IMAGES)], _params(), use_tqdm=False)
        preemptions = next(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")  # type: ignore[attr-defined]
    assert preemptions > 0
    assert [list(o.outputs[0].token_ids) for o in outs] == references


def test_chat_with_image_parts(qwen_vl: Path) -> None:
    """`LLM.chat`: an `image_url` part and an `image_pil` part render as
    `<|vision_start|><|image_pad|><|vision_end|>` where they stand, as Qwen's template does."""
    from triollm import LLM

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
    with LLM(str(qwen_vl), max_model_len=256, multiprocess=False) as llm:
        [out] = llm.chat(messages, _params(), use_tqdm=False)
        [text] = llm.chat([{"role": "user", "content": "count one, two"}], _params(), use_tqdm=False)
    expected = qwen_reference(qwen_vl, chatml(f"Look:\n{IMAGE}\n{IMAGE}\ncount one, two"), [first, second])
    assert list(out.outputs[0].token_ids) == expected
    assert list(text.outputs[0].token_ids) == qwen_reference(qwen_vl, chatml("count one, two"), [])


def test_mm_processor_kwargs_set_the_pixel_bounds(qwen_vl: Path) -> None:
    """`max_pixels` (vLLM's name) bounds the resize: fewer patches, fewer positions, and the
    tokens of transformers' processor under the same bound; a bad value names the field."""
    from triollm import LLM

    image = random_image(31, (50, 40))
    prompt = {"prompt": PROMPTS[0], "multi_modal_data": {"image": image}}
    with LLM(str(qwen_vl), max_model_len=256, multiprocess=False) as llm:
        [plain] = llm.generate(prompt, _params(), use_tqdm=False)
        [small] = llm.generate({**prompt, "mm_processor_kwargs": {"max_pixels": 16 * 16}}, _params(), use_tqdm=False)
        with pytest.raises(ValueError, match="mm_processor_kwargs.max_pixels: expected a positive integer"):
            llm.generate({**prompt, "mm_processor_kwargs": {"max_pixels": "big"}}, _params())
    bound = {"size": {"shortest_edge": 64, "longest_edge": 16 * 16}}
    assert len(small.prompt_token_ids) < len(plain.prompt_token_ids)
    assert list(small.outputs[0].token_ids) == qwen_reference(qwen_vl, PROMPTS[0], [image], **bound)


def test_repeated_image_is_a_prefix_cache_hit(qwen_vl: Path) -> None:
    """The same image again: its blocks from the prefix cache (keyed by the pixels and the
    grid), the tower not run, the same tokens; another image: a miss."""
    from triollm.engine.config import EngineArgs
    from triollm.engine.sync_engine import SyncEngine

    text = IMAGE + " The quick brown fox jumps over the lazy dog. " * 2
    engine = SyncEngine.from_engine_args(
        EngineArgs(model=str(qwen_vl), max_model_len=256, enable_prefix_caching=True, block_size=8)
    )
    vision = engine.core.executor.runner.vision
    assert vision is not None

    def run(image: Any) -> Any:
        engine.add_request({"prompt": text, "multi_modal_data": {"image": image}}, _params())
        done = []
        while engine.has_unfinished_requests():
            done += [out for out in engine.step() if out.finished]
            engine.core.check_integrity()
        return done[0]

    first = run(random_image(7, (30, 30)))
    assert vision.num_runs == 1 and first.num_cached_tokens == 0
    again = run(random_image(7, (30, 30)))
    assert vision.num_runs == 1 and again.num_cached_tokens >= 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert list(first.outputs[0].token_ids) == qwen_reference(qwen_vl, text, [random_image(7, (30, 30))])
    other = run(random_image(8, (30, 30)))
    assert vision.num_runs == 2 and other.num_cached_tokens == 0


def test_an_image_the_prefix_cache_covers_in_part_is_not_encoded_again(qwen_vl: Path) -> None:
    """A prompt that ends just past its image: the cached blocks stop inside the image, whose
    last positions are fed again from the encoder cache's rows (keyed by the same digest), not by
    running the tower again; the tokens are the first request's."""
    from triollm.engine.config import EngineArgs
    from triollm.engine.sync_engine import SyncEngine

    engine = SyncEngine.from_engine_args(
        EngineArgs(model=str(qwen_vl), max_model_len=256, enable_prefix_caching=True, block_size=8)
    )
    vision = engine.core.executor.runner.vision
    assert vision is not None

    def run(image: Any) -> Any:
        engine.add_request({"prompt": IMAGE + " x", "multi_modal_data": {"image": image}}, _params())
        done = []
        while engine.has_unfinished_requests():
            done += [out for out in engine.step() if out.finished]
        return done[0]

    first = run(random_image(7, (30, 30)))
    again = run(random_image(7, (30, 30)))
    image_end = 1 + 16  # <|vision_start|>, then the image's 16 positions
    assert 0 < again.num_cached_tokens < image_end  # the hit ends inside the image
    assert vision.num_runs == 1
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_the_encoder_cache_is_bounded_in_bytes() -> None:
    from triollm.engine.execution.vision import EncoderCache

    cache = EncoderCache(max_bytes=3 * 64 * 4)  # three images of 4 x 16 fp32 rows
    rows = {d: torch.full((4, 16), float(i)) for i, d in enumerate([b"a", b"b", b"c", b"d"])}
    for d in (b"a", b"b", b"c"):
        cache.put(d, rows[d])
    assert cache.get(b"a") is rows[b"a"]  # now the most recent
    cache.put(b"d", rows[b"d"])  # evicts b, the least recently used
    assert cache.get(b"b") is None and cache.get(b"c") is rows[b"c"] and cache.bytes == 3 * 64 * 4
    cache.put(b"e", torch.zeros(64, 16))  # larger than the whole cache: not kept
    assert cache.get(b"e") is None and cache.bytes == 3 * 64 * 4


# ------------------------------------------------------------------------------ M-RoPE positions


def _feature(offset: int, grid: list[int]) -> ImageFeature:
    return ImageFeature(offset, grid[0] * grid[1] * grid[2] // 4, b"", b"", [], False, grid)


@pytest.mark.parametrize("family", FAMILIES)
def test_mrope_positions_match_get_rope_index(family: str) -> None:
    """Images at the start, in the middle (wide, tall, two frames) and at the end of a text
    sequence: the 3-D positions and the delta are transformers' get_rope_index's; past the
    prompt, index + delta in all three."""
    import transformers

    vision = {"depth": 1, "num_heads": 2, "spatial_merge_size": 2}
    if family == "qwen2_vl":
        cfg: Any = transformers.Qwen2VLConfig(vision_config={**vision, "embed_dim": 8, "hidden_size": 8})
        model: Any = transformers.Qwen2VLModel
    else:
        cfg = transformers.Qwen2_5_VLConfig(vision_config={**vision, "hidden_size": 8, "out_hidden_size": 8})
        model = transformers.Qwen2_5_VLModel
    grids = [[1, 4, 6], [1, 8, 2], [2, 4, 4], [1, 2, 2]]
    texts = [0, 5, 3, 1, 0]  # text tokens before each image and after the last
    features, kinds = [], []
    for n, grid in zip(texts, [*grids, None]):
        kinds += [0] * n
        if grid is not None:
            features.append(_feature(len(kinds), grid))
            kinds += [1] * features[-1].length
    ids = torch.tensor([[9 if k else 5 for k in kinds]])
    expected, deltas = model.get_rope_index(
        type("Fake", (), {"config": cfg, "get_vision_position_ids": model.get_vision_position_ids})(),
        ids, torch.tensor([kinds]), image_grid_thw=torch.tensor(grids),
    )  # fmt: skip
    ours, delta = mrope_positions(len(kinds), features, 2)
    assert torch.equal(ours, expected[:, 0]) and delta == int(deltas[0, 0]) and delta != 0
    p = len(kinds)
    rows = mrope_rows(ours, delta, p - 2, 5)  # the prompt's last two, then three outputs
    assert torch.equal(rows[:, :2], ours[:, p - 2 :])
    assert torch.equal(rows[:, 2:], torch.arange(p, p + 3).expand(3, -1) + delta)
    text_only, zero = mrope_positions(6, [], 2)
    assert zero == 0 and torch.equal(text_only, torch.arange(6).expand(3, -1))


def test_mrope_rotary_rows_match_transformers() -> None:
    """The rotary rows built from 3-D positions are transformers' Qwen2-VL cos / sin (sections
    [2, 3, 3] of 8 half-dims, each rotated by its own component)."""
    import transformers
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    from triollm.engine.execution.layers.rotary import RotaryEmbedding
    from triollm.engine.loading.rope_config import RopeConfig
    from triollm.kernels.rotary import rotary_sign

    text = transformers.Qwen2VLTextConfig(
        hidden_size=64, num_attention_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )  # fmt: skip
    positions = torch.tensor([[0, 1, 4, 4, 4, 4, 9], [0, 1, 4, 4, 5, 5, 9], [0, 1, 4, 5, 4, 5, 9]])
    cos, sin = Qwen2VLRotaryEmbedding(text)(torch.zeros(1, dtype=torch.float32), positions[:, None])
    ours = RotaryEmbedding(RopeConfig(theta=10000.0), 16, 64, mrope_section=(2, 3, 3)).step(
        positions, torch.float32, False
    )
    torch.testing.assert_close(ours.cos[:, 0], cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.sin[:, 0] * rotary_sign(16), sin[0], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"mrope_section: \[2, 3, 2\] must sum to half the rotary dim \(8\)"):
        RotaryEmbedding(RopeConfig(), 16, 64, mrope_section=(2, 3, 2))


def test_shipped_config_splits() -> None:
    """Qwen/Qwen2-VL-2B-Instruct's config.json shape: the text fields at the top level,
    `rope_scaling` {"type": "mrope", "mrope_section": [16, 24, 24]}."""
    from triollm.engine.loading.hf_config import parse_hf_config
    from triollm.engine.loading.multimodal_config import split_multimodal

    shipped = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
        "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 1536, "initializer_range": 0.02,
        "intermediate_size": 8960, "max_position_embeddings": 32768, "max_window_layers": 28,
        "model_type": "qwen2_vl", "num_attention_heads": 12, "num_hidden_layers": 28, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                          "hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vocab_size": 151936,
    }  # fmt: skip
    text, spec = split_multimodal(shipped)
    assert spec is not None and spec.mrope_section == (16, 24, 24) and spec.spatial_merge == 2
    assert (spec.image_token_id, spec.chat_begin_id, spec.chat_end_id) == (151655, 151652, 151653)
    cfg = parse_hf_config(text, "triollm")
    assert (cfg.architecture, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == ("Qwen2ForCausalLM", 28, 2, 128)
    assert cfg.rope.theta == 1e6 and cfg.rope.rope_type == "default" and cfg.sliding_window is None
    assert cfg.tie_word_embeddings
    for bad, match in (
        ({**shipped, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24]}}, "rope_scaling.mrope_section"),
        ({**shipped, "image_token_id": 200000}, "image_token_id: 200000 lies outside the vocabulary"),
        ({**shipped, "text_config": {"model_type": "llama"}}, "text_config.model_type: .* needs 'qwen2_vl_text'"),
    ):
        with pytest.raises(ValueError, match=match):
            split_multimodal(bad)


# ------------------------------------------------------------------------------ /v1/chat/completions


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen_vl(tmp_path_factory.mktemp("qwen2-vl-api"), "qwen2_vl", seed=4)


@pytest.fixture(scope="module")
async def http(qwen2_vl: Path, anyio_backend: str) -> AsyncIterator[httpx.AsyncClient]:
    from triollm.actors.async_llm import AsyncLLM
    from triollm.api.app import build_app
    from triollm.api.state import ServerSettings, ServerState
    from triollm.engine.config import EngineArgs

    async with AsyncLLM.from_engine_args(EngineArgs(model=str(qwen2_vl), max_model_len=256, multiprocess=False)) as llm:
        app = build_app(ServerState(llm, ServerSettings(served_model_names=("qwen2-vl",))))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
            yield c


@pytest.mark.anyio
async def test_chat_completions_with_image_parts(http: httpx.AsyncClient, qwen2_vl: Path) -> None:
    """The official client, one and two images as data URLs: transformers' tokens."""
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
    one, two = random_image(21, (40, 30)), random_image(22, (25, 50))

    def image(im: Any) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": data_url(im)}}

    cases = [
        ([{"type": "text", "text": "What is"}, image(one)], f"What is\n{IMAGE}", [one]),
        ([image(one), {"type": "text", "text": "and"}, image(two)], f"{IMAGE}\nand\n{IMAGE}", [one, two]),
    ]
    for content, rendered, images in cases:
        response = await client.chat.completions.create(
            model="qwen2-vl",
            messages=[{"role": "user", "content": content}],
            max_tokens=NEW_TOKENS,
            temperature=0.0,
            logprobs=True,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        tokens = [int(t.token.removeprefix("token_id:")) for t in response.choices[0].logprobs.content]
        assert tokens == qwen_reference(qwen2_vl, chatml(rendered), images)
        assert response.usage.prompt_tokens > 12 * len(images)  # the placeholders expanded
