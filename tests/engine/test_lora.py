"""LoRA in the engine core (lora/layers.py, lora/manager.py): peft's greedy tokens, batched.

Three random PEFT adapters written by peft itself on the tiny Llama (tests/lora_adapters.py):
all seven projections at r=8, rsLoRA at r=4 on q/v/down only, and r=16 on o/gate/up. A batch
mixing them and the base model (one adapter on two requests whose rows are not adjacent, so
both the sliced and the gathered paths run) gives, request by request, the tokens of peft's
model with that adapter applied, fp32, greedy; and it runs as one batch every step. The same
with one slot for three adapters (slots reused), on two tensor-parallel ranks, and over int8
weights (close to the dense numbers; the native decode stack equal to the layer path). A bad
adapter (missing, or shaped for another model) fails its request alone; an MoE model takes
attention adapters and refuses expert ones, naming the module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_adapters import make_peft_adapter, peft_greedy
from safetensors.torch import save_file
from stack_spy import StackSpy
from tinymodel import make_tiny_model, make_transformers_model

from triollm.engine.config import EngineArgs
from triollm.engine.core import EngineCore
from triollm.engine.distributed.protocol import StepInputs, decode_step, encode_step
from triollm.engine.request import EngineCoreRequest, FinishReason
from triollm.engine.sampling_params import SamplingParams
from triollm.lora.layers import LoRABatch, LoRALayer
from triollm.lora.request import LoRARequest

NEW_TOKENS = 6
PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 7, 100, 3, 3, 18, 60], [250, 12, 99], [7, 7, 8, 120, 300, 11]]
# (request id, prompt index, adapter id; 0: the base model). Adapter 1 serves two requests
# whose decode rows are apart (decodes are ordered by context length).
BATCH = [("base0", 0, 0), ("a1", 1, 1), ("a2", 2, 2), ("a3", 3, 3), ("a1b", 0, 1), ("base1", 1, 0)]


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        1: make_peft_adapter(tiny_model_dir, root / "all", seed=1, r=8, alpha=16),
        2: make_peft_adapter(
            tiny_model_dir,
            root / "rslora",
            seed=2,
            r=4,
            alpha=8,
            use_rslora=True,
            target_modules=("q_proj", "v_proj", "down_proj"),
        ),
        3: make_peft_adapter(
            tiny_model_dir, root / "mlp", seed=3, r=16, alpha=32, target_modules=("o_proj", "gate_proj", "up_proj")
        ),
    }


def lora(adapters: dict[int, Path], lid: int) -> LoRARequest | None:
    return None if lid == 0 else LoRARequest(f"adapter{lid}", lid, str(adapters[lid]))


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path, adapters: dict[int, Path]) -> dict[str, list[int]]:
    """peft's greedy tokens for every request of BATCH."""
    refs = {rid: peft_greedy(tiny_model_dir, adapters.get(lid), PROMPTS[p], NEW_TOKENS) for rid, p, lid in BATCH}
    # The adapters change the tokens: a run that ignored them could not pass.
    assert refs["a1"] != refs["base1"] and refs["a1b"] != refs["base0"]
    return refs


def make_core(model: Path, **kw: Any) -> EngineCore:
    kw = {"num_threads": 1, **kw}
    args = EngineArgs(model=str(model), max_model_len=64, seed=0, enable_lora=True, max_lora_rank=16, **kw)
    return EngineCore(args.create_engine_config())


@pytest.fixture(scope="module")
def core(tiny_model_dir: Path) -> Iterator[EngineCore]:
    c = make_core(tiny_model_dir, max_loras=3, max_cpu_loras=4)
    yield c
    c.close()


class StepLog:
    """Per step: the scheduled requests and their adapter ids; the LoRA groups the step ran."""

    def __init__(self, core: EngineCore) -> None:
        self.steps: list[tuple[list[str], set[int]]] = []
        self.groups: list[int] = []
        execute = core.runner.execute

        def logged(scheduled: list[Any]) -> Any:
            self.steps.append(
                (
                    [s.request.request_id for s in scheduled],
                    {s.request.lora_request.lora_int_id for s in scheduled if s.request.lora_request},
                )
            )
            out = execute(scheduled)
            assert core.lora is not None
            self.groups.append(len(core.lora.batch.groups))
            return out

        core.runner.execute = logged  # type: ignore[method-assign]
        self._restore = lambda: setattr(core.runner, "execute", execute)

    def close(self) -> None:
        self._restore()


