"""Batch sampler: processors, truncation, seeding, greedy and logprobs (small vocab, fast)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2

from triollm.engine.execution.sampler import (
    Sampler,
    SamplingRow,
    gather_logprobs,
    process_logits,
    seeded_uniform,
)
from triollm.engine.sampling_params import SamplingParams
from triollm.kernels import cpu_native

V = 50
sampler = Sampler()


@pytest.fixture(autouse=True)
def _seed_global_rng() -> None:
    torch.manual_seed(1234)  # unseeded rows use the global RNG: keep the tests deterministic


def make_row(
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    eos: Sequence[int] = (),
    bad: Sequence[Sequence[int]] = (),
    **params: Any,
) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), list(eos), [list(b) for b in bad])


def rand_logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def sample_many(logits_row: torch.Tensor, n: int = 200, **kw: Any) -> set[int]:
    rows = [make_row(**kw) for _ in range(n)]
    return set(sampler(logits_row.expand(n, -1).clone(), rows).token_ids)


# --------------------------------------------------------------------------- greedy, logprobs


def test_greedy_is_argmax_and_input_untouched() -> None:
    logits = rand_logits(8)
    before = logits.clone()
    out = sampler(logits, [make_row(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_mixed_batch_greedy_rows_stay_argmax() -> None:
    logits = rand_logits(6, seed=1)
    rows = [make_row(temperature=0.0 if i % 2 else 1.5) for i in range(6)]
    out = sampler(logits, rows)
    argmax = logits.argmax(-1).tolist()
    assert all(out.token_ids[i] == argmax[i] for i in (1, 3, 5))


def brute_force_logprobs(lp: torch.Tensor, tok: int, k: int) -> tuple[list[int], int]:
    order = sorted(range(lp.numel()), key=lambda t: -lp[t].item())
    rank = 1 + sum(1 for t in range(lp.numel()) if lp[t] > lp[tok])
    return [tok] + order[:k], rank


@pytest.mark.parametrize("k", [0, 1, 5, V])
def test_gather_logprobs_matches_brute_force(k: int) -> None:
    lp = rand_logits(7, seed=2).log_softmax(-1)
    lp[0, 3] = lp[0, 4]  # a tie: rank counts strictly greater only
    toks = torch.tensor([3, 0, 49, 7, 7, 1, 20])
    ids, lps, ranks = gather_logprobs(lp, toks, k)
    assert ids.shape == lps.shape == (7, 1 + k) and ranks.shape == (7,)
    for i in range(7):
        ref_ids, ref_rank = brute_force_logprobs(lp[i], int(toks[i]), k)
        assert ranks[i].item() == ref_rank
        assert ids[i, 0].item() == toks[i].item()
        assert torch.equal(lps[i], lp[i, ids[i]])
        assert torch.equal(lps[i, 1:], lp[i, ref_ids[1:]])  # same values (ties may reorder ids)
        assert torch.all(lps[i, 1:-1] >= lps[i, 2:])


def test_sampler_logprobs_are_raw_and_shaped_per_row() -> None:
    logits = rand_logits(4, seed=3)
    rows = [
        make_row(logprobs=3, temperature=0.3, repetition_penalty=1.7, output=[1, 2]),
        make_row(),  # no logprobs
        make_row(logprobs=0, temperature=0.0, logit_bias={5: 50.0}),
        make_row(logprobs=-1, presence_penalty=1.0, output=[0]),
    ]
    out = sampler(logits, rows)
    assert out.logprobs is not None
    raw = logits.log_softmax(-1)
    lp = out.logprobs
    assert [len(x) for x in lp.token_ids] == [4, 0, 1, V + 1]
    assert [len(x) for x in lp.logprobs] == [4, 0, 1, V + 1]
    assert lp.ranks[1] == 0 and lp.logprobs[1] == []
    assert out.token_ids[2] == 5  # the bias wins the argmax...
    for i in (0, 2, 3):
        tok = out.token_ids[i]
        assert lp.token_ids[i][0] == tok
        assert lp.logprobs[i][0] == pytest.approx(raw[i, tok].item())  # ...but logprobs are raw
        ref_ids, ref_rank = brute_force_logprobs(raw[i], tok, len(lp.token_ids[i]) - 1)
        assert lp.token_ids[i] == ref_ids and lp.ranks[i] == ref_rank


# --------------------------------------------------------------------------- seeding


def run_seeded(seed: int, others: list[SamplingRow], steps: int = 10) -> list[int]:
    target = make_row(seed=seed, temperature=1.2, top_k=30, top_p=0.95)
    tokens = []
    for step in range(steps):
        logits = rand_logits(1 + len(others), seed=100 + step)
        logits[0] = rand_logits(1, seed=step)[0]  # the seeded row's logits do not change
        tokens.append(sampler(logits, [target, *others]).token_ids[0])
        target.output_token_ids.append(tokens[-1])
    return tokens


def test_seeded_rows_reproduce_regardless_of_batch() -> None:
    alone = run_seeded(7, [])
    crowded = run_seeded(7, [make_row(), make_row(seed=7), make_row(temperature=0.0)] * 3)
    other = run_seeded(7, [make_row(min_p=0.2, seed=99), make_row(presence_penalty=1.0)])
    assert alone == crowded == other
    assert run_seeded(8, []) != alone


def test_seeded_uniform_is_uniform_and_independent_of_seed_and_index() -> None:
    """The counter-based draw: for 200 seeds (n's fan-out seed + i) x 100 output indices, each
    decile holds a tenth of the draws (chi-square), neighbouring seeds and neighbouring indices
    are uncorrelated, and no two draws coincide."""
    draws = torch.tensor([[seeded_uniform(s, k) for k in range(100)] for s in range(200)], dtype=torch.float64)
    assert float(draws.min()) >= 0.0 and float(draws.max()) < 1.0
    counts = torch.bincount((draws * 10).long().flatten(), minlength=10).double()
    stat = float(((counts - 2000.0) ** 2 / 2000.0).sum())
    assert stat < chi2.ppf(0.999, 9), counts.tolist()
    for a, b in ((draws[:-1], draws[1:]), (draws[:, :-1], draws[:, 1:])):
        r = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(float(r)) < 0.03
    assert len(set(draws.flatten().tolist())) == draws.numel()
    assert seeded_uniform(-1, 0) == seeded_uniform((1 << 64) - 1, 0)  # a negative seed is its 64-bit pattern


def test_a_seeded_rows_draw_follows_its_output_index() -> None:
    """A seeded row's k-th output token is drawn with the k-th uniform whatever was sampled for it
    before (rows are stateless: speculation's rejected rows and a preempted request's recomputed
    steps consume nothing), and different indices draw differently."""
    logits = rand_logits(1, seed=4)

    def at(k: int) -> int:
        return sampler(logits.clone(), [make_row(output=[1] * k, seed=5, temperature=1.0)]).token_ids[0]

    tokens = [at(k) for k in range(30)]
    assert tokens == [at(k) for k in reversed(range(30))][::-1]
    want = [int(torch.nonzero(logits[0].softmax(-1).double().cumsum(0) > seeded_uniform(5, k))[0]) for k in range(30)]
    assert tokens == want and len(set(tokens)) > 3


def test_seeded_row_position_in_batch_does_not_matter() -> None:
    logits = rand_logits(1, seed=5).expand(4, -1).clone()
    first = sampler(logits, [make_row(seed=3), make_row(), make_row(), make_row()]).token_ids[0]
    last = sampler(logits, [make_row(), make_row(), make_row(), make_row(seed=3)]).token_ids[3]
    assert first == last


# --------------------------------------------------------------------------- truncation


def descending_logits() -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct logits; token t has the (t+1)-th largest, scattered over the vocab."""
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(9))
    logits = torch.empty(V)
    logits[perm] = -torch.arange(V, dtype=torch.float32) * 0.2
    return logits, perm


