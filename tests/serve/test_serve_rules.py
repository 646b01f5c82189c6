"""The rules behind the server's refusals, checked on the real parts in process (an engine
with its recovery log and executor process, the request store on real files): what is
refused changes nothing, and what a flag sets takes effect."""

from __future__ import annotations

import json
import time

import pytest

from phoenixft.serve import EngineConfig, SamplingParams
from phoenixft.serve.engine.adapters import check_adapter_name
from phoenixft.serve.engine.llm_engine import LLMEngine
from phoenixft.serve.engine.step_recorder import StepRecorder
from phoenixft.serve.recovery.recorder import Recorder
from phoenixft.serve.recovery.restore import recover
from phoenixft.serve.server.store import RequestStore
from tests.support.serving import write_adapter

CFG = EngineConfig(block_size=4, num_blocks=64, max_model_len=128)


def engine_with_log(path, log_dir, ring_bytes: int) -> LLMEngine:
    eng = LLMEngine(path, CFG)
    eng.recorder = Recorder(eng, log_dir, ring_bytes=ring_bytes)
    return eng


@pytest.mark.timeout(120)
def test_an_adapter_over_the_ring_is_refused_before_it_is_installed(hf_models, tmp_path):
    path = hf_models["qwen2"][0]
    # 2 layers x (A and B of q and v) x 4 bytes = 1792 bytes per rank: rank 64 is 112 KiB
    big = write_adapter(path, tmp_path / "big.safetensors", 1, rank=64)
    small = write_adapter(path, tmp_path / "small.safetensors", 2, rank=4)
    eng = engine_with_log(path, tmp_path / "log", 64 << 10)
    try:
        assert eng.load_adapter("small", small) == 1
        with pytest.raises(ValueError, match=r"over the \d+ bytes .* --recovery-ring-bytes 1MiB"):
            eng.load_adapter("big", big)
        assert dict(eng.adapters.current) == {"small": 1}  # nothing changed
        eng.add_request("r", [6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0),
                        adapter="small")
        while eng.has_unfinished():
            eng.step()  # the steps after the refusal go on (they failed to push it before)
        assert eng.recorder.drain() and eng.recorder.failed is None
    finally:
        eng.recorder.close()
    successor = LLMEngine(path, CFG)
    assert recover(successor, tmp_path / "log").adapters == 1
    assert dict(successor.adapters.current) == {"small": 1}
    # the size the message asks for takes effect
    roomy = engine_with_log(path, tmp_path / "log2", 1 << 20)
    try:
        assert roomy.load_adapter("big", big) == 1
        assert roomy.recorder.drain()
    finally:
        roomy.recorder.close()


def test_adapter_names_and_replacement(hf_models, tmp_path):
    for bad in ("", ".", "../../x", "a/b", "x" * 65, "a\nb", "-x", "é"):
        with pytest.raises(ValueError, match="letters, digits"):
            check_adapter_name(bad)
    for good in ("a", "my-lora.v2", "A_1", "x" * 64):
        check_adapter_name(good)
    path = hf_models["qwen2"][0]
    a = write_adapter(path, tmp_path / "a.safetensors", 1)
    eng = LLMEngine(path, CFG)
    assert eng.load_adapter("a", a) == 1
    with pytest.raises(ValueError, match="already loaded"):
        eng.load_adapter("a", a)
    assert eng.load_adapter("a", a, replace=True) == 2


def test_the_store_keeps_finished_requests_within_count_and_age(tmp_path):
    store = RequestStore(tmp_path, keep=2, keep_s=3600)
    dropped = [store.finished(f"r{i}", f"k{i}", {"n": i}) for i in range(4)]
    assert [d for ds in dropped for d, _ in ds] == ["r0", "r1"]  # the oldest first
    assert sorted(p.stem for p in (tmp_path / "requests").glob("*.json")) == ["r2", "r3"]
    # a restart reads them back, and drops those finished longer ago than keep_s
    old = json.loads((tmp_path / "requests" / "r2.json").read_text())
    old["finished"] = time.time() - 7200
    (tmp_path / "requests" / "r2.json").write_text(json.dumps(old))
    again = RequestStore(tmp_path, keep=2, keep_s=3600)
    assert [r["id"] for r in again.load()] == ["r3"]
    assert sorted(p.stem for p in (tmp_path / "requests").glob("*.json")) == ["r3"]
    with pytest.raises(ValueError, match="--keep-finished-requests"):
        RequestStore(tmp_path, keep=-1)


class CallLog(StepRecorder):
    """A StepRecorder that notes the engine's calls (and can refuse adapters)."""

    def __init__(self, engine: LLMEngine, refuse: bool = False) -> None:
        self.engine, self.refuse, self.calls = engine, refuse, []

    def end_step(self) -> None:
        self.calls.append(("end_step", len(self.engine.seqs)))

    def adapter_payload(self, adapter) -> bytes:
        self.calls.append(("payload", adapter.name, dict(self.engine.adapters.current)))
        if self.refuse:
            raise ValueError("cannot keep it")
        return adapter.name.encode()

    def log_adapter(self, payload: bytes) -> None:
        self.calls.append(("log", payload, dict(self.engine.adapters.current)))


@pytest.mark.timeout(60)
def test_the_engine_keeps_its_step_recorder_contract(hf_models, tmp_path):
    """What step_recorder.StepRecorder promises the recorder: end_step after every step
    (finished requests already gone), an adapter offered before it is installed and
    logged right after, and a refusal changing nothing."""
    path = hf_models["llama"][0]
    eng = LLMEngine(path, CFG)
    eng.recorder = log = CallLog(eng)
    a = write_adapter(path, tmp_path / "a.safetensors", 1)
    assert eng.load_adapter("a", a) == 1
    assert log.calls == [("payload", "a", {}), ("log", b"a", {"a": 1})]
    log.calls.clear()
    eng.add_request("r", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    eng.step()  # nothing scheduled: still told
    assert log.calls == [("end_step", 1)] * (steps - 1) + [("end_step", 0)] * 2
    eng.recorder = CallLog(eng, refuse=True)
    with pytest.raises(ValueError, match="cannot keep it"):
        eng.load_adapter("b", a)
    assert dict(eng.adapters.current) == {"a": 1}