def run(
    core: EngineCore,
    requests: list[tuple[str, list[int], LoRARequest | None]],
    rows: dict[str, list[Any]] | None = None,
    **kw: Any,
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Every request to the end: tokens by id, and the error of each that failed (with
    `rows`, each step's logprobs row by id into it)."""
    for rid, ids, lr in requests:
        core.add_request(EngineCoreRequest(rid, ids, greedy(**kw), lora_request=lr))
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    errors: dict[str, str] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            if rows is not None:
                rows.setdefault(out.request_id, []).append(out.new_logprobs)
            if out.finish_reason == FinishReason.ERROR:
                errors[out.request_id] = str(out.stop_reason)
    stats = core.statistics()
    assert not core.requests and stats.num_free_blocks == stats.num_blocks
    core.check_integrity()
    return tokens, errors


def batch(adapters: dict[int, Path]) -> list[tuple[str, list[int], LoRARequest | None]]:
    return [(rid, PROMPTS[p], lora(adapters, lid)) for rid, p, lid in BATCH]


# ------------------------------------------------------------------------------ the real path


def test_mixed_batch_gives_pefts_tokens_in_one_step(
    core: EngineCore, adapters: dict[int, Path], references: dict[str, list[int]]
) -> None:
    log = StepLog(core)
    try:
        tokens, errors = run(core, batch(adapters))
    finally:
        log.close()
    assert not errors
    assert tokens == references
    # One batch all along: every step held all six requests and the three adapters, in three groups.
    assert len(log.steps) == NEW_TOKENS
    assert all(sorted(ids) == sorted(references) and lids == {1, 2, 3} for ids, lids in log.steps)
    assert log.groups == [3] * NEW_TOKENS
    # Idle again: the next step has no adapter rows, and the model runs as the base.
    tokens, _ = run(core, [("again", PROMPTS[1], None)])
    assert tokens["again"] == references["base1"] and core.lora is not None and not core.lora.batch.active


@pytest.mark.parametrize("case", ["missing", "wrong_shape", "corrupt"])
def test_bad_adapter_fails_its_request_alone(
    core: EngineCore, adapters: dict[int, Path], references: dict[str, list[int]], tmp_path: Path, case: str
) -> None:
    bad = tmp_path / "bad"
    if case == "missing":
        match = "is not a LoRA adapter directory"
    elif case == "wrong_shape":  # written for a model with a hidden size of 32
        small = make_tiny_model(tmp_path / "small", hidden_size=32, intermediate_size=64)
        make_peft_adapter(small, bad, r=4, target_modules=("q_proj",))
        match = r"tensor layers\.0\.q_proj\.lora_A has shape \(4, 32\); the model's q_proj takes 64 inputs"
    else:
        bad.mkdir()
        (bad / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
        (bad / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
        match = "could not be read"
    requests = [
        ("a1", PROMPTS[1], lora(adapters, 1)),
        ("bad", PROMPTS[2], LoRARequest("bad", 9, str(bad))),
        ("base0", PROMPTS[0], None),
    ]
    tokens, errors = run(core, requests)
    assert list(errors) == ["bad"] and tokens["bad"] == []
    assert errors["bad"].startswith(f"lora_path: {str(bad)!r}")
    assert re.search(match, errors["bad"]), errors["bad"]
    assert tokens["a1"] == references["a1"] and tokens["base0"] == references["base0"]
    assert core.lora is not None and 9 not in core.lora.slot_of and 9 not in core.lora.cpu


def test_fewer_slots_than_adapters_reuses_them(
    tiny_model_dir: Path, adapters: dict[int, Path], references: dict[str, list[int]]
) -> None:
    """One slot, three adapters in flight: the scheduler runs one adapter at a time beside the
    base requests, and the slot is refilled for each."""
    c = make_core(tiny_model_dir, max_loras=1, max_cpu_loras=1)
    try:
        log = StepLog(c)
        tokens, errors = run(c, batch(adapters))
        assert not errors and tokens == references
        assert all(len(lids) <= 1 for _, lids in log.steps)
        assert c.lora is not None and c.lora.batch.version >= 3  # the slot was filled at least three times
    finally:
        c.close()


def test_tensor_parallel_gives_the_same_tokens(
    tiny_model_dir: Path, adapters: dict[int, Path], references: dict[str, list[int]]
) -> None:
    """Two ranks: rank 0 reads the adapters and sends each slot's tensors with the step; the
    worker fills its own shares (B's rows of q|k|v and gate|up, A's columns of o and down)."""
    c = make_core(tiny_model_dir, max_loras=2, tensor_parallel_size=2, num_threads=2)
    try:
        tokens, errors = run(c, batch(adapters))
    finally:
        c.close()
    assert not errors and tokens == references


@pytest.mark.parametrize("lora_dtype", ["auto", "bfloat16"])
def test_int8_weights_take_the_adapters(
    tiny_model_dir: Path, adapters: dict[int, Path], references: dict[str, list[int]], lora_dtype: str
) -> None:
    """Over int8 weights the adapters apply (the first tokens are peft's, whose logprobs int8
    moves by ~0.1 on this model), and an all-decode step with adapter rows in the native decode
    stack gives the layer-by-layer path's tokens and logprobs exactly, with fp32 or bf16 slots."""
    c = make_core(tiny_model_dir, max_loras=3, quantization="int8", enable_prefix_caching=False, lora_dtype=lora_dtype)
    try:
        model = c.model
        assert model is not None and model.decode_stack is not None
        requests = batch(adapters)
        spy = StackSpy(model.decode_stack)
        model.decode_stack = spy  # type: ignore[assignment]
        stacked_lps: dict[str, list[Any]] = {}
        stacked, errors = run(c, requests, stacked_lps, logprobs=2)
        assert not errors
        lora_calls = [a[-1] is not None and len(a[-1][-1]) for a in spy.calls]  # the LoRA groups each took
        assert lora_calls == [3] * (NEW_TOKENS - 1)  # every decode step, natively, with its three groups
        assert all(row is not None for rows in stacked_lps.values() for row in rows)
        same_first = [rid for rid, ref in references.items() if stacked[rid][:1] == ref[:1]]
        assert len(same_first) >= 5
        # Adapters move the int8 model's tokens as they move the dense model's.
        assert stacked["a1"] != stacked["base1"]
        model.decode_stack = None
        layered_lps: dict[str, list[Any]] = {}
        layered, _ = run(c, requests, layered_lps, logprobs=2)
        assert layered == stacked and layered_lps == stacked_lps
    finally:
        c.close()


def test_moe_model_takes_attention_adapters_and_refuses_expert_ones(tmp_path: Path) -> None:
    moe = make_transformers_model(
        tmp_path / "moe",
        "Qwen3MoeForCausalLM",
        seed=7,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        num_experts_per_tok=2,
        num_local_experts=8,
    )
    attn = make_peft_adapter(moe, tmp_path / "attn", seed=4, r=8, target_modules=("q_proj", "o_proj"))
    experts = tmp_path / "experts"
    experts.mkdir()
    (experts / "adapter_config.json").write_text(
        json.dumps({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "gate_proj"]})
    )
    g = torch.Generator().manual_seed(0)
    save_file(
        {
            f"base_model.model.model.layers.0.self_attn.q_proj.lora_{ab}.weight": torch.randn(shape, generator=g)
            for ab, shape in (("A", (2, 64)), ("B", (64, 2)))
        },
        str(experts / "adapter_model.safetensors"),
    )
    c = make_core(moe, max_loras=2)
    try:
        tokens, errors = run(
            c,
            [
                ("attn", PROMPTS[1], LoRARequest("attn", 1, str(attn))),
                ("experts", PROMPTS[2], LoRARequest("experts", 2, str(experts))),
            ],
        )
    finally:
        c.close()
    assert list(errors) == ["experts"]
    assert "target_modules gate_proj: LoRA on a mixture-of-experts MLP's experts is not supported" in errors["experts"]
    assert tokens["attn"] == peft_greedy(moe, attn, PROMPTS[1], NEW_TOKENS)


# ------------------------------------------------------------------------------ the parts


def test_batch_groups_slice_contiguous_rows_and_gather_the_rest() -> None:
    b = LoRABatch(3)
    b.set([(0, 0, 1), (2, 1, 4), (0, 5, 1), (1, 6, 2), (1, 8, 3)], "cpu")
    groups = {slot: rows for slot, rows in b.groups}
    assert groups[2] == slice(1, 5) and groups[1] == slice(6, 11)  # adjacent segments merge
    assert torch.equal(groups[0], torch.tensor([0, 5]))  # type: ignore[arg-type]
    b.set([], "cpu")
    assert not b.active


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("n", [5, 40])  # decode-sized groups (the native loop) and BLAS-sized ones
def test_layer_update_is_x_a_b_per_row(native: bool, n: int, dtype: torch.dtype) -> None:
    """A fused projection of two pieces, slots of width 4 holding rank-2 and rank-3 adapters,
    one targeting only the second piece: each row gets its slot's x A^T B^T, others nothing.
    bf16 slots: the reference uses the rounded weights (and, in torch, bf16 activations)."""
    g = torch.Generator().manual_seed(0)
    b = LoRABatch(2)
    layer = LoRALayer(b, [4, 6], 6, 10, 4, dtype, "cpu")
    if not native:
        layer.native = False
    a0, b0, a1, b1 = (torch.randn(shape, generator=g).to(dtype).float() for shape in ((2, 6), (4, 2), (3, 6), (6, 3)))
    layer.fill(0, 2, 0, a0, b0, (0, 4))
    layer.fill(1, 3, 1, a1, b1, (4, 6))
    x, base = torch.randn(3 * n, 6, generator=g), torch.randn(3 * n, 10, generator=g)
    # Slot 1 on rows [0, n) and [2n, 3n) (gathered), slot 0 on [n, 2n) (a slice); no row twice.
    b.set([(1, 0, n), (0, n, n), (1, 2 * n, n)], "cpu")
    out = layer.apply(x, base.clone())
    want = base.clone()
    want[n : 2 * n, :4] += x[n : 2 * n] @ a0.T @ b0.T
    ones = [*range(n), *range(2 * n, 3 * n)]
    want[ones, 4:] += x[ones] @ a1.T @ b1.T
    tol = {} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    torch.testing.assert_close(out, want, **tol)


def test_step_inputs_carry_the_lora_rows_and_loads() -> None:
    s = StepInputs(
        [1, 2, 3],
        [0, 1, 2],
        [4, 5, 6],
        logit_rows=[[2]],
        lora_segments=[(1, 0, 2), (0, 2, 1)],
        lora_loads=b"\x00slots\xff",
    )
    assert decode_step(encode_step(s)) == s
    plain = StepInputs([1], [0], [4])
    assert decode_step(encode_step(plain)) == plain


def test_bundled_model_with_an_adapter_gives_pefts_tokens(bundled_model_dir: Path, tmp_path: Path) -> None:
    """The bundled SmolLM2 (its dense import, fp32) under a peft-written adapter on q/v/down:
    peft's greedy tokens, and not the base model's."""
    adapter = make_peft_adapter(
        bundled_model_dir, tmp_path / "smol", seed=5, r=8, target_modules=("q_proj", "v_proj", "down_proj"), scale=0.05
    )
    prompt = [1, 504, 3458, 282, 4649, 314]  # six ids of the bundled vocabulary
    ref = peft_greedy(bundled_model_dir, adapter, prompt, NEW_TOKENS)
    base = peft_greedy(bundled_model_dir, None, prompt, NEW_TOKENS)
    assert ref != base
    c = make_core(bundled_model_dir, quantization="none", max_loras=1, num_threads=2)
    try:
        tokens, errors = run(c, [("smol", prompt, LoRARequest("smol", 1, str(adapter))), ("plain", prompt, None)])
    finally:
        c.close()
    assert not errors and tokens == {"smol": ref, "plain": base}
