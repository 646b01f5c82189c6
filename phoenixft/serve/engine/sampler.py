"""Next-token choice for a batch: greedy, temperature, top-k, top-p, per-request seeds.

The random number for a request's i-th generated token is ``uniform(seed, i)``, a pure
function (splitmix64) rather than a generator whose state advances. Hence a seeded
request gives the same tokens whatever else shares its batch, after a preemption that
recomputes it, and after a crash-recovery that replays it: there is no RNG state to save.
"""

from __future__ import annotations

import torch

from .sequence import Sequence

_MASK64 = (1 << 64) - 1


def uniform(seed: int, index: int) -> float:
    """A float in [0, 1) determined by (seed, index) alone (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def penalize(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The logits after each request's repetition, presence and frequency penalties and
    logit bias (a copy when any applies; the raw logits stay for logprobs). Penalties look
    at the tokens generated so far (repetition: the prompt's too), as vLLM's do."""
    rows = [i for i, s in enumerate(seqs) if s.params.penalized]
    if not rows:
        return logits
    out = logits.clone()
    vocab = logits.shape[-1]
    for i in rows:
        s, p, row = seqs[i], seqs[i].params, out[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(s.token_ids)), dtype=torch.long)
            v = row[seen]
            row[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            gen = torch.tensor(s.completion_token_ids, dtype=torch.long)
            counts = torch.bincount(gen, minlength=vocab).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)
    return out


def logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list:
    """For each row whose request asked for logprobs: (the chosen token's log-probability,
    [(token, log-probability)] of the k most likely), from the model's own distribution
    (the raw logits, before temperature and penalties, as OpenAI and vLLM report them);
    None for the other rows."""
    out: list = [None] * len(seqs)
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return out
    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    k = max(seqs[i].params.logprobs for i in rows)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    for n, i in enumerate(rows):
        kk = seqs[i].params.logprobs
        out[i] = (float(lp[n, tokens[i]]),
                  list(zip(top_i[n, :kk].tolist(), top_v[n, :kk].tolist())))
    return out


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits [batch, vocab] (row i belongs to seqs[i], penalties applied) -> one token id
    per row."""
    out = logits.argmax(dim=-1).tolist()
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if not rows:
        return out
    sub = logits[rows].double()
    temps = torch.tensor([seqs[i].params.temperature for i in rows], dtype=torch.float64)
    sub = sub / temps[:, None]
    sorted_logits, order = sub.sort(dim=-1, descending=True)
    vocab = sub.shape[-1]
    ranks = torch.arange(vocab)
    top_k = torch.tensor([min(seqs[i].params.top_k or vocab, vocab) for i in rows])
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    top_p = torch.tensor([seqs[i].params.top_p for i in rows], dtype=torch.float64)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    probs = probs.masked_fill(before >= top_p[:, None], 0.0)
    cdf = probs.cumsum(dim=-1)
    u = torch.tensor([uniform(seqs[i].seed, seqs[i].num_completion_tokens) for i in rows],
                     dtype=torch.float64) * cdf[:, -1]
    pick = torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=vocab - 1)
    # a zero-probability token can only be picked at the cdf's flat tail; step back to it
    kept = (probs > 0).sum(dim=-1, keepdim=True) - 1
    pick = torch.minimum(pick, kept)
    chosen = order.gather(1, pick).squeeze(1).tolist()
    for r, tok in zip(rows, chosen):
        out[r] = tok
    return out
