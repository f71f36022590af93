"""The MoE block (engine/execution/layers/moe.py) against transformers' own sparse MoE blocks.

Qwen3-MoE (`norm_topk_prob` on and off) and Mixtral in fp32, the weights copied in both forms a
loader meets (transformers 5's stacked `gate_up_proj` / `down_proj`, and per-expert 2-D tensors),
at 1, 3 and 17 tokens. Then that only the routed experts run (every other expert's weights NaN),
bf16, the loading errors, and `triollm bench moe` at tiny sizes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from triollm.bench import add_bench_parser
from triollm.bench.moe import bench_moe
from triollm.engine.execution.layers.moe import FusedMoE, load_expert_weight

H, INTER = 32, 16  # hidden, expert intermediate


def hf_block(family: str, num_experts: int = 8, top_k: int = 2, *, seed: int = 0) -> Any:
    """transformers' sparse MoE block with random weights (the router's large enough that the
    top-k is decided, not a near-tie)."""
    common: dict[str, Any] = {"hidden_size": H, "num_experts_per_tok": top_k, "experts_implementation": "eager"}
    block: Any
    if family == "mixtral":
        block = MixtralSparseMoeBlock(MixtralConfig(intermediate_size=INTER, num_local_experts=num_experts, **common))
    else:
        cfg = Qwen3MoeConfig(
            moe_intermediate_size=INTER, num_experts=num_experts, norm_topk_prob=family == "qwen3-norm", **common
        )
        block = Qwen3MoeSparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return block.eval()


def renormalizes(family: str) -> bool:
    return family != "qwen3"


def ours_from(block: Any, family: str, form: str) -> FusedMoE:
    experts = block.experts
    num_experts, top_k = experts.num_experts, block.gate.top_k
    moe = FusedMoE(num_experts, top_k, H, INTER, renormalize=renormalizes(family))
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    if form == "stacked":
        load_expert_weight(moe, "gate_up", None, gate_up)
        load_expert_weight(moe, "down", None, down)
    else:  # per expert, in reverse order so a write to the wrong expert is not overwritten right
        for e in reversed(range(num_experts)):
            load_expert_weight(moe, "down", e, down[e].clone())
            load_expert_weight(moe, "up", e, gate_up[e, INTER:].clone())
            load_expert_weight(moe, "gate", e, gate_up[e, :INTER].clone())
    return moe


def reference(block: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(transformers' output [T, H], its router logits [T, E])."""
    with torch.no_grad():
        return block(x[None])[0], block.gate(x)[0]


@pytest.mark.parametrize("form", ["stacked", "per-expert"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3-norm", "mixtral"])
def test_matches_transformers(family: str, form: str) -> None:
    block = hf_block(family)
    moe = ours_from(block, family, form)
    gen = torch.Generator().manual_seed(1)
    for tokens in (1, 3, 17):
        x = torch.randn(tokens, H, generator=gen)
        want, logits = reference(block, x)
        with torch.inference_mode():
            got = moe(x, logits)
        assert got.shape == (tokens, H) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3-norm", "mixtral"])
def test_ties_pick_torch_topk_experts(family: str) -> None:
    """A zero router makes every expert tie: the block must pick the experts torch.topk picks."""
    block = hf_block(family, num_experts=6, top_k=3)
    with torch.no_grad():
        block.gate.weight.zero_()
    moe = ours_from(block, family, "stacked")
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(2))
    want, logits = reference(block, x)
    with torch.inference_mode():
        torch.testing.assert_close(moe(x, logits), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 4])
