"""KV blocks that fell out of every layer's sliding window go back to the block manager.

Units on the block manager and scheduler (the dead-block rule against a brute force, shared
prefixes, a released block reused by another request), then the real engine on tiny
transformers checkpoints: a Mistral whose window is far below max_model_len matches
transformers' greedy tokens under each scheduler regime while it releases blocks, and a Qwen2
with one full-attention layer releases none.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_scheduler import make_request, run_step

from triollm.engine.config import SchedulerConfig
from triollm.engine.scheduling.block_manager import BlockManager
from triollm.engine.scheduling.scheduler import Scheduler


def brute_force_dead(n: int, window: int, block_size: int) -> int:
    """Leading blocks holding no key that any query at a position >= n attends to (a query at
    p reads keys j <= p with p - j < window), by enumerating the queries' keys."""
    read = {j // block_size for p in range(n, n + 2 * window) for j in range(p + 1) if p - j < window}
    dead = 0
    while dead not in read:
        dead += 1
    return dead


def test_dead_blocks_window_8_block_4() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, window=8)
    # n = 11: the next query (position 11) reads keys 4..11, so block 0 (positions 0..3) is dead.
    expected = {0: 0, 7: 0, 10: 0, 11: 1, 14: 1, 15: 2, 18: 2, 19: 3, 23: 4, 40: 8}
    assert {n: bm.dead_blocks(n) for n in expected} == expected
    for window in (1, 3, 4, 6, 8, 13):
        for bs in (1, 4, 8):
            bm = BlockManager(num_blocks=8, block_size=bs, window=window)
            assert [bm.dead_blocks(n) for n in range(60)] == [brute_force_dead(n, window, bs) for n in range(60)]
    assert BlockManager(num_blocks=8, block_size=4).dead_blocks(1000) == 0
    with pytest.raises(ValueError, match="window"):
        BlockManager(num_blocks=8, block_size=4, window=0)


def test_a_shared_prefix_block_lives_until_every_holder_released_it() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, window=8)
    a = make_request("a", list(range(30)))
    assert bm.allocate(a, 2)
    a.num_computed_tokens = 8  # a first chunk of 8
    bm.cache_full_blocks(a)
    assert bm.release_out_of_window(a) == 0
    b = make_request("b", list(range(12)) + [99] * 4)
    b.num_computed_tokens = bm.match_prefix(b)  # a's two blocks
    assert b.num_computed_tokens == 8 and b.block_ids == a.block_ids
    assert bm.release_out_of_window(b) == 0
    assert bm.allocate(a, 2)
    a.num_computed_tokens = 16
    bm.cache_full_blocks(a)
    assert bm.release_out_of_window(a) == 2  # a drops its references to blocks 0 and 1 ...
    bm.check_integrity([a, b])
    assert bm.num_free_blocks == 10 - 4  # ... which b still holds
    assert bm.allocate(b, 2)
    b.num_computed_tokens = 16
    bm.cache_full_blocks(b)
    assert bm.release_out_of_window(b) == 2
    bm.check_integrity([a, b])
    assert bm.num_free_blocks == 10 - 2 - 2  # a's and b's last two blocks each
    # Released blocks stay cached: a new prompt with that prefix takes them back.
    c = make_request("c", list(range(9)))
    assert bm.match_prefix(c) == 8
    bm.check_integrity([a, b, c])
    for r in (a, b, c):
        bm.free(r)
        assert r.num_released_blocks == 0 and not r.block_ids
    bm.check_integrity([])
    assert bm.num_free_blocks == 10
    assert bm.statistics().num_window_released_blocks == 4


def test_a_released_block_another_request_reused_is_never_cached_again() -> None:
    bm = BlockManager(num_blocks=4, block_size=4, window=4)
    a = make_request("a", list(range(8)) + [50])
    assert bm.allocate(a, 2)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    assert bm.release_out_of_window(a) == 1  # block 0 is free, and still cached
    assert bm.reset_prefix_cache() is False  # forgets block 0's hash; block 1 is a's
    b = make_request("b", [7] * 12)
    assert bm.allocate(b, 3) and a.block_ids[0] in b.block_ids  # b writes its own tokens there
    bm.cache_full_blocks(a)  # a's next step: must not tag block 0 with a's prefix again
    bm.check_integrity([a, b])
    assert bm.match_prefix(make_request("c", list(range(8)) + [60])) == 0


