"""`triollm bench latency` on a tiny random model: the chat workloads with `--baseline` write
their figures, speculation leaves a greedy output unchanged token for token, and
`--dump-prompts` writes the prompts that docs/bench/llamacpp_lookup.py replays; the random
workload without prefix caching reports prefill tokens/s per run (docs/bench/long_context.sh),
and a prompt plus output beyond max_model_len is refused rather than cut short.

The tiny model holds 4096 positions (the shared fixture's 512 are fewer than the code prompt's
tokens under its byte-level tokenizer). Speed is not checked here: the lead measures it.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from tinymodel import make_tiny_model

from triollm.api.cli import main
from triollm.bench.latency import (
    TEXT_LATENCY_WORKLOADS,
    _first_difference,
    latency_prompt_ids,
)

FIGURES = (
    "ttft_ms",
    "ms_per_token",
    "step_ms_median",
    "output_tokens",
    "token_ids",
    "repeats_identical",
    "runs",
    "warmup",
    "spec",
)
SPEC_KEYS = (
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "accepted_per_pos",
    "acceptance_rate",
    "mean_acceptance_length",
)


@pytest.fixture(scope="module")
def long_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=4096)


def _bench(model: Path, out: Path, *extra: str) -> dict:
    rc = main([
        "bench", "latency", "--model", str(model), "--workload", "code", "--output-len", "12", "--repeat", "2",
        "--baseline", "--num-threads", "1", "--output-json", str(out), *extra,
    ])  # fmt: skip
    assert rc == 0
    return json.loads(out.read_text())


def test_code_workload_with_baseline_writes_the_figures(long_tiny_model: Path, tmp_path: Path) -> None:
    res = _bench(long_tiny_model, tmp_path / "lat.json")
    assert res["workload"] == "code" and res["max_tokens"] == 12
    assert res["prompt_tokens"] > 500  # the snippet and the instruction, chat-templated
    assert res["floor_ms_per_token"] > 0 and res["weight_bytes"] > 0
    for side in ("triollm", "baseline"):
        figures = res[side]
        for key in FIGURES:
            assert key in figures, (side, key)
        for key in SPEC_KEYS:
            assert key in figures["spec"], (side, key)
        assert len(figures["runs"]) == 2 and figures["repeats_identical"]
        assert 1 <= figures["output_tokens"] <= 12 == res["max_tokens"]
        assert len(figures["token_ids"]) == figures["output_tokens"]
        if figures["output_tokens"] > 1:
            assert figures["ms_per_token"] > 0 and figures["step_ms_median"] > 0
        assert figures["spec"]["num_drafts"] == 0  # no speculative_config
    # No speculative_config: the baseline is the same engine, so the outputs must agree.
    assert res["outputs_identical"] is True
    assert res["ratio_ms_per_token"] == res["triollm"]["ms_per_token"] / res["baseline"]["ms_per_token"]


def test_ngram_speculation_keeps_the_greedy_output(long_tiny_model: Path, tmp_path: Path) -> None:
    # prompt_lookup_min 1: a token of the output found anywhere in the 1500-token prompt gives a
    # draft, so even a random model's output is speculated on.
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    res = _bench(long_tiny_model, tmp_path / "spec.json", "--speculative-config", json.dumps(spec))
    assert res["speculative_config"] == spec
    assert res["outputs_identical"] is True, _first_difference(
        res["triollm"]["token_ids"], res["baseline"]["token_ids"]
    )
    assert res["triollm"]["repeats_identical"]
    s = res["triollm"]["spec"]
    assert s["num_accepted_tokens"] <= s["num_draft_tokens"] <= 3 * s["num_drafts"]
    assert len(s["accepted_per_pos"]) == 3 and s["num_drafts"] > 0
    assert s["mean_acceptance_length"] == 1 + s["num_accepted_tokens"] / s["num_drafts"]
    assert res["baseline"]["spec"]["num_drafts"] == 0


def test_dump_prompts_writes_the_chat_templated_ids(long_tiny_model: Path, tmp_path: Path) -> None:
    from triollm.engine.processing.tokenizer import Tokenizer

    out = tmp_path / "prompts.json"
    assert main(["bench", "latency", "--model", str(long_tiny_model), "--dump-prompts", str(out)]) == 0
    prompts = json.loads(out.read_text())
    assert sorted(prompts) == sorted(TEXT_LATENCY_WORKLOADS)
    tok = Tokenizer.from_pretrained(long_tiny_model)
    for workload, ids in prompts.items():
        assert ids == latency_prompt_ids(workload, tok)
    text = tok.decode(prompts["code"])
    assert "<|im_start|>user" in text and "def parse_rate(spec):" in text and "`parse_rate_spec`" in text
    assert len(prompts["code"]) > len(prompts["summary"]) > len(prompts["text"])


def test_first_difference() -> None:
    assert _first_difference([1, 2, 3], [1, 2, 3]) is None
    assert _first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert _first_difference([1, 2], [1, 2, 3]) == 2


def test_repeat_must_be_positive(long_tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "latency", "--model", str(long_tiny_model), "--repeat", "0"]) == 2
    assert "--repeat: must be at least 1, got 0" in capsys.readouterr().err


def test_random_workload_without_prefix_caching_reports_prefill(long_tiny_model: Path, tmp_path: Path) -> None:
    """The long-context sitting's shape (docs/bench/long_context.sh): random ids, every run a
    cold prefill, prefill tokens/s beside the decode time."""
    out = tmp_path / "random.json"
    rc = main([
        "bench", "latency", "--model", str(long_tiny_model), "--input-len", "1500", "--output-len", "8",
        "--repeat", "2", "--no-enable-prefix-caching", "--num-threads", "1", "--output-json", str(out),
    ])  # fmt: skip
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["prompt_tokens"] == 1500 and res["max_tokens"] == 8
    figures = res["triollm"]
    assert figures["output_tokens"] == 8 and figures["repeats_identical"]
    for run in [figures["warmup"], *figures["runs"]]:
        assert run["prefill_tok_per_s"] == pytest.approx(1500 / (run["ttft_ms"] / 1e3))
    assert figures["prefill_tok_per_s"] == statistics.median(r["prefill_tok_per_s"] for r in figures["runs"])


def test_prompt_and_output_beyond_max_model_len_are_refused(
    long_tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "latency", "--model", str(long_tiny_model), "--input-len", "4090", "--output-len", "8"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--input-len + --output-len: 4090 + 8 tokens exceed max_model_len (4096)" in err
    assert "--max-model-len 4098" in err


@pytest.mark.parametrize("flag", ["--input-len", "--output-len"])
def test_lengths_must_be_positive(long_tiny_model: Path, capsys: pytest.CaptureFixture[str], flag: str) -> None:
    assert main(["bench", "latency", "--model", str(long_tiny_model), flag, "0"]) == 2
    assert f"{flag}: must be at least 1, got 0" in capsys.readouterr().err
