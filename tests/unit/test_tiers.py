"""One test body for every tier (local memory, peer memory, a directory, S3 on a real
S3-compatible server): save -> change -> restore -> corrupt -> detect."""

from __future__ import annotations

import pytest
import torch

from phoenixft.checkpoint.integrity import IntegrityError, checksum
from phoenixft.checkpoint.record import SnapshotHeader
from phoenixft.checkpoint.slots import HEADER_BYTES, Layout, SlotFile, blob_snapshot, verify_blob
from phoenixft.checkpoint.tiers import FsspecTier, ShmTier


def blob(tmp_path, step: int, tensors: dict) -> bytes:
    """A snapshot blob as the snapshot thread writes one (slot bytes)."""
    lay = Layout.of(tensors)
    f = SlotFile(tmp_path / f"scratch-{step}")
    f.ensure(HEADER_BYTES + lay.data_nbytes)
    f.begin_write(step)
    for e in lay.entries:
        f.view(e).copy_(tensors[e.name].reshape(e.shape))
    f.finish_write(step, lay, SnapshotHeader(rank=3))
    return bytes(f.np[:f.used_nbytes()])


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300_000, generator=g)
    w[:1000] += step  # a training step changes a little of the state
    return {"w": w, "bf16": torch.randn(5000, generator=g).bfloat16() + step,
            "count": torch.tensor([step], dtype=torch.int64)}


@pytest.fixture(params=["local_memory", "peer_memory", "directory", "s3"])
def tier(request, tmp_path):
    if request.param == "local_memory":
        return ShmTier(tmp_path / "shm", "snap"), None
    if request.param == "peer_memory":
        return ShmTier(tmp_path / "shm", "rep"), None
    if request.param == "directory":
        return FsspecTier(str(tmp_path / "ckpt")), None
    s3 = request.getfixturevalue("s3_url")
    return FsspecTier(s3 + "/tiers"), s3


