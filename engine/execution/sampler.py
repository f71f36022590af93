"""Batched sampling: one call turns a step's logits [N, V] into N tokens (plus logprobs).

Order (vLLM v1): logprobs come from the *raw* logits (log_softmax before any processing). Then
the logit processors: allowed_token_ids mask, bad words, min_tokens (bans EOS and
stop_token_ids — EOS even with ignore_eos, as vLLM does), logit_bias, penalties (repetition over
prompt+output, then frequency/presence over output). Greedy rows take the argmax; random rows
go through temperature, top-k, top-p, min-p and then inverse transform sampling: the first
token whose running sum of probabilities passes u * total, for one uniform u a row (float64),
summed in double (on CPU the native kernel, kernels/csrc/sampling.cpp; elsewhere a float64
cumsum). It draws the same distribution as vLLM's exponential race argmax(p / q), q ~ Exp(1),
with one random number a row instead of V: at a 49k-token vocabulary the race's draw from torch's
generator was most of a sampled step's time. A seeded row's u is a hash of its seed and the index
of the output token it samples (`seeded_uniform`), not the next draw of a stream: its tokens do
not depend on the rest of the batch, on preemption, or on how many drafts speculation checked
(drafts rejected at one step consume nothing a later token would have drawn). Unseeded rows
share one draw from the global RNG. A token of probability 0 is never chosen.

Rows with a grammar (structured outputs) are masked to the tokens it allows first, before the
logprobs, as vLLM does (engine/structured_outputs.py).

Every processor runs only on the rows that need it, gathered by index, so the common batch
(greedy or plain temperature) costs a handful of tensor ops. Everything is fp32. A row's
token-id lists come prepared (`SamplingPlan`, built once per request): a step does not rebuild
or deduplicate them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import Any

import torch

from triollm.engine.execution.sampling_plan import SamplingPlan
from triollm.engine.request import Logprobs
from triollm.engine.sampling_params import SamplingParams
from triollm.engine.structured_outputs import apply_bitmask, fill_bitmask
from triollm.kernels import cpu_native

__all__ = ["Sampler", "SamplerOutput", "SamplingRow", "gather_logprobs", "process_logits", "seeded_uniform"]

_NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """One sequence being sampled this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: list[int]
    bad_words_token_ids: list[list[int]]
    # The request's prepared plan (`Request.sampling_plan`); prepared here when not given.
    plan: InitVar[SamplingPlan | None] = None
    # The request's grammar matcher (structured outputs): tokens it does not allow are masked.
    grammar: Any = None
    prepared: SamplingPlan = field(init=False, repr=False)

    def __post_init__(self, plan: SamplingPlan | None) -> None:
        if plan is None:
            plan = SamplingPlan.prepare(self.params, self.eos_token_ids, self.bad_words_token_ids)
        self.prepared = plan


