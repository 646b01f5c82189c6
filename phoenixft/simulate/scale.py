"""What a failure costs as the job grows: the simulator's size-dependent inputs, each a
named parameter with its source (docs/scale.md explains the model in a page).

    recovery(G)  = detect + control plane(G) + communicator rebuild(R) + state transfer
                   (a GPU's shard / link bandwidth) [+ lost steps x step, in the simulator]
    restart(G)   = relaunch + communicator rebuild(G) + checkpoint load (bytes / storage)
    checkpoint   = the job's bytes / storage bandwidth (the stall per checkpoint)
    snapshot     = our measured per-step overhead + what the device-to-host copy of a
                   GPU's shard does not hide under the step

G is the number of GPUs, one worker each; R the ranks of the largest communicator a
recovery rebuilds (G while the world group is rebuilt: `world_group_rebuilt`). The
control plane term is fitted from `phoenixft bench control-plane` (a N^b, this machine's
CPU); the GPU figures (links, copies, communicator set-up) are taken from publications
until `scripts/gpu-check` measures them (`SOURCES` says which is which).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

# where each default comes from, by parameter name
SOURCES = {
    "params": "the job's model: Llama 3 405B (arXiv 2407.21783) by default",
    "bytes_per_param": "mixed-precision Adam: 2 (bf16 weights) + 2 (grads) + 12 (fp32 "
                       "master, two moments) = 16 bytes a parameter (ZeRO, arXiv 1910.02054)",
    "link_gbps": "DGX H100: one ConnectX-7 400 Gb/s port per GPU (NVIDIA DGX H100 "
                 "datasheet); taken from the publication, not measured",
    "link_efficiency": "assumed: share of the line rate a point-to-point copy reaches",
    "d2h_gbs": "PCIe Gen5 x16 host copies: 64 GB/s a direction on paper, ~55 GB/s pinned "
               "in NVIDIA's nvbandwidth samples; 50 GB/s taken until scripts/gpu-check "
               "measures it",
    "comm_base_s": "communicator set-up that does not grow with ranks (NCCL transport "
                   "set-up, the members' own group builds): assumed 2 s",
    "comm_per_krank_s": "communicator set-up growing with ranks (one root exchanging every "
                        "rank's id): 1.5 s per 1,000 ranks, so 150 s at 100k, the order of "
                        "NCCL's '2.5-minute init time at large scale (above certain K GPUs)' "
                        "(github.com/NVIDIA/nccl/issues/1156) and of FT-HSDP's 3-minute "
                        "recovery stall at ~100k GPUs (arXiv 2602.00277); gloo needed 25 s "
                        "at 4k ranks after its fix (github.com/pytorch/gloo/pull/408). The "
                        "least certain input: see the sensitivity table",
    "store_barrier_s_16k": "a TCPStore barrier: 0.5 s at 16k ranks (NVIDIA "
                           "nvidia-resiliency-ext, in-process restart usage guide); reported "
                           "beside our fitted control plane, not added to it",
    "control_a": "our control plane per failure, a in a N^b (phoenixft bench control-plane, "
                 "this 2-core machine: 1 store + 1 leader + hollow members)",
    "control_b": "our control plane per failure, the exponent b (same fit)",
    "detect_exit_s": "a crash seen by its agent's pidfd (phoenixft bench recovery)",
    "hang_share": "assumed: share of failures that hang rather than exit (no published split)",
    "heartbeat_timeout_s": "phoenixft's default --heartbeat-timeout",
    "relaunch_s": "checkpoint-restart: scheduler, process start, imports, health checks; "
                  "assumed so that a restart at 100k GPUs totals FT-HSDP's 10-minute "
                  "checkpoint-restart stall (arXiv 2602.00277)",
    "storage_tbs": "Llama 3's Tectonic storage: 2 TB/s sustained (7 TB/s peak; arXiv "
                   "2407.21783)",
    "snapshot_floor": "our measured snapshot overhead a step (phoenixft bench overhead)",
    "overlap": "assumed: share of a step the snapshot copy can hide under (forward and "
               "backward)",
    "group_gpus": "HSDP: GPUs in a replica group (4 nodes of 8)",
    "world_group_rebuilt": "the code today: every recovery rebuilds the job's world group "
                           "(it carries the step's audit all-reduce and the join's "
                           "agreement; train/kept_groups.py keeps only the mesh groups the "
                           "failure left whole), so the rebuild is of G ranks; false: only "
                           "the groups that held the failed rank, the largest of them the "
                           "cross-replica group of G / group_gpus ranks (a what-if: not "
                           "built)",
}


@dataclass(frozen=True)
class ScaleInputs:
    """Every input of the size-dependent costs (units in the names; `SOURCES` for each)."""

    params: float = 405e9
    bytes_per_param: float = 16.0
    link_gbps: float = 400.0
    link_efficiency: float = 0.8
    d2h_gbs: float = 50.0
    comm_base_s: float = 2.0
    comm_per_krank_s: float = 1.5
    store_barrier_s_16k: float = 0.5
    control_a: float = 6.3e-5
    control_b: float = 1.0
    detect_exit_s: float = 0.05
    hang_share: float = 0.1
    heartbeat_timeout_s: float = 3.0
    relaunch_s: float = 445.0
    storage_tbs: float = 2.0
    snapshot_floor: float = 0.01
    overlap: float = 0.9
    group_gpus: int = 32
    world_group_rebuilt: bool = True

    def with_measured(self, control_plane_json: str | None) -> ScaleInputs:
        """The control plane's fit from a `bench control-plane` result, where given."""
        if not control_plane_json or not Path(control_plane_json).is_file():
            return self
        rows = json.loads(Path(control_plane_json).read_text())["rows"]
        a, b = fit_power([r["members"] for r in rows], [r["control_s"] for r in rows])
        return replace(self, control_a=a, control_b=b)

    def as_table(self) -> list[dict]:
        return [{"name": f.name, "value": getattr(self, f.name), "source": SOURCES[f.name]}
                for f in fields(self)]


