"""Which part of the model each tensor-parallel rank holds (vLLM's Megatron scheme).

- Attention is split by heads: rank r holds query heads [r*h/N, (r+1)*h/N) and the KV heads
  those query heads read. With N <= num_kv_heads each rank holds num_kv_heads/N KV heads; with
  N > num_kv_heads (N a multiple of it) each rank holds the one KV head of its query group,
  replicated on N/num_kv_heads ranks. QKV and gate/up are column-parallel (output rows split),
  o_proj and down_proj row-parallel (input columns split, one all-reduce after each).
- The vocabulary is split in slices of ceil(V/N) rows (the last one may be shorter), for both
  the embedding (each rank looks up its ids, zeros for the others, then an all-reduce) and the
  lm_head (each rank computes its slice of the logits, rank 0 gathers them).

Pure arithmetic: nothing here imports torch.distributed, so the single-rank path pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TPShard", "check_tensor_parallel"]


def check_tensor_parallel(size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """Raise ValueError naming `tensor_parallel_size` unless the model splits evenly over `size`."""
    if num_heads % size:
        raise ValueError(
            f"tensor_parallel_size: {size} does not divide the model's {num_heads} attention heads "
            f"(allowed: a divisor of {num_heads})"
        )
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size: {size} must divide the model's {num_kv_heads} KV heads or be a "
            f"multiple of them (the model has {num_heads} attention heads)"
        )
    if intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size: {size} does not divide the model's intermediate_size "
            f"({intermediate_size})"
        )


@dataclass(frozen=True)
class TPShard:
    rank: int
    size: int

    def split(self, n: int) -> tuple[int, int]:
        """(start, count) of this rank's share of `n` evenly split items."""
        per = n // self.size
        return self.rank * per, per

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank's query heads read."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads)
        return self.rank // (self.size // num_kv_heads), 1

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """[start, stop) of this rank's vocabulary slice."""
        per = self.vocab_slice(vocab_size)
        start = min(self.rank * per, vocab_size)
        return start, min(start + per, vocab_size)

    def vocab_slice(self, vocab_size: int) -> int:
        """The length of a full vocabulary slice (every rank's logits are padded to it)."""
        return -(-vocab_size // self.size)