def test_only_routed_experts_run(tokens: int) -> None:
    """64 experts, top-2: every expert no token picked has NaN weights. Any pass over all experts
    (a dense loop, or all experts computed then masked by a zero weight) makes the output NaN."""
    block = hf_block("qwen3-norm", num_experts=64, top_k=2, seed=3)
    moe = ours_from(block, "qwen3-norm", "stacked")
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(4))
    want, logits = reference(block, x)
    picked = torch.topk(logits, 2, dim=-1).indices.unique()
    idle = torch.ones(64, dtype=torch.bool)
    idle[picked] = False
    assert int(idle.sum()) >= 64 - 2 * tokens
    with torch.no_grad():
        moe.w13[idle] = float("nan")
        moe.w2[idle] = float("nan")
    with torch.inference_mode():
        got = moe(x, logits)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bf16_close_to_fp32() -> None:
    block = hf_block("mixtral")
    moe = ours_from(block, "mixtral", "stacked")
    x = torch.randn(17, H, generator=torch.Generator().manual_seed(5))
    want, logits = reference(block, x)
    moe16 = ours_from(block, "mixtral", "stacked").to(torch.bfloat16)
    with torch.inference_mode():
        for rows in (slice(0, 1), slice(None)):  # the one-token path and the grouped one
            got = moe16(x[rows].bfloat16(), logits[rows].bfloat16())
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want[rows], atol=0.05, rtol=0.05)
            torch.testing.assert_close(moe(x[rows], logits[rows]), want[rows], atol=1e-5, rtol=1e-5)


def test_load_expert_weight_errors() -> None:
    moe = FusedMoE(4, 2, H, INTER, renormalize=True)
    with pytest.raises(ValueError, match=r"kind must be one of gate, up, down, gate_up, got 'w1'"):
        load_expert_weight(moe, "w1", 0, torch.zeros(INTER, H))
    with pytest.raises(ValueError, match=r"experts\.2\.down_proj \(down\) has shape \[16, 32\], expected \[32, 16\]"):
        load_expert_weight(moe, "down", 2, torch.zeros(INTER, H))
    with pytest.raises(ValueError, match=r"gate_up_proj \(gate_up\) has shape \[4, 16, 32\], expected \[4, 32, 32\]"):
        load_expert_weight(moe, "gate_up", None, torch.zeros(4, INTER, H))
    with pytest.raises(ValueError, match=r"expert must be in \[0, 4\), got 4"):
        load_expert_weight(moe, "up", 4, torch.zeros(INTER, H))
    with pytest.raises(ValueError, match="needs an expert id"):
        load_expert_weight(moe, "gate", None, torch.zeros(INTER, H))
    with pytest.raises(ValueError, match="expert must be None"):
        load_expert_weight(moe, "gate_up", 0, torch.zeros(2 * INTER, H))
    with torch.device("meta"):
        meta = FusedMoE(4, 2, H, INTER, renormalize=True)
    with pytest.raises(ValueError, match="meta device"):
        load_expert_weight(meta, "gate", 0, torch.zeros(INTER, H))


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match=r"top_k must be in \[1, num_experts=4\], got 5"):
        FusedMoE(4, 5, H, INTER, renormalize=True)
    with pytest.raises(ValueError, match="intermediate_size must be >= 1, got 0"):
        FusedMoE(4, 2, H, 0, renormalize=True)
    moe = FusedMoE(4, 2, H, INTER, renormalize=True)
    with pytest.raises(ValueError, match=r"router_logits must be \[T=3, num_experts=4\], got \[3, 5\]"):
        moe(torch.zeros(3, H), torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"x must be \[T, hidden_size=32\], got \[3, 8\]"):
        moe(torch.zeros(3, 8), torch.zeros(3, 4))


def test_bench_moe_runs(tmp_path: Path) -> None:
    rows = bench_moe([4, 16], [1, 3], top_k=2, hidden=16, intermediate=8, layers=2, iters=2, warmup=1, flush_mib=1)
    assert [(r["tokens"], r["experts"]) for r in rows] == [(1, 4), (3, 4), (1, 16), (3, 16)]
    for r in rows:
        assert r["median_ms"] > 0 and r["ratio"] > 0
        assert 1 <= r["experts_run_per_layer"] <= min(r["experts"], 2 * r["tokens"])
    assert rows[0]["ratio"] == rows[1]["ratio"] == 1.0
    assert rows[0]["experts_run_per_layer"] == rows[2]["experts_run_per_layer"] == 2.0  # one token, top-2
    # through the CLI as `triollm bench moe` parses it
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "moe.json"
    argv = ("bench moe --experts 4 8 --tokens 2 --hidden 16 --intermediate 8 --layers 1 --iters 2 "
            "--flush-mib 0 --json").split()  # fmt: skip
    ns = parser.parse_args([*argv, str(out)])
    assert ns.func(ns) == 0
    saved = json.loads(out.read_text())
    assert saved["config"]["experts"] == [4, 8] and [r["experts"] for r in saved["rows"]] == [4, 8]