def fit_power(ns: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, b) of y = a N^b, least squares on logs."""
    pts = [(math.log(n), math.log(y)) for n, y in zip(ns, ys) if n > 0 and y > 0]
    if len(pts) < 2:
        raise ValueError("a power law needs two positive points")
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return math.exp(my - b * mx), b


def shard_bytes(s: ScaleInputs, gpus: int) -> float:
    """What one GPU holds that nobody else does (FSDP / ZeRO-3 across the job)."""
    return s.params * s.bytes_per_param / gpus


def terms(s: ScaleInputs, gpus: int) -> dict[str, float]:
    """A spare's recovery at `gpus` GPUs, term by term (seconds), and what restart and
    checkpoints cost there."""
    link = s.link_gbps / 8 * 1e9 * s.link_efficiency
    job_bytes = s.params * s.bytes_per_param
    return {
        "detect": (1 - s.hang_share) * s.detect_exit_s + s.hang_share * s.heartbeat_timeout_s,
        "control": s.control_a * gpus ** s.control_b,
        "comm": comm_s(s, rebuilt_ranks(s, gpus)),
        "transfer": shard_bytes(s, gpus) / link,
        "restart": s.relaunch_s + comm_s(s, gpus) + job_bytes / (s.storage_tbs * 1e12),
        "checkpoint": job_bytes / (s.storage_tbs * 1e12),
        "snapshot_copy": shard_bytes(s, gpus) / (s.d2h_gbs * 1e9),
    }


def comm_s(s: ScaleInputs, ranks: int) -> float:
    """Building communicators whose largest has `ranks` ranks (they are built at once)."""
    return s.comm_base_s + s.comm_per_krank_s * ranks / 1000


def rebuilt_ranks(s: ScaleInputs, gpus: int) -> int:
    """The largest communicator a recovery rebuilds (`world_group_rebuilt`'s source)."""
    if s.world_group_rebuilt:
        return gpus
    return max(min(s.group_gpus, gpus), gpus // max(1, s.group_gpus))


def recovery_s(s: ScaleInputs, gpus: int) -> float:
    """A spare taking a dead GPU's place: seconds the job stands still (lost steps aside)."""
    t = terms(s, gpus)
    return t["detect"] + t["control"] + t["comm"] + t["transfer"]


def snapshot_overhead(s: ScaleInputs, gpus: int, step_s: float) -> float:
    """The share of every step snapshots cost: the measured floor, plus the part of the
    device-to-host copy the step cannot hide."""
    copy = terms(s, gpus)["snapshot_copy"]
    return s.snapshot_floor + max(0.0, copy - s.overlap * step_s) / step_s


def group_loss_s(s: ScaleInputs, gpus: int) -> float:
    """HSDP: a replica group leaving or coming back: detect, the control plane over the
    job, and the communicators rebuilt (the world group while the code rebuilds it,
    else the cross-group ones: one rank per group in each)."""
    t = terms(s, gpus)
    return t["detect"] + t["control"] + t["comm"]


def inputs_dict(s: ScaleInputs) -> dict:
    return asdict(s)
