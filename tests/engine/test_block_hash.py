"""Prefix-cache block hashes: chained sha256 of the token ids, not Python's `hash`."""

from __future__ import annotations

import hashlib
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from triollm.engine.request import EngineCoreRequest
from triollm.engine.sampling_params import SamplingParams
from triollm.engine.scheduling import block_manager
from triollm.engine.scheduling.block_manager import ROOT_BLOCK_HASH, BlockManager, hash_full_blocks
from triollm.engine.scheduling.request_state import Request

BS = 4


def make_request(rid: str, prompt: list[int]) -> Request:
    return Request(EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=4)), 4)


def reference(tokens: list[int], block_size: int) -> list[bytes]:
    digests, parent = [], ROOT_BLOCK_HASH
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        parent = hashlib.sha256(parent + struct.pack(f"={block_size}q", *block)).digest()
        digests.append(parent)
    return digests


def cache(bm: BlockManager, prompt: list[int], rid: str = "a") -> Request:
    """Run a prompt through the cache: match, allocate, compute, register its full blocks."""
    req = make_request(rid, prompt)
    req.num_computed_tokens = bm.match_prefix(req)
    assert bm.allocate(req, bm.blocks_needed(req, req.num_tokens - req.num_computed_tokens))
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)
    return req


def test_block_hashes_are_chained_sha256_of_the_token_ids() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = [5, 150_000, 0, 7, 2**31 + 3, 1, 1, 1, 9, 9]
    req = cache(bm, prompt)
    assert req.block_hashes == reference(prompt, BS)
    assert all(len(h) == 32 for h in req.block_hashes)
    assert set(bm._cached) == set(req.block_hashes)
    bm.check_integrity([req])
    req.block_hashes[1] = hashlib.sha256(b"forged").digest()
    with pytest.raises(AssertionError, match="block hashes"):
        bm.check_integrity([req])


def test_equal_prefixes_hit_and_a_changed_block_ends_the_hit() -> None:
    bm = BlockManager(num_blocks=32, block_size=BS)
    first = list(range(1, 17))  # four full blocks
    bm.free(cache(bm, first + [99]))
    same = make_request("same", first + [42, 43])
    assert bm.match_prefix(same) == 16
    bm.check_integrity([same])
    changed = make_request("changed", first[:8] + [0] + first[9:] + [1])  # third block differs
    assert bm.match_prefix(changed) == 8
    # The same third and fourth blocks after a different first block: the chain misses them.
    other_start = make_request("other", [0] * 4 + first[4:] + [1])
    assert bm.match_prefix(other_start) == 0
    bm.check_integrity([same, changed, other_start])


def test_distinct_blocks_never_share_a_key() -> None:
    """Many random prompts over a tiny vocabulary (so blocks and prefixes repeat a lot): a key
    always stands for one (parent key, block tokens) pair."""
    rng = random.Random(0)
    seen: dict[bytes, tuple[bytes, tuple[int, ...]]] = {}
    for _ in range(3_000):
        prompt = [rng.randrange(3) for _ in range(BS * rng.randint(1, 6))]
        parent = ROOT_BLOCK_HASH
        for i, key in enumerate(hash_full_blocks(prompt, BS)):
            content = (parent, tuple(prompt[i * BS : (i + 1) * BS]))
            assert seen.setdefault(key, content) == content
            parent = key
    assert len(seen) > 5_000
    # Python's hash is the weak one: -1 and -2 hash alike; sha256 keeps them apart.
    assert hash_full_blocks([-1], 1) != hash_full_blocks([-2], 1)


def test_the_hash_does_not_depend_on_pythonhashseed() -> None:
    """Each seed's process loads the module from its file (it needs only the standard library),
    so the check costs two bare interpreter starts."""
    script = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('bm', sys.argv[1])\n"
        "bm = sys.modules['bm'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(bm)\n"
        "print(bm.hash_full_blocks(list(range(64)), 16)[-1].hex())\n"
    )
    path = str(Path(block_manager.__file__))
    digests = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-S", "-c", script, path],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        digests.add(out.stdout.strip())
    assert digests == {hash_full_blocks(list(range(64)), 16)[-1].hex()}
