"""Every message between the HTTP front and an engine process: one dataclass each, and
their one encoding (`encode`/`decode`, used only by `wire.Channel`).

Why typed: the front and the engine are two programs that must agree on every field, and
a message spelled as a dict in one file and read by position in another drifts without
a test noticing. Here a message is a class both sides import, a field is a name.

The encoding is JSON, ``{"op": <the class's op>, <field>: <value>, ...}``, never pickle:
a peer's bytes are data, not code. Fields are JSON types, or a dataclass (or a list of
them) whose own fields are, rebuilt by its constructor (so `SamplingParams` is validated
again on the engine's side). A list of dataclasses goes as rows of their fields in
declaration order: a step's outputs are most of the traffic, sent from the decode loop,
and field names in every row made that message 4x bigger and 3x slower to encode. A
message that does not decode (not an object, an unknown op, unknown or missing fields, a
value its class refuses) is a ValueError.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import operator
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

if typing.TYPE_CHECKING:
    from phoenixft.serve.engine.config import SamplingParams
    from phoenixft.serve.engine.llm_engine import RequestOutput

_BY_OP: dict[str, type[Message]] = {}


class Message:
    """Base of every message; `op` names it on the wire (`class Add(Message, op="add")`)."""

    op: ClassVar[str]

    def __init_subclass__(cls, op: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if op in _BY_OP:
            raise TypeError(f"two messages named {op!r}: {_BY_OP[op].__name__}, {cls.__name__}")
        cls.op = op
        _BY_OP[op] = cls


# -- front -> engine ------------------------------------------------------------------------
@dataclass
class Add(Message, op="add"):
    """A validated request (the front tokenized it and resolved its seed)."""

    id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    adapter: str | None = None
    adapter_version: int = 0  # pinned by an earlier engine (0: the current one)


@dataclass
class Abort(Message, op="abort"):
    id: str


@dataclass
class LoadAdapter(Message, op="load_adapter"):
    name: str
    path: str
    replace: bool
    token: str  # names the reply


@dataclass
class Activate(Message, op="activate"):
    """To a standby: take over the log and serve."""


# -- engine -> front ------------------------------------------------------------------------
class EngineRole(str, enum.Enum):
    """What an engine process is started as."""

    ACTIVE = "active"  # serves at once
    STANDBY = "standby"  # warm, waits for Activate to take the log over

    __format__ = str.__format__  # f"{role}" is the value on every Python

    def __str__(self) -> str:
        return self.value


@dataclass
class Hello(Message, op="hello"):
    pid: int
    role: EngineRole

    def __post_init__(self) -> None:
        self.role = EngineRole(self.role)  # (from the wire: its value; unknown: ValueError)


@dataclass
class Resumed:
    """A request the engine rebuilt from the log, with what it had emitted."""

    id: str
    prompt_tokens: int
    completion: list[int]
    emitted: list[int]  # text length after each completion token


@dataclass
class Ready(Message, op="ready"):
    """The engine serves: what it replayed (`RecoveryReport.as_dict`, plus activate_s), the
    requests it resumed, the adapters (name -> version) it holds."""

    pid: int
    report: dict
    resumed: list[Resumed]
    adapters: dict[str, int]


@dataclass
class Outputs(Message, op="out"):
    """A step's outputs; now and then (`stats` set) the engine's figures."""

    outs: list[RequestOutput]
    stats: dict | None = None


@dataclass
class Failed(Message, op="failed"):
    """Requests the engine dropped: `client` when the request itself was refused."""

    ids: list[str]
    error: str
    client: bool = False


@dataclass
class AdapterLoaded(Message, op="adapter"):
    token: str
    name: str
    version: int


@dataclass
class AdapterRefused(Message, op="adapter_error"):
    token: str
    error: str


@dataclass
class LogFailed(Message, op="log_failed"):
    """The recovery log stopped; the engine serves on."""

    error: str


@dataclass
class LogRestarted(Message, op="log_restarted"):
    """The recovery log's executor died and a new one took the log over; the engine logs
    on (a crash before the restart's full checkpoint recomputes what it lost)."""

    error: str
    pid: int


@dataclass
class Beat(Message, op="beat"):
    """The engine process is alive (its heartbeat thread, every `BEAT_S`): an engine the
    front stops hearing from is hung (SIGSTOP, a stuck kernel) and is replaced."""


BEAT_S = 0.5


@dataclass
class Fatal(Message, op="fatal"):
    """The engine is ending on this error."""

    error: str


# -- the encoding ---------------------------------------------------------------------------
def encode(msg: Message) -> bytes:
    body = {"op": msg.op}
    for f in dataclasses.fields(msg):  # type: ignore[arg-type]
        body[f.name] = _plain(getattr(msg, f.name))
    return json.dumps(body, separators=(",", ":")).encode()


def decode(data: bytes) -> Message:
    body = json.loads(data)
    if not isinstance(body, dict) or body.get("op") not in _BY_OP:
        raise ValueError(f"not a message: {str(body)[:80]}")
    cls = _BY_OP[body.pop("op")]
    hints = _hints(cls)
    if not set(body) <= set(hints):
        raise ValueError(f"{cls.op}: unknown fields {sorted(set(body) - set(hints))}")
    try:
        return cls(**{k: _build(hints[k], v) for k, v in body.items()})
    except TypeError as exc:  # a missing field, or a nested one that is not an object
        raise ValueError(f"{cls.op}: {exc}") from None


def _plain(value: Any) -> Any:
    """A field's JSON form: a dataclass as an object of its fields, a list of dataclasses
    as rows of their fields in declaration order (their own fields are JSON types)."""
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
        row = _row_getter(type(value[0]))
        return [row(v) for v in value]
    if dataclasses.is_dataclass(value):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return value


_ROWS: dict[type, Callable[[Any], tuple]] = {}


def _row_getter(cls: type) -> Callable[[Any], tuple]:
    if cls not in _ROWS:
        _ROWS[cls] = operator.attrgetter(*(f.name for f in dataclasses.fields(cls)))
    return _ROWS[cls]


def _build(hint: Any, value: Any) -> Any:
    """A field from its JSON form, by its annotation (`X`, `list[X]`, `X | None`)."""
    if value is None:
        return None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
        return [args[0](*v) for v in value]
    if dataclasses.is_dataclass(hint):
        return hint(**value)
    if len(args) == 1 and dataclasses.is_dataclass(args[0]):  # X | None
        return args[0](**value)
    return value


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """A message's field annotations, resolved on first use: the engine's types are
    imported then, not when this module is (an engine process imports it before torch)."""
    if cls not in _HINTS:
        from phoenixft.serve.engine.config import SamplingParams
        from phoenixft.serve.engine.llm_engine import RequestOutput

        names = {"SamplingParams": SamplingParams, "RequestOutput": RequestOutput,
                 "Resumed": Resumed}
        hints = typing.get_type_hints(cls, localns=names)
        _HINTS[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return _HINTS[cls]

