"""The model runner: turns a scheduler decision into one forward pass and sampled tokens.

It flattens the scheduled requests into one token batch (decodes first, then prefill chunks),
computes where each token's K/V goes (`slot = block_id * block_size + offset`), runs the model,
computes logits only where needed (the last token of each sampling request, plus every prompt
position of requests that asked for prompt logprobs) and calls the sampler.

Decodes are ordered longest context first, so the decode attention plan (built here once per
step, shared by every layer) can cut them into groups of similar length; the order of rows is
the runner's business, results are keyed by request id.

Tensor parallel (docs/scaling.md): rank 0's runner has a `group` and sends each step's inputs
(`StepInputs`, plain ints) to the other ranks before its forward pass; they rebuild the same
tensors and attention metadata (`follow`), run the same forward pass and the same logits
computations (whose rows rank 0 lists in `logit_rows`), and rank 0 samples.

Images (a vision-language model, engine/execution/vision.py): a prefill chunk that touches an
image's placeholder positions feeds the image's features there instead of token embeddings.
All of an image's features are computed at the first chunk that touches it (one tower call for
every image the step needs, equal pixels once; rows of images encoded lately are taken from the
runner's `EncoderCache` instead, by content digest) and kept on the request until the chunk that
feeds its last position, so chunked prefill may cut through an image anywhere, except where
the image's positions attend to each other both ways (Gemma 3: the scheduler keeps such an image
in one chunk, and its span goes on the prefill plan for the attention mask).

M-RoPE (Qwen2-VL, Qwen2.5-VL; engine/execution/mrope.py): a step that feeds any request with
images rotates by 3-D positions (`AttentionMetadata.mrope_positions`, one column per row, in the
batch's row order): the request's prompt positions, built once from its images' grids and kept
on the request with its delta, and index + delta past the prompt. A chunk is a slice of them, so
chunked prefill may cut through an image as for LLaVA (the decoder attends causally over image
positions), and a recomputed request reads the same table. Such a step never replays a CUDA
graph (the graphs rotate by the plain positions). Steps without images pass no 3-D positions:
three equal components are plain RoPE.

LoRA (lora/): with a `LoRAManager`, the core has put every scheduled adapter in a slot before
`execute`; the runner lists each adapted request's rows by slot (`StepInputs.lora_segments`,
which the other ranks receive too, with any slots just filled) and sets the model's
`LoRABatch` from them every step. A step with adapter rows never replays a CUDA graph (the
graphs hold the base model only).

Batch invariance (`VLLM_BATCH_INVARIANT=1`, read once here when the runner is built;
kernels/batch_invariant.py): every token of a step becomes a decode row of one native decode
plan (`plan_rows`), so the whole step takes the model's all-decode path, unless every attention
layer takes the native prefill kernel, whose prompt rows have the decode kernel's bits already
(then prompts stay prompts, and no row re-reads its blocks); dense linear layers and a dense
lm_head run over fixed row tiles. What cannot be made invariant is refused here, at
engine start, naming the variable.

Large steps on AMX: where the CPU has AMX bf16 tiles (kernels/quant.py `tiles_available`), a
quantized model's linears take the bf16 tile kernel for inputs of `TILE_MIN_ROWS` rows or more
(decodes and prompt chunks alike: the runner sets the layers' `tiles`, the native decode stack
follows them), and a step whose prompt chunks hold `LARGE_PROMPT_ROWS` tokens or more attends over
them in bf16 through torch's fused attention (`AttentionMetadata.bf16_prefill`), for a dense model
as for a quantized one. Neither under batch invariance, which keeps every row on one kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from triollm.engine import envs
from triollm.engine.distributed.protocol import StepInputs
from triollm.engine.execution.cuda_graphs import DecodeGraphs
from triollm.engine.execution.layers.attention import AttentionMetadata, PagedAttention, PrefillChunk
from triollm.engine.execution.layers.linear import Linear
from triollm.engine.execution.layers.moe import FusedMoE
from triollm.engine.execution.layers.quantized import QuantEmbedding, QuantLinear
from triollm.engine.execution.layers.recurrent import StatePool, StateRows
from triollm.engine.execution.models.base import CausalLM
from triollm.engine.execution.mrope import mrope_positions, mrope_rows
from triollm.engine.execution.sampler import Sampler, SamplingRow, gather_logprobs
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.request import Logprobs, RunnerOutput
from triollm.engine.scheduling.request_state import Request
from triollm.engine.scheduling.scheduler import ScheduledRequest
from triollm.kernels import KVCache, batch_invariant, cpu_native
from triollm.kernels.attention import DecodeWorkspace, plan_decode, plan_prefill
from triollm.kernels.quant import tiles_available

# Prompt-chunk tokens from which a step's chunks attend in bf16 on AMX (module note), the size it
# was measured to pay at (docs/benchmarks.md "AMX Xeon"); smaller steps keep the native kernel.
LARGE_PROMPT_ROWS = 128

if TYPE_CHECKING:
    from triollm.engine.distributed.group import TensorParallelGroup
    from triollm.engine.execution.vision import EncoderCache, VisionEncoder
    from triollm.lora.manager import LoRAManager

__all__ = ["ModelRunner", "RunnerOutput"]


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        device: torch.device | str,
        group: TensorParallelGroup | None = None,
        graphs: DecodeGraphs | None = None,
        lora: LoRAManager | None = None,
        vision: VisionEncoder | None = None,
        states: StatePool | None = None,
    ) -> None:
        self.model = model
        self.states = states  # a hybrid model's recurrent-layer states, by the requests' slots
        self.vision = vision  # a vision-language model's tower and projector
        self.encoder_cache: EncoderCache | None = None  # its recent images' rows
        if vision is not None:
            from triollm.engine.execution.vision import EncoderCache

            self.encoder_cache = EncoderCache()
        self.lora = lora  # the adapters' slots (rank 0: filled by the core before each step)
        self.group = group  # rank 0 of a tensor-parallel model: the other ranks follow each step
        self.graphs = graphs  # all-decode steps replayed from captured graphs (CUDA)
        self.kv = kv_cache
        self.device = torch.device(device)
        self.sampler = Sampler()
        self.block_size = kv_cache.block_size
        self.decode_workspace = DecodeWorkspace()  # gather buffers, kept across steps
        if self.device.type == "cpu":
            cpu_native.available()  # build or load the native kernels now, not in the first step
        self.batch_invariant = envs.batch_invariant()
        cfg = getattr(model, "cfg", None)
        mm = cfg.multimodal if isinstance(cfg, ModelConfig) else None
        # An M-RoPE model's spatial merge (its images' grids over merge**2 are their positions); 0: none.
        self.mrope_merge = mm.spatial_merge if mm is not None and mm.mrope_section else 0
        self._tile_logits = False  # a dense lm_head: compute_logits over fixed row tiles
        self._prompt_rows_native = False  # batch invariance without decode rows (module note)
        if self.batch_invariant:
            self._make_batch_invariant()
        # Large steps on AMX (module note): a quantized model's large inputs on the bf16 tiles,
        # and the prompt chunks of a large prompt step attended in bf16.
        self.large_prompt_steps = (
            self.device.type == "cpu"
            and not self.batch_invariant
            and isinstance(model, torch.nn.Module)
            and tiles_available()
        )
        self.tiles = False
        if self.large_prompt_steps:
            for m in model.modules():
                if isinstance(m, (QuantLinear, QuantEmbedding)):
                    m.tiles = self.tiles = True

    def _make_batch_invariant(self) -> None:
        """Refuse what cannot be batch-invariant, else tile the dense linear layers (module note)."""
        env = envs.BATCH_INVARIANT_ENV
        why = batch_invariant.unsupported(self.device)
        if why is None and self.lora is not None:
            why = "LoRA adapters are not (their updates switch from loops to BLAS above 16 rows)"
        from triollm.engine.execution.models.transformers_backend import TransformersForCausalLM

        if why is None and isinstance(self.model, TransformersForCausalLM):
            why = "the Transformers modeling backend is not (transformers' own layers pick their GEMM by row count)"
        if why is None and any(isinstance(m, FusedMoE) for m in self.model.modules()):
            why = "MoE layers are not (an expert's GEMM has as many rows as tokens routed to it)"
        if why is not None:
            raise ValueError(f"{env}=1: {why}; unset {env} to run without batch invariance")
        for m in self.model.modules():
            if isinstance(m, Linear):
                m.tile_rows = batch_invariant.TILE_ROWS
        head = self.model.lm_head
        self._tile_logits = not isinstance(head, QuantLinear) and not (
            head is None and isinstance(self.model.embed_tokens, QuantEmbedding)
        )
        self._prompt_rows_native = self._native_prompt_rows()

    def _native_prompt_rows(self) -> bool:
        """Whether every attention layer runs a prompt through the native prefill kernel (plain
        causal attention over a cache it takes: kernels/attention.py), so that prompt rows need
        not become decode rows for batch invariance. Not for models with images or recurrent
        state, nor any attention the kernel does not take (windows, sinks, soft-caps, chunks)."""
        cfg = getattr(self.model, "cfg", None)
        if self.vision is not None or self.states is not None or not isinstance(cfg, ModelConfig):
            return False
        layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        # One plain PagedAttention per cache layer (a family with its own attention, e.g. a latent
        # cache, keeps the decode rows).
        if len(layers) != len(self.kv.k) or any(type(m) is not PagedAttention for m in layers):
            return False
        return all(m.prefill_kernel_takes(cfg.dtype, self.kv.k[i]) for i, m in enumerate(layers))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`compute_logits`, over fixed row tiles under batch invariance with a dense head."""
        if self._tile_logits:
            return batch_invariant.tiled_rows(self.model.compute_logits, hidden)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> RunnerOutput:
        # A decode with drafts feeds its token and the drafts as decode rows of their own, each
        # attending to the rows before it (the K/V of every row is written before any attends).
        decodes = [s for s in scheduled if s.num_new_tokens - s.num_draft == 1]
        decodes.sort(key=lambda s: s.num_computed_tokens, reverse=True)
        prefills = [s for s in scheduled if s.num_new_tokens - s.num_draft > 1]
        order = decodes + prefills
        # Flat index of each request's last fed token.
        ends: list[int] = []
        total = 0
        for s in order:
            total += s.num_new_tokens
            ends.append(total - 1)
        samplers = [i for i, s in enumerate(order) if s.samples]
        inputs = self._gather(decodes, prefills)
        lora = self.lora
        if lora is not None:
            inputs.lora_segments = self._lora_segments(order)
            lora.set_batch(inputs.lora_segments)
        if self.group is not None:
            inputs.logit_rows = _logit_rows(order, ends, samplers)
            if lora is not None:
                inputs.lora_loads = lora.take_loads()
            self.group.send_step(inputs)
        graphs = self.graphs
        rows = len(inputs.decode_lens)
        # A one-token prompt chunk runs as a decode row: it may still feed an image position.
        image_decodes = self.vision is not None and _feeds_images(decodes)
        mrope = self.mrope_merge > 0 and any(s.request.images for s in order)
        if mrope and any(s.request.images for s in decodes):
            image_decodes = True  # their positions are M-RoPE's (module note): no graph replay
        if (
            graphs is not None and not prefills and not inputs.lora_segments and not image_decodes
            and graphs.size_for(rows) is not None
        ):  # fmt: skip
            hidden = graphs.run(
                inputs.token_ids, inputs.positions, inputs.slots, inputs.decode_tables, inputs.decode_lens
            )
        else:
            input_ids, positions, meta = self._tensors(inputs)
            if mrope:
                meta.mrope_positions = self._mrope_positions(order).to(self.device)
            if self.states is not None:
                meta.state_rows = self._state_rows(decodes, prefills)
            images = None
            if self.vision is not None and (prefills or image_decodes):
                images = self._image_rows(order)
                _bidirectional_spans(meta, prefills)
            meta.bf16_prefill = self._large_prompt_step(inputs)
            if images is None:  # text only: the model's plain call (any CausalLM, fakes included)
                hidden = self.model(input_ids, positions, meta, self.kv)
            else:
                hidden = self.model(input_ids, positions, meta, self.kv, images)

        out = RunnerOutput({}, {}, {})
        if samplers:
            self._sample(hidden, order, ends, samplers, out)
        for i, s in enumerate(order):
            k = s.request.sampling_params.prompt_logprobs
            if k is not None:
                rows_lp = self._prompt_logprobs(hidden, ends[i] - s.num_new_tokens + 1, s, k)
                if rows_lp is not None:
                    out.prompt_logprobs[s.request.request_id] = rows_lp
        return out

    def _sample(
        self,
        hidden: torch.Tensor,
        order: list[ScheduledRequest],
        ends: list[int],
        samplers: list[int],
        out: RunnerOutput,
    ) -> None:
        """Sample every sampling request's token, or check its drafts (one row per fed token:
        row j sees the drafts before it as output, for penalties and bad words)."""
        idx: list[int] = []
        rows: list[SamplingRow] = []
        drafts: list[int] = []
        for i in samplers:
            s = order[i]
            d, draft = s.num_draft, s.draft_token_ids
            idx.extend(range(ends[i] - d, ends[i] + 1))
            rows.extend(_sampling_row(s, draft[:j]) for j in range(d + 1))
            drafts.extend(draft)
            drafts.append(-1)
        logits = self._logits(hidden.index_select(0, torch.tensor(idx, device=self.device)))
        result = self.sampler(logits, rows, drafts if len(drafts) > len(samplers) else None)
        lp, first = result.logprobs, 0
        for i in samplers:
            s = order[i]
            rid, d = s.request.request_id, s.num_draft
            n = 0  # drafts accepted: a prefix
            while n < d and result.accepted is not None and result.accepted[first + n]:
                n += 1
            out.sampled[rid] = result.token_ids[first]
            if d:
                out.spec_tokens[rid] = result.token_ids[first : first + n + 1]
            if lp is not None and s.request.sampling_params.logprobs is not None:
                span = slice(first, first + n + 1)
                out.logprobs[rid] = Logprobs(lp.token_ids[span], lp.logprobs[span], lp.ranks[span])
            first += d + 1

    def _image_rows(self, order: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat rows, features) of the image positions this step's requests (`order`: the
        batch's, decodes first) feed (module note)."""
        assert self.vision is not None
        need: dict[bytes, list[tuple[Request, int]]] = {}
        for s in order:
            req, c, n = s.request, s.num_computed_tokens, s.num_new_tokens
            for j, (first, end, digest) in enumerate(req.image_spans):
                if first < c + n and end > c and j not in req.image_features:
                    need.setdefault(digest, []).append((req, j))
        cache = self.encoder_cache
        assert cache is not None
        for digest in list(need):
            if (cached := cache.get(digest)) is not None:
                for req, j in need.pop(digest):
                    req.image_features[j] = cached
        if need:
            owners = list(need.items())
            features = self.vision.encode([req.images[j] for _, ((req, j), *_) in owners])
            for (digest, users), rows in zip(owners, features):
                cache.put(digest, rows)
                for req, j in users:
                    req.image_features[j] = rows
        rows_at: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        row = 0
        for s in order:
            req, c, n = s.request, s.num_computed_tokens, s.num_new_tokens
            for j, (first, end, _) in enumerate(req.image_spans):
                lo, hi = max(first, c), min(end, c + n)
                if lo >= hi:
                    continue
                rows_at.append(torch.arange(row + lo - c, row + hi - c))
                values.append(req.image_features[j][lo - first : hi - first])
                if hi == end:  # its last position: the features are done with
                    del req.image_features[j]
            row += n
        if not rows_at:
            return None
        return torch.cat(rows_at).to(self.device), torch.cat(values)

    def _mrope_positions(self, order: list[ScheduledRequest]) -> torch.Tensor:
        """`[3, rows]`: each request's rows' M-RoPE positions, in batch order (module note)."""
        columns: list[torch.Tensor] = []
        for s in order:
            req, c, n = s.request, s.num_computed_tokens, s.num_new_tokens
            if not req.images:
                columns.append(torch.arange(c, c + n).expand(3, -1))
                continue
            if req.mrope is None:
                req.mrope = mrope_positions(req.num_prompt_tokens, req.images, self.mrope_merge)
            columns.append(mrope_rows(*req.mrope, c, n))
        return torch.cat(columns, dim=1)

    @torch.inference_mode()
    def follow(self, inputs: StepInputs) -> None:
        """A tensor-parallel worker's step: rank 0's forward pass and logits computations on
        this rank's shard (the collectives inside them pair with rank 0's)."""
        if inputs.lora_loads:
            if self.lora is None:
                from triollm.lora.manager import LoRAManager

                self.lora = LoRAManager.from_loads(self.model, inputs.lora_loads, self.device)
            else:
                self.lora.apply_loads(inputs.lora_loads)
        if self.lora is not None:
            self.lora.set_batch(inputs.lora_segments)
        input_ids, positions, meta = self._tensors(inputs)
        meta.bf16_prefill = self._large_prompt_step(inputs)
        hidden = self.model(input_ids, positions, meta, self.kv)
        for rows in inputs.logit_rows:
            self._logits(hidden.index_select(0, torch.tensor(rows, device=self.device)))

    @torch.inference_mode()
    def last_hidden(self, feeds: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """The hidden state of each feed's last token, in feed order: a feed is (token ids, the
        position of the first, the sequence's block ids). The draft model's passes
        (engine/speculative/draft.py) run through this, on the draft's own KV cache; one-token
        feeds are decode rows (placed first, as `execute` does), longer ones prefill chunks."""
        bs = self.block_size
        order = sorted(range(len(feeds)), key=lambda i: len(feeds[i][0]) > 1)
        inputs = StepInputs()
        ends: list[int] = [0] * len(feeds)
        for i in order:
            ids, start, blocks = feeds[i]
            if len(ids) == 1:
                _add_decode_row(inputs, ids[0], start, blocks, bs)
            else:
                _add_prefill(inputs, ids, start, blocks, bs)
            ends[i] = len(inputs.token_ids) - 1
        input_ids, positions, meta = self._tensors(inputs)
        hidden = self.model(input_ids, positions, meta, self.kv)
        return hidden.index_select(0, torch.tensor(ends, device=self.device))

    def _state_rows(self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest]) -> StateRows:
        """Each request's rows and state slot (decode rows first, as `_gather` lays them out);
        the slots of requests that start at position 0 are zeroed first (layers/recurrent.py)."""
        assert self.states is not None
        slots: list[int] = []
        fresh: list[int] = []
        for s in (*decodes, *prefills):
            slot = s.request.state_slot
            if slot is None:
                raise RuntimeError(f"request {s.request.request_id!r} runs without a recurrent-state slot")
            slots.append(slot)
            if s.num_computed_tokens == 0:
                fresh.append(slot)
        self.states.reset(fresh)
        d = len(decodes)
        chunks, row = [], d
        for s, slot in zip(prefills, slots[d:], strict=True):
            chunks.append((row, s.num_new_tokens, slot))
            row += s.num_new_tokens
        decode_slots = torch.tensor(slots[:d], dtype=torch.long, device=self.device)
        return StateRows(decode_slots, chunks, self.states)

    def _lora_segments(self, order: list[ScheduledRequest]) -> list[tuple[int, int, int]]:
        """(slot, first row, rows) of each request fed under an adapter, in batch order."""
        assert self.lora is not None
        slot_of, row = self.lora.slot_of, 0
        out: list[tuple[int, int, int]] = []
        for s in order:
            lr = s.request.lora_request
            if lr is not None:
                out.append((slot_of[lr.lora_int_id], row, s.num_new_tokens))
            row += s.num_new_tokens
        return out

    def _gather(self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest]) -> StepInputs:
        bs = self.block_size
        inputs = StepInputs()
        for s in decodes:
            req, c = s.request, s.num_computed_tokens
            _add_decode_row(inputs, req.all_token_ids[c], c, req.block_ids, bs)
            for j, token in enumerate(s.draft_token_ids[: s.num_draft], 1):  # then its drafts
                _add_decode_row(inputs, token, c + j, req.block_ids, bs)
        for s in prefills:
            req, c, n = s.request, s.num_computed_tokens, s.num_new_tokens
            _add_prefill(inputs, req.all_token_ids[c : c + n], c, req.block_ids, bs)
        return inputs

    def _large_prompt_step(self, inputs: StepInputs) -> bool:
        """Whether this step's prompt chunks attend in bf16 (module note): they hold at least
        `LARGE_PROMPT_ROWS` tokens, where the CPU allows it."""
        return self.large_prompt_steps and len(inputs.token_ids) - len(inputs.decode_lens) >= LARGE_PROMPT_ROWS

    def _tensors(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decodes=len(inputs.decode_lens))
        if self.batch_invariant and inputs.prefills and not self._prompt_rows_native:
            # Every token a decode row: the step takes the all-decode path (module note).
            meta.num_decodes = len(inputs.token_ids)
            meta.decode_plan = batch_invariant.plan_rows(
                inputs.decode_tables, inputs.decode_lens, inputs.prefills, dev, self.decode_workspace
            )
        elif inputs.decode_lens:
            meta.decode_plan = plan_decode(
                inputs.decode_tables, inputs.decode_lens, self.block_size, dev, self.decode_workspace
            )
        if inputs.prefills:
            d = len(inputs.decode_lens)
            meta.prefill_plan = plan = plan_prefill([(n, c, blocks) for _, n, c, blocks in inputs.prefills], dev)
            meta.prefills = [PrefillChunk(d + s, n, c, ids) for s, n, c, ids in plan.chunks]
        meta.slot_mapping = torch.tensor(inputs.slots, dtype=torch.long, device=dev)
        input_ids = torch.tensor(inputs.token_ids, dtype=torch.long, device=dev)
        positions = torch.tensor(inputs.positions, dtype=torch.long, device=dev)
        meta.positions = positions
        return input_ids, positions, meta

    def _prompt_logprobs(self, hidden: torch.Tensor, start: int, s: ScheduledRequest, k: int) -> Logprobs | None:
        """Rows for the prompt tokens predicted by this chunk's positions."""
        req = s.request
        c = s.num_computed_tokens
        rows = _num_prompt_logprob_rows(s)
        if not rows:
            return None
        last = c + rows
        logits = self._logits(hidden[start : start + rows])
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(req.prompt_token_ids[c + 1 : last + 1], device=self.device)
        k = logprobs.shape[-1] if k < 0 else k
        ids, lps, ranks = gather_logprobs(logprobs, targets, k)
        return Logprobs(ids.tolist(), lps.tolist(), ranks.tolist())


