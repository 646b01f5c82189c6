"""Chunked prefill: a prompt longer than the step's token budget is computed in chunks
between the running streams' decodes, gives the logits an unchunked run gives, and a crash
in the middle of it resumes at its last chunk, not at the start of the prompt."""

from __future__ import annotations

import math

import pytest
import torch

from phoenixft.serve import EngineConfig, SamplingParams
from phoenixft.serve.engine.llm_engine import LLMEngine
from phoenixft.serve.recovery.recorder import Recorder
from phoenixft.serve.recovery.restore import recover

BUDGET = 64
STREAMS = 8
LONG = 900  # the longest prompt the 1,024-position test model takes with room to decode


def _engine(path, budget: int = BUDGET) -> LLMEngine:
    return LLMEngine(path, EngineConfig(max_model_len=1024, block_size=16, max_num_seqs=16,
                                        max_num_batched_tokens=budget))


def _long_prompt() -> list[int]:
    return [6 + (i * 37) % 120 for i in range(LONG)]


def _streams(eng: LLMEngine) -> None:
    for i in range(STREAMS):
        eng.add_request(f"s{i}", [6 + i, 9, 12, 40 + i] * 5,
                        SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    while not all(len(eng.seqs[f"s{i}"].completion_token_ids) for i in range(STREAMS)):
        eng.step()


@pytest.mark.timeout(120)
def test_a_long_prompt_is_prefilled_in_chunks_while_the_streams_decode(long_model):
    eng = _engine(long_model)
    _streams(eng)
    eng.add_request("long", _long_prompt(), SamplingParams(max_tokens=8, temperature=0.0,
                                                           ignore_eos=True, logprobs=0))
    long = eng.seqs["long"]
    steps, starved = 0, []
    while not long.completion_token_ids:
        got = {o.request_id for o in eng.step()}
        steps += 1
        # every stream decodes in every step of the long prefill: none waits a step
        starved += [s for s in (f"s{i}" for i in range(STREAMS)) if s not in got]
    assert starved == []
    # the step's budget, less one token for each decoding stream, went to the prompt
    assert steps == math.ceil(LONG / (BUDGET - STREAMS))
    while eng.has_unfinished():
        eng.step()
    # the same tokens and logits as the prompt computed in one piece
    ref = _engine(long_model, budget=4096)
    ref.add_request("long", _long_prompt(), SamplingParams(max_tokens=8, temperature=0.0,
                                                           ignore_eos=True), keep_logits=True)
    chunked = _engine(long_model)
    chunked.add_request("long", _long_prompt(), SamplingParams(max_tokens=8, temperature=0.0,
                                                               ignore_eos=True), keep_logits=True)
    a, b = ref.seqs["long"], chunked.seqs["long"]
    for e in (ref, chunked):
        while e.has_unfinished():
            e.step()
    assert a.completion_token_ids == b.completion_token_ids == long.completion_token_ids
    torch.testing.assert_close(torch.stack(b.logits), torch.stack(a.logits), atol=1e-4, rtol=0)


@pytest.mark.timeout(120)
def test_a_crash_mid_prompt_resumes_at_its_last_chunk(long_model, tmp_path):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    ref = _engine(long_model)
    want = ref.add_request("long", _long_prompt(), params)  # (the engine forgets it at its end)
    while ref.has_unfinished():
        ref.step()

    eng = _engine(long_model)
    eng.recorder = Recorder(eng, tmp_path / "log", epoch_interval_s=1.0)
    eng.add_request("long", _long_prompt(), params)
    seq = eng.seqs["long"]
    while seq.num_computed_tokens < 5 * BUDGET:  # five chunks in, many to go
        eng.step()
    assert eng.recorder.drain()  # every chunk's step is in the log (none is merged)
    done = seq.num_computed_tokens
    assert 0 < done < LONG and not seq.completion_token_ids
    eng.recorder.close()  # the engine dies mid-prompt; only the log is left
    new = _engine(long_model)
    report = recover(new, tmp_path / "log")
    resumed = new.seqs["long"]
    assert report.resumed == ["long"] and resumed.num_computed_tokens == done
    while new.has_unfinished():
        new.step()
    # the finished chunks were not computed again: only the rest of the prompt was
    assert resumed.prompt_computed == LONG - done
    assert resumed.completion_token_ids == want.completion_token_ids  # an uninterrupted run's