def test_top_k_keeps_exactly_the_top_k() -> None:
    logits, perm = descending_logits()
    got = sample_many(logits, n=400, top_k=4, temperature=2.0)
    assert got == set(perm[:4].tolist())


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1] + [0.1 / (V - 4)] * (V - 4))
    logits = probs.log()
    assert sample_many(logits, n=400, top_p=0.7) == {0, 1, 2}
    assert sample_many(logits, n=400, top_p=0.3) == {0}


def test_top_p_applies_to_the_renormalised_top_k() -> None:
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1] + [0.1 / (V - 4)] * (V - 4))
    # Over the top 3 the masses are 0.5, 0.31, 0.19: 0.45 is reached by token 0 alone.
    assert sample_many(probs.log(), n=400, top_k=3, top_p=0.45) == {0}
    assert sample_many(probs.log(), n=400, top_p=0.45) == {0, 1}


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1] + [0.1 / (V - 4)] * (V - 4))
    assert sample_many(probs.log(), n=400, min_p=0.3) == {0, 1, 2}


def test_per_row_truncation_in_one_batch() -> None:
    logits, perm = descending_logits()
    rows = [
        make_row(top_k=2, temperature=3.0),
        make_row(top_k=6, temperature=3.0),
        make_row(temperature=3.0),
    ] * 150
    out = sampler(logits.expand(len(rows), -1).clone(), rows).token_ids
    assert set(out[0::3]) == set(perm[:2].tolist())
    assert set(out[1::3]) == set(perm[:6].tolist())
    assert len(set(out[2::3])) > 6
    # A top-p row in the batch forces the full-sort path; the top-k rows must not change.
    rows.append(make_row(top_p=0.5, temperature=3.0))
    out = sampler(logits.expand(len(rows), -1).clone(), rows).token_ids
    assert set(out[0:-1:3]) == set(perm[:2].tolist())
    assert set(out[1:-1:3]) == set(perm[:6].tolist())


