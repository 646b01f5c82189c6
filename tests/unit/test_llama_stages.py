"""A Llama split into pipeline stages: the stages together are the model (same outputs bit
for bit, same state-dict keys), and a split that cannot work is refused by name."""

import pytest
import torch

from phoenixft.models.llama import LlamaConfig, LlamaForCausalLM, LlamaStage, stage_layers


def model(layers: int = 5, tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=layers, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=16,
                                        tie_word_embeddings=tie))


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_the_stages_run_one_after_another_are_the_model(n):
    m = model()
    ids = torch.randint(0, m.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    x = ids
    for s in range(n):
        x = LlamaStage(m, s, n)(x)
    assert torch.equal(x, m(ids))


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_the_stages_state_dicts_partition_the_models_keys(n):
    m = model()
    full = m.state_dict()
    seen: dict[str, torch.Tensor] = {}
    for s in range(n):
        sd = LlamaStage(m, s, n).state_dict()
        assert not seen.keys() & sd.keys()
        seen.update(sd)
    assert seen.keys() == full.keys()
    assert all(seen[k] is full[k] or seen[k].data_ptr() == full[k].data_ptr() for k in full)


def test_layers_are_split_contiguously_and_evenly():
    assert [list(stage_layers(5, s, 2)) for s in range(2)] == [[0, 1], [2, 3, 4]]
    assert [len(stage_layers(16, s, 4)) for s in range(4)] == [4, 4, 4, 4]
    assert [list(LlamaStage(model(4), s, 2).layer_ids) for s in range(2)] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("kw, stage, n, says", [
    ({}, 0, 6, "6 pipeline stages for 5 decoder layers"),
    ({}, 2, 2, "stage 2 of 2"),
    ({"tie": True}, 0, 2, "untie them"),
])
def test_a_split_that_cannot_work_is_refused_by_name(kw, stage, n, says):
    with pytest.raises(ValueError, match=says):
        LlamaStage(model(**kw), stage, n)