@dataclass
class SamplerOutput:
    token_ids: list[int]  # the sampled token per row
    # Per row: [sampled, top-k...] with k = that row's params.logprobs (-1: the whole vocab).
    # Rows that did not ask get empty lists and rank 0. None when no row asked.
    logprobs: Logprobs | None
    # With drafts (speculative decoding): per row, whether its draft token was accepted.
    accepted: list[bool] | None = None


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logprobs [N, V], token_ids [N] -> (ids [N, 1+k], lps [N, 1+k], ranks [N]).

    Column 0 is the given token, then the top-k most likely first; rank = 1 + the number of
    tokens with a strictly greater logprob.
    """
    token_ids = token_ids.long().unsqueeze(-1)
    token_lps = logprobs.gather(-1, token_ids)
    ranks = (logprobs > token_lps).sum(-1) + 1
    if k <= 0:
        return token_ids, token_lps, ranks
    top_lps, top_ids = logprobs.topk(k, dim=-1)
    return torch.cat([token_ids, top_ids], 1), torch.cat([token_lps, top_lps], 1), ranks


def _num_logprobs(params: SamplingParams, vocab_size: int) -> int | None:
    k = params.logprobs
    return vocab_size if k == -1 else k


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], drafts: list[int] | None = None) -> SamplerOutput:
        """Sample a token per row; with `drafts` (speculative decoding: per row the draft token
        its sample is checked against, or -1), check each draft row's token instead (`verify`)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {logits.shape}")
        logits = logits.float()
        vocab = logits.shape[1]
        structured = [i for i, r in enumerate(rows) if r.grammar is not None]
        if structured:  # before logprobs, as vLLM: they are those of the constrained distribution
            bitmask = fill_bitmask([rows[i].grammar for i in structured], vocab)
            if len(structured) == len(rows):
                logits = apply_bitmask(logits, bitmask)
            else:
                logits[structured] = apply_bitmask(logits[structured], bitmask)
        ks = [_num_logprobs(r.params, vocab) for r in rows]
        raw_logprobs = None if all(k is None for k in ks) else logits.log_softmax(-1)
        logits = process_logits(logits, rows)
        accepted = None
        if drafts is not None and any(d >= 0 for d in drafts):
            token_ids, accepted = verify(logits, rows, drafts)
        else:
            token_ids = self._sample(logits, rows)
        output = None if raw_logprobs is None else _logprobs_output(raw_logprobs, token_ids, ks)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=output, accepted=accepted)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        greedy = [r.params.is_greedy for r in rows]
        if all(greedy):
            return argmax(logits)
        if not any(greedy):
            return _random_sample(logits, rows)
        token_ids = argmax(logits)
        idx = [i for i, g in enumerate(greedy) if not g]
        token_ids[idx] = _random_sample(logits[idx], [rows[i] for i in idx])
        return token_ids


def verify(logits: torch.Tensor, rows: list[SamplingRow], drafts: list[int]) -> tuple[torch.Tensor, list[bool]]:
    """Speculative decoding's check of draft tokens against the target's processed logits.

    Row i with a draft d (`drafts[i] >= 0`) is the target's distribution p at the position d was
    proposed for. Greedy rows accept d when it is p's argmax, and otherwise emit the argmax.
    Random rows sample x from p exactly as a row without a draft does (same uniform, same
    token) and accept d when x = d. The proposal is deterministic (the n-gram lookup and the
    draft model propose their argmax: q is one-hot at d), so this is Leviathan et al.'s rule
    coupled to the plain sample: d is accepted with probability p(d) = min(1, p(d) / q(d)), and on
    rejection x is distributed as p with d removed, renormalised (the residual max(0, p - q)).
    The emitted token is the one the row would have sampled without speculation, so a seeded
    request's tokens are the same with drafts, without, and whatever was accepted.

    Returns the token per row (for an accepted row: its draft) and per row whether its draft was
    accepted (False for rows without one)."""
    token_ids = argmax(logits)
    random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if random_rows:
        token_ids[random_rows] = _random_sample(logits[random_rows], [rows[i] for i in random_rows])
    draft_t = torch.tensor(drafts, device=logits.device)
    accepted_t = (token_ids == draft_t) & (draft_t >= 0)
    return token_ids, accepted_t.tolist()


def _logprobs_output(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, ks: list[int | None]
) -> Logprobs:
    max_k = max(k or 0 for k in ks)
    ids_t, lps_t, ranks_t = gather_logprobs(raw_logprobs, token_ids, max_k)
    ids, lps, ranks = ids_t.tolist(), lps_t.tolist(), ranks_t.tolist()
    out = Logprobs(token_ids=[], logprobs=[], ranks=[])
    for i, k in enumerate(ks):
        width = 0 if k is None else 1 + k
        out.token_ids.append(ids[i][:width])
        out.logprobs.append(lps[i][:width])
        out.ranks.append(0 if k is None else ranks[i])
    return out


# --------------------------------------------------------------------------- logit processors

_RowFn = Callable[[SamplingRow], bool]


def _rows_where(rows: list[SamplingRow], pred: _RowFn) -> list[int]:
    return [i for i, r in enumerate(rows) if pred(r)]


