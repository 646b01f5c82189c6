"""The recovery log in one process: record while generating, rebuild a fresh engine from
the log alone, and finish with exactly the tokens of an uninterrupted run; damaged logs
are cut at their last valid commit; the ring's back-pressure never loses a step."""

from __future__ import annotations

import os
import signal
import time

import pytest

from phoenixft.serve import LLM, EngineConfig, SamplingParams
from phoenixft.serve.engine.llm_engine import LLMEngine
from phoenixft.serve.recovery.log import KV, _scan, replay, segments
from phoenixft.serve.recovery.recorder import Recorder
from phoenixft.serve.recovery.restore import recover
from phoenixft.serve.recovery.ring import Ring

CFG = EngineConfig(block_size=4, num_blocks=96, max_model_len=128)
PROMPTS = [list(range(3, 40)), list(range(50, 61)), [7, 8, 9, 10, 11] * 6]
PARAMS = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=30, temperature=0.9, seed=5, ignore_eos=True),
          SamplingParams(max_tokens=20, temperature=0.7, top_k=20, seed=11, ignore_eos=True)]


def reference(path) -> dict[str, list[int]]:
    outs = LLM(path, CFG).generate(PROMPTS, PARAMS)
    return {f"r{i}": o.token_ids for i, o in enumerate(outs)}


def recording_engine(path, log_dir, **kw) -> LLMEngine:
    eng = LLMEngine(path, CFG)
    eng.recorder = Recorder(eng, log_dir, **kw)
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
        eng.add_request(f"r{i}", p, sp)
    return eng


def finish(eng: LLMEngine, tokens: dict[str, list[int]]) -> dict[str, list[int]]:
    while eng.has_unfinished():
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def generated(eng: LLMEngine) -> dict[str, list[int]]:
    return {sid: list(s.completion_token_ids) for sid, s in eng.seqs.items()}


@pytest.mark.timeout(120)
def test_a_fresh_engine_resumes_from_the_log_token_for_token(hf_models, tmp_path):
    path = hf_models["llama"][0]
    ref = reference(path)
    eng = recording_engine(path, tmp_path / "log", compact_bytes=12_000)
    for _ in range(9):
        eng.step()
        assert eng.recorder.drain()  # the executor keeps up (it may start after the steps)
    assert eng.recorder.stats.checkpoints >= 2  # compaction ran while serving
    assert len(segments(tmp_path / "log")) == 1  # and dropped the older segments
    before = generated(eng)
    eng.recorder.close()  # the process is gone; only the log is left
    new = LLMEngine(path, CFG)
    report = recover(new, tmp_path / "log")
    assert sorted(report.resumed) == sorted(before) and not report.damage
    assert generated(new) == before
    tokens = finish(new, {sid: list(t) for sid, t in before.items()})
    assert tokens == ref
    assert all(s.prompt_computed == 0 for s in new.scheduler.running)  # no prompt recomputed


@pytest.mark.timeout(120)
def test_torn_tail_and_damaged_record_cut_at_the_last_valid_commit(hf_models, tmp_path):
    path = hf_models["llama"][0]
    ref = reference(path)
    log_dir = tmp_path / "log"
    eng = recording_engine(path, log_dir, compact_bytes=1 << 30, epoch_interval_s=0)  # an epoch a step
    for _ in range(10):
        eng.step()
    assert eng.recorder.drain()
    eng.recorder.close()
    seg = segments(log_dir)[-1]
    full = replay(log_dir)
    # a flipped byte in the middle of epoch 6's KV record (its payload ends at `end`)
    end = next(end for rec, end in _scan(seg) if rec.kind == KV and rec.epoch == 6)
    data = bytearray(seg.read_bytes())
    data[end - 40] ^= 0x01
    seg.write_bytes(bytes(data[:-7]))  # and the last record cut short
    rep = replay(log_dir)
    assert len(rep.damage) == 2, rep.damage  # both reported
    assert "checksum mismatch" in rep.damage[0] and "torn" in rep.damage[1]
    assert rep.last_commit == 5 < full.last_commit
    new = LLMEngine(path, CFG)
    report = recover(new, log_dir)
    assert report.damage and report.last_commit == rep.last_commit
    resumed = generated(new)
    tokens = finish(new, {sid: list(t) for sid, t in resumed.items()})
    assert tokens == ref  # what the lost epochs covered was computed again, identically
    assert not replay(log_dir).damage  # the log now ends at that commit


def test_ring_wraps_and_refuses_when_full_without_losing_anything():
    ring = Ring(capacity=256)
    assert ring.push(1, 0, b"a" * 100) and ring.push(1, 1, b"b" * 100)
    assert not ring.push(1, 2, b"c" * 100)  # full: refused, not dropped
    assert ring.full == 1
    assert ring.pop() == (1, 0, b"a" * 100)
    assert ring.push(1, 2, b"c" * 100)  # wraps around the end
    assert ring.pop() == (1, 1, b"b" * 100) and ring.pop() == (1, 2, b"c" * 100)
    assert ring.pop() is None
    with pytest.raises(ValueError, match="cannot fit"):
        ring.push(1, 3, b"x" * 300)