def _feeds_images(decodes: list[ScheduledRequest]) -> bool:
    """Whether a decode row feeds an image position (a one-token prompt chunk)."""
    return any(first <= s.num_computed_tokens < end for s in decodes for first, end, _ in s.request.image_spans)


def _bidirectional_spans(meta: AttentionMetadata, prefills: list[ScheduledRequest]) -> None:
    """Put each prefill chunk's bidirectional image spans (Gemma 3; kernels/attention.py) on the
    step's prefill plan, if any chunk touches one."""
    spans = [
        [(f.offset, f.offset + f.length) for f in s.request.images if f.bidirectional
         and f.offset < s.num_computed_tokens + s.num_new_tokens and f.offset + f.length > s.num_computed_tokens]
        for s in prefills
    ]  # fmt: skip
    if any(spans) and meta.prefill_plan is not None:
        meta.prefill_plan.bidirectional = spans


def _num_prompt_logprob_rows(s: ScheduledRequest) -> int:
    """How many of this chunk's positions predict a prompt token (position P-1 predicts the
    first output)."""
    c, n = s.num_computed_tokens, s.num_new_tokens
    return max(0, min(c + n, s.request.num_prompt_tokens - 1) - c)


def _logit_rows(order: list[ScheduledRequest], ends: list[int], samplers: list[int]) -> list[list[int]]:
    """The rows of each `compute_logits` call `execute` makes, in its order."""
    rows = [[r for i in samplers for r in range(ends[i] - order[i].num_draft, ends[i] + 1)]] if samplers else []
    for i, s in enumerate(order):
        if s.request.sampling_params.prompt_logprobs is not None:
            n = _num_prompt_logprob_rows(s)
            if n:
                start = ends[i] - s.num_new_tokens + 1
                rows.append(list(range(start, start + n)))
    return rows


