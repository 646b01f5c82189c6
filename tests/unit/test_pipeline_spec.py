"""`phoenixft.Pipeline` refuses what it cannot run, a step of a job without a pipeline
refuses `run_schedule` (and a pipelined one `microbatches()`), naming the fix; stage
shapes travel between neighbours as int64 tensors (never a pickle)."""

from __future__ import annotations

import pytest
import torch

import phoenixft
from phoenixft.train.pipeline_schedule import Pipeline, PipelineSchedule, _decode, _encode
from phoenixft.train.step import Step


def _split(model, mesh):
    return model


def test_a_pipeline_needs_two_stages_and_a_schedule_phoenixft_runs():
    assert phoenixft.Pipeline is Pipeline
    spec = Pipeline(pp=2, split=_split, loss_fn=torch.nn.functional.mse_loss, schedule="gpipe")
    assert str(spec.schedule) == "gpipe"
    with pytest.raises(ValueError, match="a pipeline has 2 stages at least"):
        Pipeline(pp=1, split=_split, loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(ValueError, match="interleaved schedules run under plain torchrun only"):
        Pipeline(pp=2, split=_split, loss_fn=torch.nn.functional.mse_loss,
                 schedule="interleaved")


def test_each_executor_refuses_the_other_loop_body():
    with pytest.raises(RuntimeError, match="this job has no pipeline"):
        Step(1, [0], 1).run_schedule(lambda j: (torch.zeros(1), torch.zeros(1)))
    spec = Pipeline(pp=2, split=_split, loss_fn=torch.nn.functional.mse_loss)
    step = Step(1, [0], 1, executor=PipelineSchedule(spec, torch.device("cpu")))
    with pytest.raises(RuntimeError, match=r"call step.run_schedule\(batch\)"):
        list(step.microbatches())


@pytest.mark.parametrize("shape,dtype", [((4, 64, 32), torch.float32), ((2, 16), torch.int64),
                                         ((3,), torch.bfloat16)])
def test_a_stage_output_shape_round_trips_as_int64(shape, dtype):
    meta = _encode(torch.zeros(shape, dtype=dtype))
    assert meta.dtype == torch.int64
    out = _decode(meta)
    assert out.shape == shape and out.dtype == dtype and out.is_meta
    with pytest.raises(ValueError, match="cannot be passed between stages"):
        _encode(torch.zeros(2, dtype=torch.complex64))
