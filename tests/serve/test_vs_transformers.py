"""Our paged engine against Hugging Face transformers on the same weights.

Logits must agree within 1e-4 for every prompt position (prefill) and for every decode
step, with requests of different lengths batched together, across preemptions and prefix
cache hits; greedy outputs must equal ``generate``'s token for token.
"""

from __future__ import annotations

import pytest
import torch

from phoenixft.serve import LLM, EngineConfig, SamplingParams

ATOL = 1e-4
PROMPTS = [[3, 9, 27, 81 % 128, 50], list(range(10, 27)), [7] * 3 + list(range(40, 70)), [99]]


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def check_step_logits(model, prompt: list[int], out) -> None:
    """Teacher-forced HF logits at each position that produced a generated token."""
    ref = hf_logits(model, prompt + out.token_ids)[len(prompt) - 1:-1]
    got = torch.stack(out.logits)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prefill_logits_every_position_batched(hf_models, arch):
    path, model = hf_models[arch]
    llm = LLM(path, block_size=4, max_model_len=128)
    eng = llm.engine
    seqs = [eng.add_request(f"r{i}", p, SamplingParams(max_tokens=4))
            for i, p in enumerate(PROMPTS)]
    batch = eng.scheduler.schedule()
    assert batch == seqs
    logits = eng.runner.run(batch, all_logits=True)
    offset = 0
    for p in PROMPTS:
        torch.testing.assert_close(logits[offset:offset + len(p)], hf_logits(model, p),
                                   atol=ATOL, rtol=0)
        offset += len(p)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_decode_logits_and_greedy_tokens_batched(hf_models, arch):
    path, model = hf_models[arch]
    llm = LLM(path, block_size=4, max_model_len=128)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outs = llm.generate(PROMPTS, params, keep_logits=True)
    for p, o in zip(PROMPTS, outs):
        check_step_logits(model, p, o)
        with torch.no_grad():
            g = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)
        assert o.token_ids == g[0, len(p):].tolist()
        assert o.finish_reason == ("stop" if o.token_ids[-1] == 2 else "length")


def test_logits_across_preemption(hf_models):
    """So few blocks that running sequences are preempted and recomputed mid-generation."""
    path, model = hf_models["qwen3"]
    llm = LLM(path, EngineConfig(block_size=4, num_blocks=16, max_model_len=60))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, keep_logits=True)
    assert llm.engine.scheduler.num_preemptions > 0
    for p, o in zip(PROMPTS, outs):
        assert len(o.token_ids) == 24
        check_step_logits(model, p, o)
    assert llm.engine.block_manager.num_free_blocks == 16


def test_prefix_cache_hits_keep_logits_exact(hf_models):
    path, model = hf_models["qwen2"]
    llm = LLM(path, block_size=4, max_model_len=128)
    shared = list(range(20, 45))
    first = llm.generate([shared + [1]], SamplingParams(max_tokens=3, temperature=0.0))
    assert first[0].finish_reason is not None
    prompts = [shared + [5, 6], shared]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0,
                                                ignore_eos=True), keep_logits=True)
    assert llm.engine.block_manager.num_cache_hits >= 2 * (len(shared) // 4) - 1
    for p, o in zip(prompts, outs):
        check_step_logits(model, p, o)


def test_model_saved_by_save_hf_with_byte_tokenizer(tmp_path):
    from phoenixft.models.llama import LlamaForCausalLM, preset, save_hf

    torch.manual_seed(0)
    cfg = preset("tiny")
    ours = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    save_hf(ours, tmp_path / "m")
    llm = LLM(tmp_path / "m")
    assert llm.engine.max_model_len == cfg.max_position_embeddings
    prompt = "def f(x):"
    out = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0,
                                              ignore_eos=True), keep_logits=True)[0]
    ids = list(prompt.encode())
    assert out.prompt_token_ids == ids
    with torch.no_grad():
        ref = ours(torch.tensor([ids + out.token_ids]))[0, len(ids) - 1:-1]
    torch.testing.assert_close(torch.stack(out.logits), ref, atol=ATOL, rtol=0)
    assert out.token_ids == ref.argmax(-1).tolist()
    assert out.text == bytes(t for t in out.token_ids if t < 256).decode(errors="replace")


def test_logits_when_requests_join_a_running_batch(hf_models):
    """Prefills of new requests share a forward pass with decodes of running ones."""
    path, model = hf_models["llama"]
    llm = LLM(path, block_size=4, max_model_len=128)
    eng = llm.engine
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    query_lens: list[list[int]] = []
    run = eng.runner.run

    def recording_run(batch, **kw):
        query_lens.append([len(s) - s.num_computed_tokens for s in batch])
        return run(batch, **kw)

    eng.runner.run = recording_run
    seqs = [eng.add_request("a", PROMPTS[0], params, keep_logits=True)]
    for step in range(40):
        if step in (2, 5):
            seqs.append(eng.add_request(f"j{step}", PROMPTS[1 + step // 5], params,
                                        keep_logits=True))
        eng.step()
        if not eng.has_unfinished():
            break
    assert not eng.has_unfinished()
    assert [1, len(PROMPTS[1])] in query_lens and [1, 1, len(PROMPTS[2])] in query_lens
    for s, p in zip(seqs, [PROMPTS[0], PROMPTS[1], PROMPTS[2]]):
        ref = hf_logits(model, p + s.completion_token_ids)[len(p) - 1:-1]
        torch.testing.assert_close(torch.stack(s.logits), ref, atol=ATOL, rtol=0)