def test_random_sampling_follows_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]) / 0.5
    n = 4000
    rows = [make_row(temperature=0.5) for _ in range(n)]
    out = torch.tensor(sampler((logits * 0.5).expand(n, -1).clone(), rows).token_ids)
    freq = torch.bincount(out, minlength=4).float() / n
    assert torch.allclose(freq, logits.softmax(-1), atol=0.03)


def _inverse_cdf_paths() -> list[str]:
    from triollm.kernels import cpu_native

    return ["torch", "native"] if cpu_native.available() else ["torch"]


def _inverse_cdf(path: str, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The native kernel, or the sampler's torch path (what CUDA runs) with the kernel hidden."""
    from unittest import mock

    from triollm.engine.execution import sampler as sampler_module

    if path == "native":
        return sampler_module.cpu_native.sample_inverse_cdf(probs, u)
    with mock.patch.object(sampler_module.cpu_native, "available", lambda: False):
        return sampler_module._inverse_cdf(probs, u)


@pytest.mark.parametrize("path", _inverse_cdf_paths())
def test_inverse_cdf_picks_the_first_token_past_u_times_the_total(path: str) -> None:
    """Inverse transform sampling against a brute-force float64 scan, on unnormalised rows with
    zeros (masked tokens) across the native kernel's 256-token blocks: the same token for every u,
    a zero never, and u = 0 or just below 1 stay inside the row's positive tokens."""
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(6, 1000, generator=g) * 3.0
    probs[probs < 1.2] = 0.0  # ~40% masked, runs of zeros at block edges included
    probs[2, :] = 0.0
    probs[2, 517] = 0.25  # one positive token
    probs[3, 700:] = 0.0  # a masked tail: u near 1 must not fall into it
    probs[4, :300] = 0.0  # a masked head: u = 0 must not either
    for u_value in (0.0, 1e-9, 0.3, 0.5, 0.999, 1.0 - 2.0**-53):
        u = torch.full((6,), u_value, dtype=torch.float64)
        u[5] = torch.rand(1, generator=g, dtype=torch.float64).item()
        got = _inverse_cdf(path, probs, u)
        for b in range(6):
            row = probs[b].double()
            cdf = row.cumsum(0)
            want = int(torch.nonzero(cdf > u[b] * cdf[-1])[0])
            assert probs[b, got[b]] > 0, (u_value, b)
            assert got[b].item() == want, (u_value, b, got[b].item(), want)


@pytest.mark.parametrize("path", _inverse_cdf_paths())
def test_inverse_cdf_follows_the_distribution(path: str) -> None:
    """20,000 draws (4,000 on the slower torch path) over a 49k-token row whose mass sits on 5
    tokens and a long tail: each token's frequency within 4 standard deviations of its
    probability, the tail's too."""
    n, vocab = (20_000 if path == "native" else 4_000), 49_152
    probs = torch.full((1, vocab), 1e-6)
    heads = torch.tensor([3, 4_000, 25_000, 40_000, 49_151])
    probs[0, heads] = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.1])
    probs /= probs.sum()
    u = torch.rand(n, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    rows = probs.expand(500, -1).contiguous()
    got = torch.cat([_inverse_cdf(path, rows, u[i : i + 500]) for i in range(0, n, 500)])
    counts = torch.bincount(got, minlength=vocab).double()
    expected = probs[0].double() * n
    for t in heads.tolist():
        assert abs(counts[t] - expected[t]) <= 4 * expected[t].sqrt(), (t, counts[t], expected[t])
    tail = n - counts[heads].sum()
    tail_expected = n - expected[heads].sum()
    assert abs(tail - tail_expected) <= 4 * tail_expected.sqrt() + 1


# --------------------------------------------------------------------------- masks and bans

FLAT = torch.zeros(V)


def test_allowed_token_ids() -> None:
    assert sample_many(FLAT, allowed_token_ids=[3, 17, 42]) == {3, 17, 42}
    greedy = make_row(allowed_token_ids=[3, 17], temperature=0.0)
    logits = torch.zeros(1, V)
    logits[0, 17], logits[0, 5] = 1.0, 9.0
    assert sampler(logits, [greedy]).token_ids == [17]


def test_bad_words() -> None:
    bad = [[7], [1, 2, 9], [3, 4]]
    got = sample_many(FLAT, n=400, output=[5, 1, 2], bad=bad)
    assert 7 not in got and 9 not in got and 4 in got  # [3, 4]: the output doesn't end with 3
    got = sample_many(FLAT, n=400, output=[3], bad=bad)
    assert 7 not in got and 4 not in got and 9 in got
    assert 7 not in sample_many(FLAT, n=400, output=[], bad=bad)


def test_logit_bias_minus_100_is_never_sampled() -> None:
    got = sample_many(FLAT, n=400, logit_bias={i: -100.0 for i in range(0, V, 2)})
    assert got and all(t % 2 == 1 for t in got)


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    logits = torch.zeros(1, V)
    logits[0, 0], logits[0, 1], logits[0, 2] = 9.0, 8.0, 7.0  # eos, stop token, next best
    for n_out, want in [(0, 2), (2, 2), (3, 0)]:
        row = make_row(
            output=[5] * n_out, eos=[0], stop_token_ids=[1], min_tokens=3, temperature=0.0
        )
        assert sampler(logits, [row]).token_ids == [want]
    got = sample_many(logits[0] / 9, n=400, output=[5], eos=[0], stop_token_ids=[1], min_tokens=2)
    assert 0 not in got and 1 not in got


# --------------------------------------------------------------------------- penalties, bias


def reference_process(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """A straightforward, per-token reading of the vLLM rules."""
    out = logits.clone()
    p = row.params
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    seen = set(row.prompt_token_ids) | set(row.output_token_ids)
    for t in seen:
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(row.output_token_ids):
        count = row.output_token_ids.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty
    return out


def test_penalties_and_bias_match_reference() -> None:
    logits = rand_logits(5, seed=11)
    rows = [
        make_row(prompt=[1, 2, 3], output=[3, 3, 4, 10], repetition_penalty=1.5),
        make_row(output=[4, 4, 4, 9], frequency_penalty=0.7, presence_penalty=-0.4),
        make_row(
            prompt=[8, 8],
            output=[8, 2],
            repetition_penalty=0.6,
            frequency_penalty=2.0,
            presence_penalty=1.0,
            logit_bias={2: 3.5, 30: -7.0},
        ),
        make_row(prompt=[1], output=[1]),  # no processing
        make_row(logit_bias={0: 1.0, 49: 100.0}),
    ]
    got = process_logits(logits, rows)
    for i, row in enumerate(rows):
        assert torch.allclose(got[i], reference_process(logits[i], row), atol=1e-6), i
    for r in rows:
        r.params = msgspec.structs.replace(r.params, temperature=0.0)
    assert sampler(logits, rows).token_ids == got.argmax(-1).tolist()


def test_repetition_penalty_direction() -> None:
    logits = torch.zeros(1, V)
    logits[0, 1], logits[0, 2] = 2.0, -2.0
    got = process_logits(logits, [make_row(prompt=[1], output=[2], repetition_penalty=2.0)])
    assert got[0, 1].item() == 1.0 and got[0, 2].item() == -4.0
    assert got[0, 3].item() == 0.0  # unseen tokens untouched


def test_every_processor_keeps_to_the_logits_device() -> None:
    """Each tensor the sampler makes lives on the logits' device (CUDA in production). On CPU the
    meta device stands in: mixing a CPU tensor into a meta computation raises, as mixing it into a
    CUDA one does."""
    from triollm.engine.execution.sampler import _random_sample, process_logits

    rows = [
        make_row(prompt=[1, 2], output=[3], allowed_token_ids=[1, 2, 3, 4], temperature=0.7),
        make_row(output=[5], bad=[[5, 6]], min_tokens=4, eos=[7], logit_bias={8: 2.0}, top_k=5),
        make_row(
            prompt=[9], output=[9, 10], repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2, top_p=0.8
        ),
        make_row(min_p=0.1, seed=3),
        make_row(temperature=1.0, seed=4, top_k=3, top_p=0.5),
    ]
    logits = torch.zeros(len(rows), V, device="meta")
    processed = process_logits(logits, rows)
    assert processed.device.type == "meta" and processed.shape == logits.shape
    tokens = _random_sample(processed, rows)
    assert tokens.device.type == "meta" and tokens.shape == (len(rows),)


@pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels are not built here")
@given(
    st.lists(
        st.lists(
            st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan"), -float("nan")])
            | st.floats(width=32, allow_nan=True),
            min_size=1,
            max_size=70,
        ),
        min_size=1,
        max_size=4,
    ).filter(lambda rows: len({len(r) for r in rows}) == 1)
)
@settings(max_examples=300, deadline=None)
def test_native_argmax_is_torchs(rows: list[list[float]]) -> None:
    """The greedy rows' native argmax (kernels/csrc/sampling.cpp `greedy_argmax`) gives torch's
    answer on any fp32 rows: ties (the first), -0.0 against 0.0, infinities, NaNs of either sign
    (the first NaN)."""
    logits = torch.tensor(rows, dtype=torch.float32)
    assert torch.equal(cpu_native.greedy_argmax(logits), logits.argmax(-1)), rows


@pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels are not built here")
def test_native_argmax_on_a_vocabulary_sized_batch() -> None:
    """64 rows of a 49,152-token vocabulary (the kernel's per-row threads): torch's answer, with a
    planted tie and a planted NaN."""
    logits = torch.randn(64, 49152, generator=torch.Generator().manual_seed(3))
    logits[5, 100] = logits[5, 40000] = 99.0
    logits[9, 30000] = float("nan")
    assert torch.equal(cpu_native.greedy_argmax(logits), logits.argmax(-1))
