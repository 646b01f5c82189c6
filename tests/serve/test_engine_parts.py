"""Block manager, sampler, stop conditions and the engine's state seam."""

from __future__ import annotations

import pytest
import torch

from phoenixft.serve import LLM, EngineConfig, SamplingParams
from phoenixft.serve.engine.block_manager import BlockManager
from phoenixft.serve.engine.sampler import sample, uniform
from phoenixft.serve.engine.sequence import Sequence
from tests.support.engine_state import (
    block_manager_state,
    engine_state,
    load_block_manager_state,
    load_engine_state,
)


def seq(tokens, sid="s", **params) -> Sequence:
    return Sequence(seq_id=sid, token_ids=list(tokens), num_prompt_tokens=len(tokens),
                    params=SamplingParams(**params), seed=params.get("seed") or 0)


def test_block_manager_refcounts_prefix_sharing_and_dirty_set():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(10), "a")
    bm.allocate(a)
    assert len(a.block_table) == 3 and a.num_computed_tokens == 0
    bm.mark_computed(a, 0, 10)
    a.num_computed_tokens = 10
    t = a.block_table  # 10 tokens in blocks of 4: the last block holds two
    assert bm.take_dirty() == {t[0]: [0, 4], t[1]: [0, 4], t[2]: [0, 2]} and bm.take_dirty() == {}
    b = seq([*range(8), 99, 98], "b")  # shares the two full blocks of a
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_computed_tokens == 8
    assert [bm.ref_counts[x] for x in b.block_table] == [2, 2, 1]
    c = seq(range(8), "c")  # its last token may not come from the cache: one block shared
    bm.allocate(c)
    assert c.block_table[0] == a.block_table[0] and c.num_computed_tokens == 4
    for s in (a, b, c):
        bm.free_seq(s)
    assert bm.num_free_blocks == 8 and all(r == 0 for r in bm.ref_counts)
    d = seq([*range(8), 7], "d")  # freed blocks keep their contents until reused
    bm.allocate(d)
    assert d.num_computed_tokens == 8
    # appending: a new block only when the sequence crosses a block boundary
    d.token_ids += [1, 2, 3]
    assert bm.can_append(d)
    bm.append(d)
    assert len(d.block_table) == 3
    state = block_manager_state(bm)
    other = BlockManager(num_blocks=8, block_size=4)
    load_block_manager_state(other, state)
    assert block_manager_state(other) == state and other.hash_to_block == bm.hash_to_block
    with pytest.raises(ValueError, match="geometry"):
        load_block_manager_state(BlockManager(num_blocks=9, block_size=4), state)


def test_block_manager_refuses_when_full():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate(seq(range(8), "a"))
    big = seq(range(5), "b")
    assert not bm.can_allocate(big)
    with pytest.raises(RuntimeError):
        bm.allocate(big)


def test_sampler_seeded_independent_of_batch_and_greedy_limits():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    mk = [seq([1], f"r{i}", temperature=0.9, top_p=0.95, top_k=30, seed=100 + i)
          for i in range(4)]
    together = sample(logits, mk)
    alone = [sample(logits[i:i + 1], [mk[i]])[0] for i in range(4)]
    assert together == alone
    assert sample(logits[[3, 1]], [mk[3], mk[1]]) == [together[3], together[1]]
    greedy = logits.argmax(-1).tolist()
    assert sample(logits, [seq([1], temperature=0.0)] * 4) == greedy
    assert sample(logits, [seq([1], temperature=2.0, top_k=1, seed=1)] * 4) == greedy
    assert sample(logits, [seq([1], temperature=1.0, top_p=1e-6, seed=1)] * 4) == greedy
    # frequencies follow the softmax: over many seeds, the top-2-restricted choice
    two = torch.tensor([[2.0, 1.0, -1.0, -3.0]])
    picks = [sample(two, [seq([1], temperature=1.0, top_k=2, seed=s)])[0] for s in range(2000)]
    p0 = torch.softmax(torch.tensor([2.0, 1.0]), 0)[0].item()
    assert set(picks) == {0, 1}
    assert abs(picks.count(0) / 2000 - p0) < 0.04
    assert len({uniform(1, i) for i in range(100)}) == 100