def test_scheduler_releases_as_requests_move_and_frees_only_what_they_hold() -> None:
    # Without the window the request needs 7 blocks of 4 (25 positions); with it, at most 2.
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=True, window=4)
    sched = Scheduler(SchedulerConfig(4, 16, True), bm, max_model_len=64)
    req = make_request("r", [1, 2, 3, 4, 5, 6], max_tokens=20)
    sched.add_request(req)
    for _ in range(30):
        run_step(sched, lambda r: 7)
        bm.check_integrity(sched.live_requests())
        assert len(req.held_block_ids) <= 2
        if not sched.has_unfinished_requests():
            break
    assert len(req.output_token_ids) == 20 and sched.num_preemptions == 0
    assert bm.num_free_blocks == 3
    # 25 tokens computed (the last sampled one is never fed): 7 blocks, the first (25 - 3) // 4 released.
    assert len(req.block_ids) == 0 and bm.statistics().num_window_released_blocks == 5


# ------------------------------------------------------------------------------ real engine

WINDOW = 8
BLOCK = 8


def window_prompts() -> list[list[int]]:
    from test_parity import tiny_prompts

    return tiny_prompts()


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tinymodel import make_transformers_model

    return make_transformers_model(
        tmp_path_factory.mktemp("mistral-window"),
        "MistralForCausalLM",
        seed=21,
        sliding_window=WINDOW,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


@pytest.fixture(scope="module")
def mistral_reference(mistral_dir: Path) -> list[tuple[list[int], list[float]]]:
    from test_parity import hf_greedy

    return hf_greedy(mistral_dir, window_prompts())


@pytest.mark.parametrize(
    "regime, overrides",
    [
        ("plain", {}),
        ("chunked", {}),  # a 16-token budget: prompts in chunks, released chunk by chunk
        ("prefix", {}),  # the second wave takes cached blocks, some released by the first
        # 10 blocks (the fewest add_request allows: 43 + 31 positions) and chunks of 16 tokens.
        ("preempt", {"num_gpu_blocks_override": 10, "max_num_batched_tokens": 16}),
    ],
)
def test_mistral_window_greedy_parity_while_releasing(
    mistral_dir: Path, mistral_reference, regime: str, overrides: dict
) -> None:
    from test_parity import NEW_TOKENS, assert_parity, engine_greedy

    # engine_greedy checks integrity every step and that every block is free at the end.
    prompts = window_prompts()
    ours, core = engine_greedy(mistral_dir, prompts, regime, block_size=BLOCK, **overrides)
    assert_parity(ours, mistral_reference)
    assert core.block_manager.window == WINDOW
    # Each request ends with len(prompt) + 31 tokens computed, all blocks before the last
    # window released (52 of 70 here); prefix hits and recomputes release more.
    final = sum((len(p) + NEW_TOKENS - 1 - WINDOW + 1) // BLOCK for p in prompts)
    released = core.statistics().num_window_released_blocks
    assert released == final if regime == "plain" else released >= final
    stats = core.statistics()
    if regime == "prefix":
        assert stats.prefix_cache_hit_rate > 0.2
    if regime == "preempt":
        assert stats.num_preemptions > 0


def test_a_model_with_a_full_attention_layer_keeps_every_block(tmp_path: Path) -> None:
    from test_parity import assert_parity, engine_greedy, hf_greedy
    from tinymodel import make_transformers_model

    path = make_transformers_model(
        tmp_path / "qwen2-mixed",
        "Qwen2ForCausalLM",
        seed=22,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,  # layer 0 attends to everything, layer 1 to a window
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    prompts = window_prompts()[:4]
    ours, core = engine_greedy(path, prompts, "chunked", block_size=BLOCK)
    assert_parity(ours, hf_greedy(path, prompts))
    assert core.config.model.layer_types == ("full_attention", "sliding_attention")
    assert core.block_manager.window is None
    assert core.block_manager.statistics().num_window_released_blocks == 0
