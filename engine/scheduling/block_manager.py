"""KV-cache block manager: reference-counted fixed-size blocks, a free list, prefix caching.

Mechanism only; the scheduler decides who gets blocks. Each block holds `block_size` tokens of
one or more requests' KV (shared when a prefix is cached). A block is *free* when no request
references it (ref count 0); free blocks wait in `_free` in LRU order (the least recently freed
first). A free block may still be *cached*: when a block fills up its content hash is registered
in `_cached`, and a later request with the same prefix takes it back from the free list
instead of recomputing those tokens. Allocation takes from the front of the free list and drops
the hash of a cached block it reuses: eviction is simply reuse, in LRU order.

Block hashes chain: sha256(parent's digest + this block's token ids as int64), so equal hashes mean
equal whole prefixes, unless someone finds a sha256 collision. The cache is shared by every client,
so the hash must resist crafted collisions: with Python's `hash` (64 bits, not collision-resistant,
the earlier design) a client could build a prompt whose block hashes equal another tenant's, and be
served, or make others be served, KV computed from different tokens (vLLM moved to sha256 after
CVE-2025-25183). Under a LoRA adapter the chain starts from a root of the adapter's own
(`root_hash`): the same tokens under another adapter are other K/V. The token ids of the new full
blocks are packed once (`array("q")`, native byte order: the hashes never leave the process) and
each block costs one sha256 over 32 + 8 * block_size bytes: a few times what `hash` cost, paid per
block of a prompt and, in decode, once per `block_size` steps (figures: docs/reliability.md). A
request's blocks are freed tail first, so the tail of a prefix is evicted before its head.

Sliding windows (`window`, set only when every layer has one, smaller than max_model_len):
the query at position p reads keys j with p - j < window, and a request's next query is at
position n = num_computed_tokens or later, so its block b (positions [b * bs, (b + 1) * bs)) is
never read again once (b + 1) * bs - 1 <= n - window: the first (n - window + 1) // bs blocks
are dead (`dead_blocks`). `release_out_of_window` drops the request's references to them
(`Request.num_released_blocks` counts them) and puts the unreferenced ones on the free list,
still hashed: their content is what the hash says until the block is reused, so a later prompt
with that prefix may still take them. The ids stay in `request.block_ids`, which the model
runner indexes by position; every kernel skips (native, Triton) or masks (torch) keys outside
the window, and `cache_full_blocks` never looks at a released id again (another request may own
that block by then). Rejected: a ring of `window / bs` blocks per request (the runner's block
tables and the prefix cache both index blocks by position), and releasing in models where some
layer attends to everything (Gemma 2/3, Qwen2 with `max_window_layers`): those read every block.

A hybrid model's recurrent layers keep a fixed-size state per request beside its blocks
(engine/execution/layers/recurrent.py): with `num_state_slots`, `allocate` gives a request one of
the slots with its first block and `free` takes it back with its blocks, so a slot is held
exactly while blocks are (a running request; a preempted one starts over with a fresh slot).

`check_integrity()` re-derives every invariant from scratch; tests and debug loops call it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: this module needs nothing beyond the standard library
    from triollm.engine.scheduling.request_state import Request

__all__ = ["ROOT_BLOCK_HASH", "BlockManager", "BlockManagerStats", "hash_full_blocks", "root_hash"]

ROOT_BLOCK_HASH = hashlib.sha256(b"triollm prefix cache, chained block hashes v1").digest()


def root_hash(request: Request) -> bytes:
    """The parent of a request's first block: ROOT_BLOCK_HASH under the base model; under a LoRA
    adapter, a root of its own (its id and path), so K/V computed under one adapter is never
    reused for another or for the base model."""
    lora = request.lora_request
    if lora is None:
        return ROOT_BLOCK_HASH
    tag = f"lora {lora.lora_int_id} {lora.lora_path}".encode()
    return hashlib.sha256(ROOT_BLOCK_HASH + tag).digest()
_TOKEN_BYTES = array("q").itemsize


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    parent: bytes = ROOT_BLOCK_HASH,
    images: Sequence[tuple[int, int, bytes]] = (),
    start: int = 0,
) -> list[bytes]:
    """The chained sha256 digests of the full blocks of `token_ids`, which follow the block
    whose digest is `parent` (by default: the start of a sequence). `images`: the sequence's
    image spans (first position, end, pixel digest) with `start` the position of token_ids[0];
    a block holding any position of an image hashes its digest too, since every image's
    placeholder ids are the same."""
    num_blocks = len(token_ids) // block_size
    packed = array("q", token_ids[: num_blocks * block_size]).tobytes()
    width = block_size * _TOKEN_BYTES
    digests = []
    for i in range(num_blocks):
        data = packed[i * width : (i + 1) * width]
        if images:
            lo = start + i * block_size
            data += b"".join(digest for first, end, digest in images if first < lo + block_size and end > lo)
        parent = hashlib.sha256(parent + data).digest()
        digests.append(parent)
    return digests


@dataclass(frozen=True)
class BlockManagerStats:
    num_blocks: int
    num_free_blocks: int  # unreferenced blocks, cached or not
    num_cached_blocks: int  # blocks with a registered prefix hash
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which found in the cache
    num_window_released_blocks: int = 0  # block references dropped as they fell out of the window

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        window: int | None = None,
        num_state_slots: int = 0,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be positive, got {num_blocks}")
        if window is not None and window <= 0:
            raise ValueError(f"window: must be a positive number of tokens or None, got {window}")
        self.window = window  # every layer's sliding window; None: blocks are held to the end
        self._released = 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self._queries = 0
        self._hits = 0
        self.num_state_slots = num_state_slots
        self._free_slots = list(range(num_state_slots - 1, -1, -1))  # popped from the end: 0 first

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(request.block_ids))

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def statistics(self) -> BlockManagerStats:
        return BlockManagerStats(
            self.num_blocks, len(self._free), len(self._cached), self._queries, self._hits, self._released
        )

    def dead_blocks(self, num_computed_tokens: int) -> int:
        """How many leading blocks of a request with that many computed tokens no query will
        read again (0 without a window); see the module docstring."""
        if self.window is None:
            return 0
        return max(0, (num_computed_tokens - self.window + 1) // self.block_size)

    # ------------------------------------------------------------------ prefix cache

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend `request.block_hashes` to cover the full blocks among its first num_tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        start = len(hashes) * bs
        if num_tokens - start >= bs:
            parent = hashes[-1] if hashes else root_hash(request)
            hashes += hash_full_blocks(request.all_token_ids[start:num_tokens], bs, parent, request.image_spans, start)

    def match_prefix(self, request: Request) -> int:
        """Give a request with no blocks the longest cached prefix of its tokens. Returns the
        number of tokens covered; at least one token is always left to compute (the step must
        produce logits for the last one)."""
        assert not request.block_ids
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return 0
        limit = request.num_tokens - 1
        self._update_hashes(request, limit)
        hit: list[int] = []
        for h in request.block_hashes[: limit // self.block_size]:
            block = self._cached.get(h)
            if block is None:
                break
            hit.append(block)
        for block in hit:
            self._take(block)
        request.block_ids.extend(hit)
        self._queries += request.num_tokens
        self._hits += len(hit) * self.block_size
        return len(hit) * self.block_size

    def cache_full_blocks(self, request: Request) -> None:
        """Register the blocks that are full of computed tokens under their prefix hashes."""
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return
        self._update_hashes(request, request.num_computed_tokens)
        # Released ids may belong to another request by now: never tag them.
        for i in range(request.num_released_blocks, request.num_computed_tokens // self.block_size):
            block = request.block_ids[i]
            if self._hash[block] is not None:
                continue
            h = request.block_hashes[i]
            if h not in self._cached:  # else an equal block is already cached; keep that one
                self._cached[h] = block
                self._hash[block] = h

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash whose block is free. False if some are still in use."""
        for block in list(self._free):
            self._evict(block)
        return not self._cached

    # ------------------------------------------------------------------ allocation

    def allocate(self, request: Request, num_blocks: int) -> bool:
        """Append num_blocks fresh blocks to the request, or change nothing and return False."""
        if num_blocks > len(self._free):
            return False
        if self.num_state_slots and request.state_slot is None:
            if not self._free_slots:
                return False
            request.state_slot = self._free_slots.pop()
        for _ in range(num_blocks):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref[block] = 1
            request.block_ids.append(block)
        return True

    def release_out_of_window(self, request: Request) -> int:
        """Drop the request's references to its blocks that fell out of the window since the
        last call (head first); returns how many. Call whenever num_computed_tokens grew."""
        start, end = request.num_released_blocks, self.dead_blocks(request.num_computed_tokens)
        if end <= start:
            return 0
        for block in request.block_ids[start:end]:
            self._unref(block)
        request.num_released_blocks = end
        self._released += end - start
        return end - start

    def free(self, request: Request) -> None:
        """Drop the request's references (tail first, so tails are evicted first)."""
        for block in reversed(request.held_block_ids):
            self._unref(block)
        request.block_ids.clear()
        request.block_hashes.clear()
        request.num_released_blocks = 0
        if request.state_slot is not None:
            self._free_slots.append(request.state_slot)
            request.state_slot = None

    def _unref(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._free[block] = None

    def _take(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._free[block]
        self._ref[block] += 1

    def _evict(self, block: int) -> None:
        h = self._hash[block]
        if h is not None:
            del self._cached[h]
            self._hash[block] = None

    # ------------------------------------------------------------------ checking

    def check_integrity(self, live_requests: Iterable[Request] = ()) -> None:
        """Raise AssertionError if any invariant is broken. `live_requests` must be every
        request currently holding blocks."""
        live_requests = list(live_requests)
        refs = [0] * self.num_blocks
        for req in live_requests:
            held = req.held_block_ids
            assert len(set(held)) == len(held), f"{req}: duplicate blocks"
            need = -(-req.num_computed_tokens // self.block_size)
            assert len(req.block_ids) >= need, f"{req}: fewer blocks than computed tokens"
            # Released blocks must be out of reach of every query still to come.
            assert 0 <= req.num_released_blocks <= self.dead_blocks(req.num_computed_tokens), (
                f"{req}: released blocks still inside the window"
            )
            for b in held:
                refs[b] += 1
            hashed = req.all_token_ids[: len(req.block_hashes) * self.block_size]
            assert req.block_hashes == hash_full_blocks(hashed, self.block_size, root_hash(req), req.image_spans), (
                f"{req}: block hashes do not match its tokens"
            )
        assert refs == self._ref, "reference counts do not match the live requests"
        if self.num_state_slots:
            held_slots = [r.state_slot for r in live_requests if r.state_slot is not None]
            assert len(set(held_slots)) == len(held_slots), "two requests hold one state slot"
            assert sorted([*held_slots, *self._free_slots]) == list(range(self.num_state_slots)), (
                "state slots lost or duplicated"
            )
        free = [b for b in range(self.num_blocks) if self._ref[b] == 0]
        assert sorted(self._free) == free, "free list differs from the unreferenced blocks"
        for h, b in self._cached.items():
            tag = self._hash[b]
            assert tag == h, f"block {b}: cached under {h.hex()} but tagged {tag and tag.hex()}"
        tagged = sum(h is not None for h in self._hash)
        assert tagged == len(self._cached), "a block carries a hash missing from the cache"