@pytest.mark.timeout(120)
def test_a_full_ring_merges_steps_and_memory_stays_bounded(hf_models, tmp_path):
    """A tiny ring and a stalled executor process (SIGSTOP): steps are merged into later
    ones (counted), the ring never grows, and once the executor runs on (SIGCONT) the log
    still resumes exactly."""
    path = hf_models["llama"][0]
    ref = reference(path)
    eng = recording_engine(path, tmp_path / "log", ring_bytes=2_600, compact_bytes=1 << 30,
                           mode="process", epoch_interval_s=0)  # every step pushes
    rec = eng.recorder
    eng.step()
    assert rec.drain()
    os.kill(rec.executor.pid, signal.SIGSTOP)
    try:
        for _ in range(12):
            eng.step()
        assert rec.stats.coalesced > 0 and rec.ring.used <= rec.ring.capacity
        assert rec.ring.shared_bytes == 4096 + rec.ring.capacity  # the ring never grew
    finally:
        os.kill(rec.executor.pid, signal.SIGCONT)
    # No further step: the merged steps wait for room in the ring, and drain pushes them
    # (it once returned with them missing when the last push had been refused)
    assert rec.drain()
    before = generated(eng)
    rec.close()
    new = LLMEngine(path, CFG)
    recover(new, tmp_path / "log")
    assert generated(new) == before
    assert finish(new, {k: list(v) for k, v in before.items()}) == ref


@pytest.mark.timeout(120)
def test_the_thread_executor_writes_the_same_log(hf_models, tmp_path):
    """The executor as a thread of the engine (an accelerator's cache) resumes the same."""
    path = hf_models["llama"][0]
    ref = reference(path)
    eng = recording_engine(path, tmp_path / "log", compact_bytes=12_000, mode="thread")
    assert eng.recorder.executor.pid == os.getpid()
    for _ in range(9):
        eng.step()
        assert eng.recorder.drain()
    assert eng.recorder.stats.checkpoints >= 2
    before = generated(eng)
    eng.recorder.close()
    new = LLMEngine(path, CFG)
    recover(new, tmp_path / "log")
    assert finish(new, {k: list(v) for k, v in before.items()}) == ref


@pytest.mark.timeout(120)
def test_a_second_writer_is_refused_and_a_dead_executor_is_reported(hf_models, tmp_path):
    """One log, one writer: a second engine's executor cannot take a live one's log; an
    executor process that dies (SIGKILL) is replaced by a new one that takes the log over
    from its last commit (said through on_restart) and the log goes on; one that dies
    more than MAX_RESTARTS times stops recording with an error, serving goes on."""
    from phoenixft.serve.recovery.recorder import MAX_RESTARTS

    path = hf_models["llama"][0]
    errors: list[str] = []
    restarts: list[tuple[str, int]] = []
    eng = recording_engine(path, tmp_path / "log", on_error=errors.append,
                           epoch_interval_s=0)  # every step asks after the executor
    eng.recorder.on_restart = lambda why, pid: restarts.append((why, pid))
    eng.step()
    assert eng.recorder.drain()
    other = LLMEngine(path, CFG)
    second = other.recorder = Recorder(other, tmp_path / "log", on_error=errors.append)
    other.add_request("x", [1, 2, 3], PARAMS[0])
    other.step()
    assert not second.drain(5.0) and "held by another writer" in second.failed
    second.close()
    for k in range(MAX_RESTARTS + 1):
        dead = eng.recorder.executor.pid
        os.kill(dead, signal.SIGKILL)
        eng.recorder.executor.proc.wait()
        eng.step()
        if k < MAX_RESTARTS:  # replaced: recording goes on, into the same log
            assert eng.recorder.failed is None and len(restarts) == k + 1
            why, pid = restarts[-1]
            assert "exited with code -9" in why and pid != dead
            assert eng.recorder.drain()
    assert eng.recorder.failed and "exited" in eng.recorder.failed
    assert len(errors) == 2
    finish(eng, {})  # serving goes on without the log
    assert not eng.block_manager.quarantine
    eng.recorder.close()


@pytest.mark.timeout(120)
def test_decode_only_steps_merge_and_a_crash_costs_decoded_tokens_never_a_prompt(hf_models, tmp_path):
    """Steps that only decode are merged into the next epoch (a 1 s interval: far longer
    than these steps); a step that admits a request is logged at once. A crash with merged
    steps unlogged resumes from the last epoch: those tokens are decoded again, the same
    ones, and no prompt is computed again."""
    path = hf_models["llama"][0]
    ref = reference(path)
    ref["late"] = ref["r0"]  # the same prompt and greedy parameters
    eng = recording_engine(path, tmp_path / "log", compact_bytes=1 << 30, epoch_interval_s=1.0)
    rec = eng.recorder
    eng.step()  # everyone's prefill: an epoch at once
    first = rec.epoch
    for _ in range(5):
        eng.step()
    assert rec.epoch == first and rec.stats.merged == 5  # decode only: merged
    eng.add_request("late", PROMPTS[0], PARAMS[0])
    eng.step()  # admits "late" and computes its prompt: logged at once
    assert rec.epoch == first + 1 and rec.stats.merged == 5
    for _ in range(3):
        eng.step()
    assert rec.stats.merged == 8
    deadline = time.monotonic() + 30
    while rec.processed < rec.epoch - 1:  # the epochs pushed so far are in the log
        assert time.monotonic() < deadline, "the executor never wrote the pushed epochs"
        time.sleep(0.005)  # polling the executor's progress, bounded
    before = generated(eng)
    rec.close()  # the engine dies with 3 merged steps unlogged
    new = LLMEngine(path, CFG)
    recover(new, tmp_path / "log")
    resumed = generated(new)
    assert {k: len(before[k]) - len(v) for k, v in resumed.items()} == {
        "r0": 3, "r1": 3, "r2": 3, "late": 3}
    assert all(resumed[k] == before[k][:len(resumed[k])] for k in resumed)
    assert finish(new, {k: list(v) for k, v in resumed.items()}) == ref
    assert all(s.prompt_computed == 0 for s in new.scheduler.running)  # no prompt again
