"""checkpoint/dcp_checkpoint.py: a whole state in DCP's default format, written, read back
without unpickling anything but DCP's metadata, and verified."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from phoenixft.checkpoint import dcp_checkpoint as ckpt
from phoenixft.checkpoint.integrity import IntegrityError


def _state(step: int = 7) -> dict:
    g = torch.Generator().manual_seed(0)
    model = {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g)}
    optim = {("w", "exp_avg"): torch.randn(6, 4, generator=g), ("w", "step"): torch.tensor(3.0)}
    group = {"lr": 0.1, "betas": [0.9, 0.99], "foreach": None, "params": [0]}
    return ckpt.titan_state(model, optim, {"w": group, "b": group}, step)


def _empty(url: str) -> dict:
    return {k: torch.zeros(m.size, dtype=m.properties.dtype)
            for k, m in ckpt.saved_keys(url).items() if hasattr(m, "size")}


def test_written_state_reads_back_with_torchtitans_keys(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = _state()
    url = ckpt.write(str(tmp_path / "c"), state)
    assert sorted(os.listdir(url)) == [".metadata", "__0_0.distcp", "phoenixft.json"]
    assert {"w", "b", "optimizer.state.w.exp_avg", "optimizer.state.w.step",
            "optimizer.param_groups.w.betas", "train_state.step"} <= set(ckpt.saved_keys(url))
    back = _empty(url) | {"optimizer.param_groups.w.betas": None}
    ckpt.load(url, back)
    assert torch.equal(back["w"], state["w"]) and int(back["train_state.step"]) == 7
    assert back["optimizer.param_groups.w.betas"] == (0.9, 0.99)  # (JSON's list: a tuple)
    plain = {"w": torch.zeros(6, 4), "optimizer": {"state.w.exp_avg": torch.zeros(6, 4)}}
    dcp.load(plain, checkpoint_id=url)  # torch's own reader, as a torchtitan user loads it
    assert torch.equal(plain["optimizer"]["state.w.exp_avg"], state["optimizer"]["state.w.exp_avg"])
    assert ckpt.verify(url) == []


def test_a_rewrite_never_leaves_an_old_metadata_beside_new_data(tmp_path):
    url = str(tmp_path / "c")
    ckpt.write(url, _state(7))
    ckpt.write(url, _state(9))
    back = _empty(url)
    ckpt.load(url, back)
    assert int(back["train_state.step"]) == 9 and ckpt.verify(url) == []


def test_verify_names_an_edited_file_and_uncovered_tensors(tmp_path):
    url = ckpt.write(str(tmp_path / "c"), _state())
    data = bytearray(open(f"{url}/__0_0.distcp", "rb").read())
    data[40] ^= 0x08
    open(f"{url}/__0_0.distcp", "wb").write(bytes(data))
    [problem] = ckpt.verify(url)
    assert "__0_0.distcp: checksum mismatch" in problem
    # a checkpoint without our sidecar (torchtitan's): its sharding metadata is checked
    url = ckpt.write(str(tmp_path / "d"), _state())
    os.remove(f"{url}/phoenixft.json")
    md = pickle.loads(open(f"{url}/.metadata", "rb").read())  # (our own file, in a test)
    chunk = md.state_dict_metadata["w"].chunks[0]
    chunk.sizes = torch.Size([3, 4])  # says it holds half of w
    open(f"{url}/.metadata", "wb").write(pickle.dumps(md))
    [problem] = ckpt.verify(url)
    assert "w's saved chunks cover 12 of its 24 elements" in problem


class _Forged:
    def __reduce__(self):
        return (os.system, ("true",))


def test_a_forged_metadata_is_refused_not_run(tmp_path):
    url = ckpt.write(str(tmp_path / "c"), _state())
    open(f"{url}/.metadata", "wb").write(pickle.dumps(_Forged()))
    with pytest.raises(IntegrityError, match="posix.system is not part of a DCP checkpoint"):
        ckpt.saved_keys(url)
    with pytest.raises(IntegrityError, match=".metadata: missing"):
        ckpt.saved_keys(str(tmp_path))
