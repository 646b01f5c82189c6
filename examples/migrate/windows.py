"""The shared parts of the two migration examples: data and model."""

import torch

from phoenixft.models.llama import EOS_ID, LlamaForCausalLM, preset, save_hf
from phoenixft.train.data import stdlib_corpus

CONTEXT = 64


class Windows(torch.utils.data.Dataset):
    """Fixed, non-overlapping windows of the Python standard library's source bytes."""

    def __init__(self, n: int) -> None:
        tokens = stdlib_corpus(EOS_ID, max_bytes=n * (CONTEXT + 1) + 1)
        self.w = tokens[:n * (CONTEXT + 1)].view(n, CONTEXT + 1).long()

    def __len__(self) -> int:
        return len(self.w)

    def __getitem__(self, i: int):
        return self.w[i, :-1], self.w[i, 1:]


def build_model() -> LlamaForCausalLM:
    return LlamaForCausalLM(preset("tiny"))


def save_model(model: LlamaForCausalLM, out: str) -> None:
    save_hf(model, out)
