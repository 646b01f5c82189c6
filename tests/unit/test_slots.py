"""Slot files: a round trip, and every kind of damage is refused."""

from __future__ import annotations

import pytest
import torch

from phoenixft.checkpoint.integrity import IntegrityError, checksum
from phoenixft.checkpoint.record import SnapshotHeader
from phoenixft.checkpoint.slots import CHUNK, HEADER_BYTES, Layout, SlotFile, slot_path


def write_slot(path, step, tensors, meta=None) -> SlotFile:
    lay = Layout.of(tensors)
    f = SlotFile(path)
    f.ensure(HEADER_BYTES + lay.data_nbytes)
    f.begin_write(step)
    for e in lay.entries:
        f.view(e).copy_(tensors[e.name])
    f.finish_write(step, lay, SnapshotHeader(opt=meta or {}))
    return f


def test_slot_roundtrip_and_every_kind_of_damage(tmp_path):
    ts = {"a": torch.randn(100), "b": torch.arange(6, dtype=torch.int64).view(2, 3),
          "s": torch.tensor(3.5)}
    path = slot_path(tmp_path, "snap", 3, 7)
    write_slot(path, 7, ts, {"x": 1})
    f = SlotFile(path)
    hdr = f.verify(7)
    got = f.tensors(hdr)
    assert all(torch.equal(got[k], ts[k]) for k in ts) and hdr.opt == {"x": 1}
    with pytest.raises(IntegrityError, match="holds step 7, wanted step 5"):
        f.verify(5)
    f.np[HEADER_BYTES + 5] ^= 0xFF  # a flipped byte in the data
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        f.verify(7)
    f.np[HEADER_BYTES + 5] ^= 0xFF
    f.begin_write(9)  # a writer that died mid-copy leaves the slot marked incomplete
    with pytest.raises(IntegrityError, match="incomplete"):
        SlotFile(path).verify(9)


def test_slot_truncated_file_is_rejected(tmp_path):
    path = slot_path(tmp_path, "snap", 0, 2)
    write_slot(path, 2, {"a": torch.randn(1000)})
    data = path.read_bytes()
    path.write_bytes(data[:HEADER_BYTES + 100])
    with pytest.raises(IntegrityError):
        SlotFile(path).verify(2)


def test_a_kept_mapping_knows_when_its_writer_grew_or_replaced_the_file(tmp_path):
    """A same-node replica holder keeps its peer's slot mapped from step to step; it must
    see the whole snapshot after the writer grew the file (a step with optimizer state
    after one without), and the new file after the old one was deleted."""
    path = slot_path(tmp_path, "snap", 0, 2)
    write_slot(path, 2, {"a": torch.randn(10)})
    reader = SlotFile(path)
    assert reader.is_current()
    big = {"a": torch.randn(100_000)}
    write_slot(path, 4, big)  # same file, grown
    assert not reader.is_current()
    reader = SlotFile(path)
    assert reader.is_current() and torch.equal(reader.tensors(reader.verify(4))["a"], big["a"])
    path.unlink()
    write_slot(path, 6, {"a": torch.randn(100_000)})  # same size, a new file
    assert not reader.is_current()
    path.unlink()
    with pytest.raises(OSError):
        reader.is_current()


def test_write_data_hashes_exactly_what_it_copied(tmp_path):
    """The one-pass writer's digest is the checksum of the whole data region, padding
    between entries included, whatever the dtypes and however many chunks an entry spans,
    also over stale bytes a larger earlier snapshot left in the file."""
    path = slot_path(tmp_path, "snap", 0, 4)
    write_slot(path, 2, {"old": torch.randn(300_000)})  # the file keeps these bytes
    ts = {"big": torch.randn(3 * CHUNK // 4 + 13),  # several chunks, odd length
          "bf16": torch.randn(33).to(torch.bfloat16), "flags": torch.tensor([True, False, True]),
          "scalar": torch.tensor(7, dtype=torch.int64),
          "strided": torch.arange(40, dtype=torch.float32).view(8, 5).t()}
    lay = Layout.of(ts)
    f = SlotFile(path)
    f.ensure(HEADER_BYTES + lay.data_nbytes)
    f.begin_write(4)
    halfway = []
    digest = f.write_data(lay, ts, halfway=lambda: halfway.append(1))
    assert halfway == [1]
    assert digest == checksum(f.np[HEADER_BYTES:HEADER_BYTES + lay.data_nbytes])
    f.finish_write(4, lay, SnapshotHeader(), digest)
    got = SlotFile(path).tensors(SlotFile(path).verify(4))
    assert all(torch.equal(got[k], ts[k]) for k in ts)


def test_put_image_verifies_as_it_copies_and_never_looks_complete_when_damaged(tmp_path):
    src = write_slot(slot_path(tmp_path, "snap", 1, 6), 6, {"a": torch.randn(200_000)})
    image = src.np[:src.used_nbytes()].copy()
    dst = SlotFile(slot_path(tmp_path, "rep", 1, 6))
    assert dst.put_image(image, 6).step == 6 and dst.verify(6)
    image[HEADER_BYTES + CHUNK + 3] ^= 0xFF  # damaged in transit or at the source
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        dst.put_image(image, 6)
    assert dst.peek() == (False, 6)  # left marked incomplete: no reader accepts it
    with pytest.raises(IntegrityError):
        dst.put_image(src.np[:src.used_nbytes() - 100].copy(), 6)  # truncated
    with pytest.raises(IntegrityError, match="holds step 6, wanted step 8"):
        dst.put_image(src.np[:src.used_nbytes()].copy(), 8)
