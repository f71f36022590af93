"""The collectives a sharded model runs in its forward pass, over the default gloo group.

Every rank calls the same ones in the same order: one all-reduce after each row-parallel
layer (o_proj, down_proj) and after the vocab-parallel embedding, one gather of the logits
slices to rank 0 per `compute_logits`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from triollm.engine.distributed.sharding import TPShard

__all__ = ["Collectives"]


class Collectives:
    def __init__(self, shard: TPShard, vocab_size: int) -> None:
        self.shard = shard
        self.vocab_size = vocab_size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def embed(self, weight: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: this rank's rows, zeros for ids outside its slice, summed."""
        start, stop = self.shard.vocab(self.vocab_size)
        local = input_ids - start
        outside = (local < 0) | (local >= stop - start)
        x = F.embedding(local.masked_fill(outside, 0), weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.all_reduce(x)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """The full `[n, vocab]` logits on rank 0 from each rank's slice; elsewhere the padded
        slice (sent, not used)."""
        per = self.shard.vocab_slice(self.vocab_size)
        local = local.contiguous()
        if local.shape[-1] < per:  # the last slice is short: pad to the common size
            local = F.pad(local, (0, per - local.shape[-1]))
        if self.shard.rank != 0:
            dist.gather(local, None, dst=0)
            return local
        parts = [torch.empty_like(local) for _ in range(self.shard.size)]
        dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]