def test_sampling_params_validation():
    for bad in ({"max_tokens": 0}, {"max_tokens": -3}, {"temperature": -1.0},
                {"top_p": 0.0}, {"top_k": -2}, {"top_k": 2**64}, {"stop": [""]}, {"seed": "x"},
                {"seed": 2**64}, {"temperature": float("nan")}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's spelling of "no top-k"
    assert SamplingParams(temperature=1e-320).greedy
    assert SamplingParams(stop="x").stop == ["x"]
    with pytest.raises(ValueError, match="num_blocks"):
        EngineConfig(num_blocks=0)


def test_stop_strings_eos_and_max_tokens(hf_models):
    path, _ = hf_models["qwen2"]  # has a WordLevel tokenizer: text is "w5 w17 ..."
    llm = LLM(path, block_size=4, max_model_len=128)
    base = llm.generate([[10, 11, 12]], SamplingParams(max_tokens=10, temperature=0.0,
                                                       ignore_eos=True))[0]
    words = base.text.split()
    assert len(base.token_ids) == 10 and base.finish_reason == "length" and len(words) == 10
    stop = " ".join(words[2:4])
    out = llm.generate([[10, 11, 12]], SamplingParams(max_tokens=10, temperature=0.0,
                                                      ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == base.text[:base.text.find(stop)]
    out = llm.generate([[10, 11, 12]], SamplingParams(
        max_tokens=10, temperature=0.0, stop_token_ids=[base.token_ids[1]]))[0]
    assert out.token_ids == base.token_ids[:2] and out.finish_reason == "stop"
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([[5] * 120], SamplingParams(max_tokens=10))


def test_streamed_deltas_add_up_and_hold_back_stop_prefixes(hf_models):
    path, _ = hf_models["qwen2"]
    llm = LLM(path, block_size=4, max_model_len=128)
    eng = llm.engine
    full = llm.generate([[30, 31]], SamplingParams(max_tokens=8, temperature=0.0,
                                                   ignore_eos=True))[0].text
    stop = full.split()[5]
    eng.add_request("x", [30, 31], SamplingParams(max_tokens=8, temperature=0.0,
                                                  ignore_eos=True, stop=[stop]))
    deltas = []
    while eng.has_unfinished():
        deltas += [o.new_text for o in eng.step()]
    assert "".join(deltas) == full[:full.find(stop)]
    assert all(stop not in d for d in deltas)


def test_state_dict_restore_continues_identically(hf_models):
    """The recovery seam: snapshot mid-generation, restore into a fresh engine, finish."""
    path, _ = hf_models["llama"]
    cfg = EngineConfig(block_size=4, num_blocks=40, max_model_len=64)
    prompts = [[5, 6, 7], list(range(20, 31))]
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)]
    ref = LLM(path, cfg).generate(prompts, params)
    a = LLM(path, cfg)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        a.engine.add_request(f"q{i}", p, sp)
    for _ in range(6):
        a.engine.step()
    dirty = a.engine.block_manager.take_dirty()
    assert dirty and set(dirty) <= {b for s in a.engine.seqs.values() for b in s.block_table}
    state = engine_state(a.engine)
    b = LLM(path, cfg)
    load_engine_state(b.engine, {k: (v.clone() if torch.is_tensor(v) else v)
                                 for k, v in state.items()})
    seqs = dict(b.engine.seqs)
    while b.engine.has_unfinished():
        b.engine.step()
    assert [seqs[f"q{i}"].completion_token_ids for i in range(2)] == [
        r.token_ids for r in ref]


def test_socket_dirs_of_fronts_that_are_gone_are_removed(tmp_path):
    """A SIGKILLed front leaves its engines' socket directory behind (87 of them had piled
    up in /tmp here): the next front removes those whose pid is gone, and only those."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from phoenixft.serve.server.supervisor import SOCK_PREFIX, EngineSupervisor, remove_stale_socket_dirs
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tmp = Path(tempfile.gettempdir())
    stale, live, other = (tmp / f"{SOCK_PREFIX}{dead.pid}-t{os.getpid()}",
                          tmp / f"{SOCK_PREFIX}{os.getpid()}-t", tmp / f"{SOCK_PREFIX}run-t{os.getpid()}")
    try:
        for d in (stale, live, other):
            d.mkdir()
            (d / "engines.sock").write_bytes(b"")
        import socket
        (stale / "engines.sock").unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(stale / "engines.sock"))
        listener.listen(1)  # pid gone but someone listens (another pid namespace): kept
        assert str(stale) not in remove_stale_socket_dirs() and stale.exists()
        listener.close()
        assert str(stale) in remove_stale_socket_dirs()
        assert not stale.exists() and live.exists() and other.exists()
        sup = EngineSupervisor(tmp_path, {}, tmp_path / "log", tmp_path, on_message=print,
                               on_ready=lambda *a: None, emit=lambda *a, **k: None)
        try:
            assert Path(sup.sock_path).parent.name.startswith(f"{SOCK_PREFIX}{os.getpid()}-")
        finally:
            sup.stop()
        assert not Path(sup.sock_path).parent.exists()
    finally:
        for d in (stale, live, other):
            shutil.rmtree(d, ignore_errors=True)
