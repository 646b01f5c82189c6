"""Load a checkpoint in DCP's default format (`phoenixft ckpt export --format dcp`) with
plain torch.distributed.checkpoint's default reader, under plain torchrun,
into the same model built without phoenixft (transformers' Llama from the job's config),
sharded with FSDP2 over this run's ranks; rank 0 writes the loaded parameters, whole, to
a safetensors file. Nothing of phoenixft is imported here.

    torchrun --nproc-per-node N dcp_load.py CONFIG_JSON DCP_DIR OUT_SAFETENSORS
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM


def sharded_llama(config_path: str) -> LlamaForCausalLM:
    """transformers' Llama of the job's config, FSDP2 over this run's ranks (per block,
    then the root), in a process group this opens."""
    dist.init_process_group("gloo")
    with open(config_path) as f:
        model = LlamaForCausalLM(LlamaConfig(**json.load(f)))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    config_path, ckpt, out = sys.argv[1:4]
    assert "phoenixft" not in sys.modules
    model = sharded_llama(config_path)
    state = model.state_dict()
    with torch.no_grad():  # every value must come from the checkpoint
        for t in state.values():
            getattr(t, "_local_tensor", t).fill_(float("nan"))
    dcp.load(state, checkpoint_id=ckpt)
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().contiguous()
            for k, v in state.items()}
    if dist.get_rank() == 0:
        save_file(full, out)
    assert "phoenixft" not in sys.modules
    # both ranks leave together: a rank tearing gloo down while the other still writes
    # was seen to abort in the torn-down rank ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()
    # and neither tears torch's C++ state down at interpreter exit: a rank doing so was
    # still seen to abort the same way (SIGABRT, CI run of 2026-12-07)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
