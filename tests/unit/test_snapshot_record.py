"""The snapshot header is one typed, versioned record, encoded and decoded in one place:
what a writer puts in comes back; a damaged, foreign or newer header is refused by name;
a header written before the version field still reads."""

import json

import pytest
import torch

from phoenixft.checkpoint.integrity import IntegrityError
from phoenixft.checkpoint.record import VERSION, Entry, SnapshotHeader
from phoenixft.checkpoint.slots import HEADER_BYTES, Layout, SlotFile, blob_header, slot_path


def _written(tmp_path, header: SnapshotHeader) -> SlotFile:
    tensors = {"param_shard": torch.arange(10, dtype=torch.float32), "rng.torch": torch.get_rng_state()}
    lay = Layout.of(tensors)
    f = SlotFile(slot_path(tmp_path, "snap", header.rank, 4))
    f.ensure(HEADER_BYTES + lay.data_nbytes)
    f.begin_write(4)
    f.finish_write(4, lay, header, f.write_data(lay, tensors))
    return f


def test_what_the_writer_says_comes_back_with_what_the_slot_adds(tmp_path):
    mine = SnapshotHeader(rank=1, world_size=2, numel=10, opt={"dcp": {"w": [[4], [0]]}},
                          tracked={"loader": {"pos": 3}}, python_random=[3, [1, 2], None],
                          generation=5)
    f = _written(tmp_path, mine)
    back = SlotFile(f.path).snapshot(4)
    assert back.header.with_(step=-1, entries=(), data_nbytes=0, checksum="") == mine
    assert back.header.step == 4 and back.header.version == VERSION
    assert [e.name for e in back.header.entries] == ["param_shard", "rng.torch"]
    assert all(isinstance(e, Entry) for e in back.header.entries)
    assert back.header.dcp_placement() == {"w": [[4], [0]]}
    assert torch.equal(back.tensors["param_shard"], torch.arange(10, dtype=torch.float32))


def _raw(header: SnapshotHeader) -> dict:
    return json.loads(SnapshotHeader.from_json(header.to_json(), "x").to_json())


@pytest.mark.parametrize("change, says", [
    (lambda d: d.pop("numel"), "has no 'numel'"),
    (lambda d: d.update(rank="0"), "'rank' is str, not int"),
    (lambda d: d.update(step=True), "'step' is bool, not int"),
    (lambda d: d.update(opt=[]), "'opt' is list, not dict"),
    (lambda d: d.update(version=VERSION + 1), f"version {VERSION + 1}.*upgrade phoenixft"),
    (lambda d: d.update(entries=[{"name": "a"}]), "entry is malformed"),
])
def test_a_damaged_foreign_or_newer_header_is_refused_by_name(change, says):
    d = _raw(SnapshotHeader(rank=0))
    change(d)
    with pytest.raises(IntegrityError, match=says):
        SnapshotHeader.from_json(json.dumps(d).encode(), "slot X")
    with pytest.raises(IntegrityError, match="not a JSON object"):
        SnapshotHeader.from_json(b"[]", "slot X")


def test_a_header_from_before_the_version_field_still_reads(tmp_path):
    f = _written(tmp_path, SnapshotHeader(rank=0, numel=10))
    d = json.loads(f.header().to_json())
    del d["version"]  # as every phoenixft before the field wrote it
    raw = json.dumps(d).encode()
    f.np[64:64 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).numpy()
    f.np[24:32] = torch.tensor([len(raw)], dtype=torch.int64).view(torch.uint8).numpy()
    old = blob_header(bytes(f.np[:f.used_nbytes()]))
    assert old.version == 1 and old.numel == 10 and old.entries == f.header().entries
