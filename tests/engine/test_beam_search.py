"""`LLM.beam_search` (engine/beam_search.py): vLLM's algorithm on the engine, checked against
transformers' `generate(num_beams=...)` on the bundled model, plus its bookkeeping."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from triollm import LLM
from triollm.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search_score

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def test_the_best_beam_equals_transformers(bundled_model_dir: Path) -> None:
    """fp32, width 3, 8 tokens, EOS ignored (transformers with eos_token_id=None): with beams of
    equal length the two scores rank alike, so the best sequences must be the same."""
    transformers = pytest.importorskip("transformers")
    with LLM(str(bundled_model_dir), dtype="float32", max_model_len=256, num_threads=1) as llm:
        outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
        tok = llm.get_tokenizer()
        ours = [o.sequences[0].tokens[len(tok.encode(p)) :] for o, p in zip(outs, PROMPTS)]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(bundled_model_dir), dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(bundled_model_dir))
    for prompt, mine in zip(PROMPTS, ours):
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        out = model.generate(
            ids, num_beams=3, max_new_tokens=8, do_sample=False, early_stopping=False, eos_token_id=None, pad_token_id=0
        )
        assert out[0, ids.shape[1] :].tolist() == mine, prompt


def test_beams_are_ranked_and_their_scores_add_up(tiny_model_dir: Path) -> None:
    with LLM(str(tiny_model_dir), max_model_len=64, num_threads=1) as llm:
        prompt = {"prompt_token_ids": [5, 6, 7]}
        (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=5, ignore_eos=True))
    assert len(out.sequences) == 4
    scores = [beam_search_score(s.tokens, s.cum_logprob, None, 1.0) for s in out.sequences]
    assert scores == sorted(scores, reverse=True)
    for seq in out.sequences:
        assert seq.tokens[:3] == [5, 6, 7] and len(seq.tokens) == 8 and seq.finish_reason == "length"
        chosen = [lp[t].logprob for lp, t in zip(seq.logprobs, seq.tokens[3:])]
        assert math.isclose(sum(chosen), seq.cum_logprob, rel_tol=1e-6)
    assert len({tuple(s.tokens) for s in out.sequences}) == 4  # distinct beams


def test_llm_beam_search_text_is_the_whole_sequence(tiny_model_dir: Path) -> None:
    """vLLM's offline `LLM.beam_search` decodes every token of a beam, the prompt's included."""
    prompt = "Once upon a time"
    with LLM(str(tiny_model_dir), max_model_len=64, num_threads=1) as llm:
        (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
        decode = llm.get_tokenizer().decode
    for seq in out.sequences:
        assert seq.text == decode(seq.tokens, skip_special_tokens=True) and seq.text.startswith(prompt)


def test_beams_that_reach_the_context_length_finish_once(tiny_model_dir: Path) -> None:
    """More max_tokens than the context holds: every beam stops at max_model_len, is reported
    once (no duplicates from the rounds after), and finishes with "length"."""
    with LLM(str(tiny_model_dir), max_model_len=16, num_threads=1) as llm:
        (out,) = llm.beam_search(
            [{"prompt_token_ids": list(range(5, 15))}], BeamSearchParams(beam_width=3, max_tokens=20, ignore_eos=True)
        )
        assert llm.beam_search([], BeamSearchParams(beam_width=3, max_tokens=2)) == []
    assert len(out.sequences) == 3
    assert len({tuple(s.tokens) for s in out.sequences}) == 3
    assert all(len(s.tokens) == 16 and s.finish_reason == "length" for s in out.sequences)


def test_the_score_and_the_params_follow_vllm() -> None:
    assert beam_search_score([1, 2, 3, 9], -2.0, eos_token_id=9, length_penalty=1.0) == -2.0 / 3  # EOS not counted
    assert beam_search_score([1, 2, 3, 4], -2.0, eos_token_id=9, length_penalty=2.0) == -2.0 / 16
    with pytest.raises(ValueError, match="beam_width: must be a positive integer"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens: must be a positive integer"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="temperature: must be >= 0"):
        BeamSearchParams(beam_width=2, max_tokens=2, temperature=-1.0)


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


BEAM_PARAMS = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
BEAM_PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


@pytest.fixture(scope="module")
def llm_beams(tiny_model_dir: Path) -> BeamSearchOutput:
    with LLM(str(tiny_model_dir), max_model_len=64, num_threads=1) as llm:
        (expected,) = llm.beam_search([BEAM_PROMPT], BEAM_PARAMS)
    return expected


@pytest.mark.anyio
async def test_async_beam_search_equals_llm_and_cancels_cleanly(
    tiny_model_dir: Path, llm_beams: BeamSearchOutput
) -> None:
    """`AsyncLLM.beam_search` yields one finished RequestOutput with the same beams as
    `LLM.beam_search`; cancelling it mid-search aborts its round and leaves nothing running."""
    import anyio

    from triollm import AsyncEngineArgs, AsyncLLM

    params, prompt, expected = BEAM_PARAMS, BEAM_PROMPT, llm_beams
    args = AsyncEngineArgs(model=str(tiny_model_dir), max_model_len=64, num_threads=1, multiprocess=False)
    async with AsyncLLM.from_engine_args(args) as engine:
        outs = [o async for o in engine.beam_search(prompt, "b1", params)]
        assert len(outs) == 1 and outs[0].finished and outs[0].request_id == "b1"
        assert [c.token_ids for c in outs[0].outputs] == [s.tokens[4:] for s in expected.sequences]
        assert [c.cumulative_logprob for c in outs[0].outputs] == pytest.approx(
            [s.cum_logprob for s in expected.sequences]
        )
        # The async path's text is the generated part; LLM.beam_search's the whole sequence (vLLM's).
        decode = engine.get_tokenizer().decode
        assert [c.text for c in outs[0].outputs] == [
            decode(s.tokens[4:], skip_special_tokens=True) for s in expected.sequences
        ]
        assert [s.text for s in expected.sequences] == [
            decode(s.tokens, skip_special_tokens=True) for s in expected.sequences
        ]
        with anyio.move_on_after(0.05):
            async for _ in engine.beam_search(
                prompt, "b2", BeamSearchParams(beam_width=4, max_tokens=60, ignore_eos=True)
            ):
                pass
        await engine.wait_idle()
        assert engine.num_unfinished_requests == 0
