"""Load a checkpoint in DCP's default format with plain torch.distributed.checkpoint, under
plain torchrun, into a freshly built model and optimizer (transformers' Llama from the
job's config, sharded with FSDP2 over this run's ranks, AdamW), the way a torchtitan user
loads one: `dcp.load(state, checkpoint_id=DIR)` with the model's keys at the top level and
the optimizer's state dict flattened. Rank 0 writes what was loaded, whole, keyed as
phoenixft digests a final state (model.<fqn>, optim.<key>.<fqn>), to a safetensors file,
and the loaded learning rate and step to a JSON file beside it. Nothing of phoenixft is
imported here.

    torchrun --nproc-per-node N dcp_final_load.py CONFIG_JSON DCP_DIR OUT_SAFETENSORS
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_load import sharded_llama  # (this script's directory: nothing of phoenixft)
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


def main() -> None:
    config_path, ckpt, out = sys.argv[1:4]
    assert "phoenixft" not in sys.modules
    model = sharded_llama(config_path)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)  # (the checkpoint's lr replaces it)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    state = {**get_model_state_dict(model),
             "optimizer": get_optimizer_state_dict(model, opt, options=flat),
             "train_state": {"step": torch.tensor(0, dtype=torch.int64)}}
    with torch.no_grad():  # every value must come from the checkpoint
        for t in [*state.values(), *state["optimizer"].values()]:
            if torch.is_tensor(t) and t.is_floating_point():
                getattr(t, "_local_tensor", t).fill_(float("nan"))
    dcp.load(state, checkpoint_id=ckpt)
    optim = state.pop("optimizer")
    step = int(state.pop("train_state")["step"])
    set_model_state_dict(model, state)
    set_optimizer_state_dict(model, opt, optim, options=flat)
    full = {}
    for name, p in model.named_parameters():
        full[f"model.{name}"] = p.full_tensor().detach().contiguous()
        for k, v in opt.state[p].items():
            full[f"optim.{k}.{name}"] = (v.full_tensor() if v.dim() else v).detach().contiguous()
    if dist.get_rank() == 0:
        save_file(full, out)
        with open(out + ".json", "w") as f:
            json.dump({"lr": opt.param_groups[0]["lr"], "step": step}, f)
    assert "phoenixft" not in sys.modules
    dist.barrier()
    dist.destroy_process_group()
    # no teardown of torch's C++ state at interpreter exit: a rank doing so under plain
    # torchrun was seen to abort ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