def _add_decode_row(inputs: StepInputs, token: int, p: int, blocks: list[int], bs: int) -> None:
    """A one-token row at position p of a sequence with `blocks`: it attends to positions 0..p."""
    inputs.token_ids.append(token)
    inputs.positions.append(p)
    inputs.slots.append(blocks[p // bs] * bs + p % bs)
    inputs.decode_tables.append(blocks[: p // bs + 1])
    inputs.decode_lens.append(p + 1)


def _add_prefill(inputs: StepInputs, ids: list[int], start: int, blocks: list[int], bs: int) -> None:
    """A prefill chunk: `ids` at positions start.. of a sequence with `blocks`."""
    n, used = len(ids), blocks[: -(-(start + len(ids)) // bs)]
    inputs.prefills.append((len(inputs.token_ids), n, start, used))
    inputs.token_ids.extend(ids)
    inputs.positions.extend(range(start, start + n))
    inputs.slots.extend(_slots(used, start, n, bs))


def _slots(blocks: list[int], start: int, n: int, bs: int) -> list[int]:
    """The slots of positions [start, start + n): whole blocks at a time, not token by token."""
    out: list[int] = []
    p, end = start, start + n
    while p < end:
        base = blocks[p // bs] * bs
        stop = min(end, (p // bs + 1) * bs)
        out.extend(range(base + p % bs, base + p % bs + stop - p))
        p = stop
    return out


def _sampling_row(s: ScheduledRequest, drafts: list[int] | None = None) -> SamplingRow:
    """The request's row; at a draft row, with the drafts before it as if already output."""
    req = s.request
    return SamplingRow(
        params=req.sampling_params,
        prompt_token_ids=req.prompt_token_ids,
        output_token_ids=req.output_token_ids + drafts if drafts else req.output_token_ids,
        eos_token_ids=req.eos_token_ids,
        bad_words_token_ids=req.bad_words_token_ids,
        plan=req.sampling_plan,
        grammar=req.grammar,
    )
