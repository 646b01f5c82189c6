"""The front <-> engine messages: every one survives its encoding, and what is not a
message is refused (a peer's bytes are JSON data, never unpickled)."""

from __future__ import annotations

import json

import pytest

from phoenixft.serve.engine.config import SamplingParams
from phoenixft.serve.engine.llm_engine import RequestOutput
from phoenixft.serve.server import messages as M

ONE_OF_EACH = [
    M.Add("r1", [1, 2, 3], SamplingParams(stop=["x"], logit_bias={7: 1.5}, seed=3), 3, "ad", 2),
    M.Abort("r1"),
    M.LoadAdapter("ad", "/tmp/a.safetensors", True, "tok"),
    M.Activate(),
    M.Hello(12, "standby"),
    M.Ready(12, {"last_commit": 4, "activate_s": 0.1}, [M.Resumed("r1", 3, [5, 6], [1, 2])],
            {"ad": 2}),
    M.Outputs([RequestOutput("r1", [5], "a", False, None, 3, 1, 3, [[-0.1, [[5, -0.1]]]]),
               RequestOutput("r2", [2], "", True, "stop", 4, 2, 0)], {"running": 1}),
    M.Failed(["r1", "r2"], "boom", client=True),
    M.AdapterLoaded("tok", "ad", 2),
    M.AdapterRefused("tok", "too big"),
    M.LogFailed("disk full"),
    M.Fatal("RuntimeError()"),
    M.Beat(),
    M.LogRestarted("the log executor process exited with code -9", 1234),
]


def test_every_message_round_trips():
    assert {type(m) for m in ONE_OF_EACH} == set(M._BY_OP.values())  # a new one needs a case
    for msg in ONE_OF_EACH:
        data = M.encode(msg)
        assert json.loads(data)["op"] == msg.op
        assert M.decode(data) == msg


@pytest.mark.parametrize("data", [
    b"[1]", b'{"op": "nope"}', b'{"id": "r1"}', b'{"op": "abort"}',
    b'{"op": "abort", "id": "r1", "extra": 1}',
    b'{"op": "add", "id": "r", "prompt": [1], "params": {"max_tokens": 0}, "seed": 1}',
    b'{"op": "out", "outs": [7]}', b"\x80\x04K\x01.",  # the last: a pickle
    b'{"op": "hello", "pid": 3, "role": "boss"}',  # an engine role that does not exist
])
def test_what_is_not_a_message_is_refused(data):
    with pytest.raises(ValueError):
        M.decode(data)