def damage(tier, step: int, rank: int, how: str) -> str:
    """Flip a byte in, or truncate, what `tier` stores for (step, rank); returns its path."""
    if isinstance(tier, ShmTier):
        from phoenixft.checkpoint.slots import slot_path
        path = str(slot_path(tier.shm_dir, tier.kind, rank, step))
        data = bytearray(open(path, "rb").read())
    else:
        kind = "delta" if tier.fs.exists(tier.record_path(step, rank, "delta")) else "base"
        path = tier.record_path(step, rank, kind)
        data = bytearray(tier.fs.cat_file(path))
    if how == "flip":
        data[HEADER_BYTES + 99 if isinstance(tier, ShmTier) else len(data) - 7] ^= 0x20
    else:
        data = data[:len(data) // 2]
    if isinstance(tier, ShmTier):
        open(path, "wb").write(data)
    else:
        tier.fs.pipe_file(path, bytes(data))
    return path


@pytest.mark.timeout(120)
def test_save_change_restore_corrupt_detect(tier, tmp_path):
    t, _ = tier
    b10, b11 = blob(tmp_path, 10, state(10)), blob(tmp_path, 11, state(11))
    info = t.put(10, 3, b10)
    assert info.checksum == checksum(b10) and verify_blob(b10, 10).rank == 3
    t.put(11, 3, b11, base=(10, b10))
    assert t.get(10, 3) == b10 and t.get(11, 3) == b11
    assert {(r.step, r.rank) for r in t.list()} == {(10, 3), (11, 3)}
    if isinstance(t, FsspecTier):  # the change travels as a small delta
        delta = next(r for r in t.list() if r.step == 11)
        assert delta.kind == "delta"
        stored = len(t.fs.cat_file(t.record_path(11, 3, "delta")))
        assert stored < len(b11) / 20, (stored, len(b11))
    with pytest.raises(KeyError):
        t.get(12, 3)
    for how in ("flip", "truncate"):
        t.put(11, 3, b11, base=(10, b10))
        where = damage(t, 11, 3, how)
        with pytest.raises(IntegrityError) as err:
            t.get(11, 3)
        assert where.rsplit("/", 1)[-1] in str(err.value)
    t.delete(11, 3)
    assert [(r.step, r.rank) for r in t.list()] == [(10, 3)]


@pytest.mark.timeout(60)
def test_a_delta_given_its_bases_checksum_is_the_record_it_would_have_hashed(tmp_path):
    """The persister passes the base record's checksum instead of hashing the base again
    for every delta: the records come out byte for byte the same."""
    b10, b11 = blob(tmp_path, 10, state(10)), blob(tmp_path, 11, state(11))
    a, b = FsspecTier(str(tmp_path / "a")), FsspecTier(str(tmp_path / "b"))
    info = a.put(10, 3, b10)
    a.put(11, 3, b11, base=(10, b10))
    b.put(11, 3, b11, base=(10, b10), base_checksum=info.checksum)
    path = ("r3", "s0000000011.delta")
    assert (tmp_path / "a").joinpath(*path).read_bytes() == (tmp_path / "b").joinpath(*path).read_bytes()


@pytest.mark.timeout(60)
def test_a_step_stored_as_both_kinds_is_read_as_its_manifest_committed_it(tmp_path):
    """A resumed job wrote step 11 again as a base beside the first job's delta of it:
    a manifest names which record it committed, and only that one is read (the other one,
    damaged here, was read in its place and the good base's damage went unnoticed)."""
    from phoenixft.checkpoint.tiers import info_dict
    t = FsspecTier(str(tmp_path / "ckpt"))
    b10, b11 = blob(tmp_path, 10, state(10)), blob(tmp_path, 11, state(11))
    t.put(10, 3, b10)
    t.put(11, 3, b11, base=(10, b10))  # the first job's delta
    again = t.put(11, 3, b11)  # the resumed job's base of the same step
    manifest = {"records": [info_dict(again)]}
    delta = t.record_path(11, 3, "delta")
    data = bytearray(t.fs.cat_file(delta))
    data[-7] ^= 0x20
    t.fs.pipe_file(delta, bytes(data))
    assert t.get(11, 3, manifest) == b11  # the damaged delta is not the committed record
    base = t.record_path(11, 3, "base")
    data = bytearray(t.fs.cat_file(base))
    t.fs.pipe_file(base, bytes(data[:len(data) // 2]))
    with pytest.raises(IntegrityError, match=r"s0000000011\.base"):
        t.get(11, 3, manifest)  # the committed one is damaged: named, no fallback to the delta
    with pytest.raises(KeyError):
        t.get(11, 4, manifest)  # no record of that rank in the manifest


def test_a_base_is_compressed_only_when_a_sample_of_it_shrinks(tmp_path):
    """fp32 noise (what weights and optimizer state look like to zstd) is stored raw;
    a compressible blob is compressed; both read back verified; a codec the reader does
    not know is named, never guessed."""
    import json

    tier = FsspecTier(str(tmp_path / "ckpt"))
    noisy = blob(tmp_path, 1, {"w": torch.randn(600_000)})
    zeros = blob(tmp_path, 2, {"w": torch.zeros(600_000)})
    codecs = {}
    for step, b in ((1, noisy), (2, zeros)):
        info = tier.put(step, 0, b)
        header, payload = tier._read_record(tier.record_path(step, 0, "base"))
        codecs[step] = (header["codec"], len(payload) / len(b))
        assert info.kind == "base" and tier.get(step, 0) == b
    assert codecs[1][0] == "raw" and codecs[1][1] == 1.0, codecs
    assert codecs[2][0] == "zstd" and codecs[2][1] < 0.01, codecs
    from phoenixft.checkpoint.tiers import _LEN, _RECORD

    path = tier.record_path(1, 0, "base")
    data = tier.fs.cat_file(path)
    (n,) = _LEN.unpack_from(data, len(_RECORD))
    start = len(_RECORD) + _LEN.size
    header = json.loads(data[start:start + n])
    header["codec"] = "lz5"
    new = json.dumps(header).encode()
    tier.fs.pipe_file(path, _RECORD + _LEN.pack(len(new)) + new + data[start + n:])
    with pytest.raises(IntegrityError, match="unknown base codec 'lz5'"):
        tier.get(1, 0)


def sharded_blob(tmp_path, step: int, rank: int, rows: slice, value: float) -> bytes:
    """Rank `rank`'s snapshot of a sharded model (as Fsdp2Layout writes one: its shard of
    parameter `w` (6 x 5) and of its Adam state, the scalar step, RNG, and where the
    shard lies in the whole), with garbage in the alignment padding and the header's
    spare room: a base in DCP's format must give all of it back byte for byte."""
    g = torch.Generator().manual_seed(step)
    w = torch.randn(6, 5, generator=g) + value
    tensors = {"p.w": w[rows].clone(), "o.w.exp_avg": (w[rows] * 0.1).clone(),
               "o.w.step": torch.tensor(float(step)),
               "rng.torch": torch.randint(0, 255, (13,), dtype=torch.uint8)}
    lay = Layout.of(tensors)
    f = SlotFile(tmp_path / f"scratch-{step}-{rank}")
    f.ensure(HEADER_BYTES + lay.data_nbytes)
    f.np[:HEADER_BYTES + lay.data_nbytes] = 0xAB
    f.begin_write(step)
    for e in lay.entries:
        f.view(e).copy_(tensors[e.name].reshape(e.shape))
    meta = {"dcp": {"w": [[6, 5], [rows.start, 0]]}, "layout": "fsdp2"}
    f.finish_write(step, lay, SnapshotHeader(rank=rank, opt=meta))
    return bytes(f.np[:f.used_nbytes()])


@pytest.mark.parametrize("where", ["directory", "s3"])
def test_a_sharded_base_gives_its_blob_back_and_no_dcp_reader_takes_it_alone(tmp_path, request,
                                                                              where):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load
    from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader

    url = str(tmp_path / "ckpt") if where == "directory" else request.getfixturevalue("s3_url") + "/dcp"
    t = FsspecTier(url)
    halves = [slice(0, 3), slice(3, 6)]
    blobs = [sharded_blob(tmp_path, 4, r, rows, 1.0) for r, rows in enumerate(halves)]
    for r, b in enumerate(blobs):
        info = t.put(4, r, b)
        assert (info.kind, info.codec) == ("base", "dcp")
        assert t.get(4, r) == b  # header, padding and all
    # a delta stacks on it as on any base
    later = sharded_blob(tmp_path, 5, 0, halves[0], 1.5)
    assert t.put(5, 0, later, base=(4, blobs[0])).kind == "delta"
    assert t.get(5, 0) == later
    assert sorted((r.step, r.rank, r.kind) for r in t.list()) == [
        (4, 0, "base"), (4, 1, "base"), (5, 0, "delta")]
    parts = [load(t.fs.cat_file(t.shards_path(4, r))) for r in range(2)]
    assert torch.equal(parts[1]["w"], blob_snapshot(blobs[1], 4).tensors["p.w"])  # DCP's names
    assert "optimizer.state.w.step" not in parts[1]  # a scalar is written once
    assert "phoenixft.rank1.rng.torch" in parts[1]  # rank-local state kept apart
    if where == "directory":
        # one rank's part of a step is never where a DCP reader takes it for a checkpoint
        for d in (tmp_path / "ckpt", tmp_path / "ckpt" / "r0"):
            for reader in (HuggingFaceStorageReader(str(d)), FileSystemReader(str(d))):
                with pytest.raises((Exception, dcp.CheckpointException)):  # (either reader's)
                    dcp.load({"w": torch.zeros(6, 5)}, storage_reader=reader)
    # the DCP sharding metadata edited (a shard said to lie elsewhere): named
    head_n = int.from_bytes(t.fs.cat_file(t.shards_path(4, 1))[:8], "little")
    data = t.fs.cat_file(t.shards_path(4, 1))
    edited = data[8:8 + head_n].replace(b'[3, 0]', b'[0, 0]')
    assert edited != data[8:8 + head_n]
    with t.fs.open(t.shards_path(4, 1), "wb") as fh:
        fh.write(data[:8] + edited + data[8 + head_n:])
    with pytest.raises(IntegrityError, match="r1/s0000000004.shards: its DCP sharding"):
        t.get(4, 1)
    # a flipped byte in a shard: named, never loaded
    data = bytearray(data)
    data[-7] ^= 0x10
    with t.fs.open(t.shards_path(4, 1), "wb") as fh:
        fh.write(bytes(data))
    with pytest.raises(IntegrityError, match="s0000000004.shards"):
        t.get(4, 1)
    t.delete(4, 0)
    t.delete(4, 1)
    assert not t.fs.exists(t.shards_path(4, 0)) and not t.fs.exists(t.shards_path(4, 1))