def _needs_penalties(r: SamplingRow) -> bool:
    p = r.params
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _in_min_tokens(r: SamplingRow) -> bool:
    return len(r.output_token_ids) < r.params.min_tokens


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The logits after every row's processors; never modifies `logits` in place."""
    allowed = _rows_where(rows, lambda r: r.prepared.allowed_token_ids is not None)
    banned = _banned_pairs(rows)
    biased = _rows_where(rows, lambda r: r.prepared.logit_bias_ids is not None)
    penalized = _rows_where(rows, _needs_penalties)
    if not (allowed or banned[0] or biased or penalized):
        return logits
    logits = logits.clone()
    if allowed:
        _apply_allowed(logits, rows, allowed)
    if banned[0]:
        logits[banned] = _NEG_INF
    if biased:
        _apply_logit_bias(logits, rows, biased)
    if penalized:
        logits[penalized] = _penalize(logits[penalized], [rows[i] for i in penalized])
    return logits


def _apply_allowed(logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> None:
    device = logits.device
    mask = torch.ones(len(idx), logits.shape[1], dtype=torch.bool, device=device)
    ids = [_allowed(rows[i]) for i in idx]
    mask[_row_index(ids, device), torch.cat(ids).to(device)] = False
    logits[idx] = logits[idx].masked_fill(mask, _NEG_INF)


def _banned_pairs(rows: list[SamplingRow]) -> tuple[list[int], list[int]]:
    """(row, token) pairs set to -inf: bad words and, below min_tokens, EOS/stop tokens."""
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, r in enumerate(rows):
        plan = r.prepared
        toks = plan.bad_words.bans(r.output_token_ids) if plan.bad_words is not None else []
        if _in_min_tokens(r):
            toks += plan.min_tokens_bans
        row_idx += [i] * len(toks)
        tok_idx += toks
    return row_idx, tok_idx


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> None:
    device = logits.device
    ids = [_bias(rows[i])[0] for i in idx]
    values = torch.cat([_bias(rows[i])[1] for i in idx]).to(device)
    row_idx = torch.tensor(idx, dtype=torch.long, device=device)[_row_index(ids, device)]
    logits.index_put_((row_idx, torch.cat(ids).to(device)), values, accumulate=True)


def _row_index(per_row: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[0, 0, 1, 2, 2, 2, ...]: the position in `per_row` of each element of their concatenation."""
    lens = [len(t) for t in per_row]
    counts = torch.tensor(lens, dtype=torch.long, device=device)
    # output_size given: no device-to-host sync to size the result (on CUDA)
    return torch.repeat_interleave(torch.arange(len(per_row), device=device), counts, output_size=sum(lens))


def _allowed(r: SamplingRow) -> torch.Tensor:
    ids = r.prepared.allowed_token_ids
    assert ids is not None  # only rows that have them are gathered
    return ids


def _bias(r: SamplingRow) -> tuple[torch.Tensor, torch.Tensor]:
    ids, values = r.prepared.logit_bias_ids, r.prepared.logit_bias_values
    assert ids is not None and values is not None  # only rows that have them are gathered
    return ids, values


def _token_presence(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Counts [len(token_lists), vocab] of each token in each list (fp32)."""
    counts = torch.zeros(len(token_lists), vocab, device=device)
    rows = torch.tensor([i for i, t in enumerate(token_lists) for _ in t], dtype=torch.long, device=device)
    toks = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    counts.index_put_((rows, toks), torch.ones(len(toks), device=device), accumulate=True)
    return counts


def _penalize(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    vocab, device = logits.shape[1], logits.device
    output_counts = _token_presence([r.output_token_ids for r in rows], vocab, device)
    reps = [r.params.repetition_penalty for r in rows]
    if any(p != 1.0 for p in reps):
        rep = torch.tensor(reps, device=device).unsqueeze(1)
        seen = _token_presence([r.prompt_token_ids for r in rows], vocab, device) + output_counts > 0
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=device).unsqueeze(1)
    pres = torch.tensor([r.params.presence_penalty for r in rows], device=device).unsqueeze(1)
    return logits - freq * output_counts - pres * (output_counts > 0).float()


# --------------------------------------------------------------------------- random sampling


def _random_sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    probs = _probs(logits, rows)
    return _inverse_cdf(probs, _uniform(probs, rows))


def _probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution random rows are sampled from, up to scale: temperature, top-k, top-p,
    then min-p (whose zeros are not renormalised away: the race ignores scale)."""
    temps = [r.params.temperature for r in rows]
    if any(t != 1.0 for t in temps):
        logits = logits / torch.tensor(temps, device=logits.device).unsqueeze(1)
    truncate = _rows_where(rows, lambda r: r.params.top_k > 0 or r.params.top_p < 1.0)
    if truncate:
        logits = logits.clone()
        logits[truncate] = _top_k_top_p(logits[truncate], [rows[i] for i in truncate])
    probs = logits.softmax(-1)
    min_p = _rows_where(rows, lambda r: r.params.min_p > 0.0)
    if min_p:
        probs[min_p] = _min_p(probs[min_p], [rows[i].params.min_p for i in min_p])
    return probs


def _top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Keep each row's top-k logits (exactly k, ties broken arbitrarily), then the smallest
    most-likely-first prefix of those whose renormalised mass reaches top_p; the rest -> -inf.

    When every row has a top-k, only the max-k largest are sorted (topk), not the vocabulary.
    """
    vocab, device = logits.shape[1], logits.device
    ks = [r.params.top_k if r.params.top_k > 0 else vocab for r in rows]
    width = min(max(ks), vocab)
    if width < vocab:
        values, order = logits.topk(width, -1)
    else:
        values, order = logits.sort(-1, descending=True)
    position = torch.arange(width, device=device)
    values = values.masked_fill(position >= torch.tensor(ks, device=device).unsqueeze(1), _NEG_INF)
    top_ps = [r.params.top_p for r in rows]
    if any(p < 1.0 for p in top_ps):
        ps = torch.tensor(top_ps, device=device).unsqueeze(1)
        probs = values.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # the first token always has 0 < p
        values = values.masked_fill((mass_before >= ps) & (ps < 1.0), _NEG_INF)
    return torch.full_like(logits, _NEG_INF).scatter_(1, order, values)


def _min_p(probs: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    threshold = probs.amax(-1, keepdim=True) * torch.tensor(min_ps, device=probs.device).unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def _uniform(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """U(0, 1) per row, float64: the unseeded rows from the global RNG, each seeded row from its
    seed and the index of the output token it samples (`seeded_uniform`)."""
    n = len(rows)
    seeded = [(i, seed, len(r.output_token_ids)) for i, r in enumerate(rows) if (seed := r.params.seed) is not None]
    if not seeded:
        return torch.rand(n, dtype=torch.float64, device=probs.device)
    u = torch.empty(n, dtype=torch.float64) if len(seeded) == n else torch.rand(n, dtype=torch.float64)
    for i, seed, index in seeded:
        u[i] = seeded_uniform(seed, index)
    return u.to(probs.device)


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers whose every output bit depends on
    every input bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, index: int) -> float:
    """The uniform a request with `seed` samples its `index`-th output token with: 53 random bits
    in [0, 1), a pure function of the two (counter-based, as Philox is), so a token's draw does
    not depend on how many were drawn before it. Requests fanned out by `n` carry seed + i."""
    x = _mix64((seed & _MASK64) ^ 0x9E3779B97F4A7C15)
    x = _mix64((x + (index + 1) * 0xD1B54A32D192ED03) & _MASK64)
    return (x >> 11) * 2.0**-53


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` for fp32 `[B, V]`, by the native kernel on CPU (kernels/csrc/sampling.cpp
    `greedy_argmax`: torch's answer, NaN and ties included, without its scalar loop)."""
    if logits.device.type == "cpu" and cpu_native.available():
        return cpu_native.greedy_argmax(logits.float())
    return logits.argmax(-1)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` (up to scale) the first token whose running sum passes u * total, in
    double: never a token of probability 0 (its running sum equals its predecessor's)."""
    if probs.device.type == "cpu" and cpu_native.available():
        return cpu_native.sample_inverse_cdf(probs.float(), u)
    cdf = probs.double().cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    token_ids = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max(probs.shape[1] - 1)
    # u < 1 keeps the target below the total up to rounding; a rounding that lands on a token of
    # probability 0 takes the likeliest token instead.
    chosen = probs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    return torch.where(chosen > 0, token_ids, probs.argmax(-1))
