"""The settings every part of a job shares, as one tree of small dataclasses.

`phoenixft run` builds an `AgentConfig` (launch/config.py) whose branches are the
dataclasses below; the agent hands the branches a worker needs (`Timeouts`, `Snapshots`,
`Persistence`, `Policy`, `Stragglers`, `Fingerprints`) to every worker whole, as JSON,
and the worker's `SessionConfig` (train/config.py) is built from that JSON with the same
classes, so each setting is declared, defaulted and checked in exactly one place. The run
CLI is built from one declaration per option (launch/options.py) that names the setting's
path in this tree.

Every dataclass checks its own fields when it is built and raises `ConfigError`. An
error names settings by their path in braces (`{persistence.every} must be >= 1`): `str`
spells them as paths, the CLI as its flags (`--persist-every must be >= 1`), so the
same check speaks each caller's language.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_NAME = re.compile(r"\{([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)\}")


class ConfigError(ValueError):
    """A bad setting. `template` names settings as `{path}`; `render(name)` spells each
    path with `name(path)` (a CLI passes its flag for the path)."""

    def __init__(self, template: str) -> None:
        self.template = template
        super().__init__(self.render(lambda path: path))

    def render(self, name: Callable[[str], str]) -> str:
        return _NAME.sub(lambda m: name(m.group(1)), self.template)

    def within(self, prefix: str) -> ConfigError:
        """The same error for a branch built at `prefix` (its paths get the prefix)."""
        return type(self)(_NAME.sub(lambda m: "{" + f"{prefix}.{m.group(1)}" + "}",
                                    self.template))


class Policy(str, enum.Enum):
    """Microbatches per step after the world shrinks (no spare left)."""

    CONSTANT = "constant"  # the same M as a failure-free run: the same gradients (ReCoVer)
    SHRINK_BATCH = "shrink-batch"  # fewer microbatches: the global batch shrinks

    __format__ = str.__format__  # f"{p}" is the value on every Python, not Policy.CONSTANT

    def __str__(self) -> str:
        return self.value


def seconds(name: str, value: Any) -> None:
    """`value` is a finite number of seconds > 0 (NaN and infinity are refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{{{name}}} must be a finite number of seconds > 0, got {value}")


@dataclass(kw_only=True, frozen=True, slots=True)
class Timeouts:
    """Deadlines of the generation protocol. Hangs are caught by heartbeats long before
    `collective_timeout_s`, which is a backstop for one collective."""

    heartbeat_interval_s: float = 0.2
    heartbeat_timeout_s: float = 3.0  # silence after which a worker counts as hung
    collective_timeout_s: float = 60.0
    join_timeout_s: float = 60.0  # waiting for a plan, building a generation's groups
    startup_timeout_s: float = 120.0  # from launch to the first generation
    spare_wait_s: float = 24 * 3600.0  # how long a spare waits to be activated

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            seconds(f.name, getattr(self, f.name))
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ConfigError("{heartbeat_timeout_s} must exceed twice the heartbeat interval "
                              f"({self.heartbeat_interval_s} s)")


@dataclass(kw_only=True, frozen=True, slots=True)
class Snapshots:
    """Per-step snapshots into the node's shared memory, and their replicas."""

    enabled: bool = True  # off only to measure what snapshots cost (no recovery then)
    # peers holding a copy of each rank's snapshot. None: one on another node (none in a
    # one-node job, whose snapshots outlive their workers in shared memory); K: K peers,
    # on other nodes first, then on this node
    replicas: int | None = None
    # benchmark only: snapshots on for K steps, off for K, ... (K even: a snapshot must not
    # land in the slot of the newest committed one, see checkpoint/snapshot.py)
    blocks: int = 0

    def __post_init__(self) -> None:
        if self.replicas is not None and self.replicas < 0:
            raise ConfigError(f"{{replicas}} must be >= 0, got {self.replicas}")
        if self.blocks < 0 or self.blocks % 2:
            raise ConfigError(f"{{blocks}} must be 0 or even, got {self.blocks} (an odd gap "
                              "between snapshots would overwrite the newest committed one)")


@dataclass(kw_only=True, frozen=True, slots=True)
class Persistence:
    """The persistent tier: bases every `every` records, deltas between, written in the
    background within `cpu_share` of one core (checkpoint/persist.py)."""

    url: str | None = None  # a directory or s3://bucket/prefix; None: no persistent tier
    every: int = 10
    keep: int = 2  # bases kept, with their deltas and manifests
    cpu_share: float = 0.05
    resume: bool = False  # the job must start from a persisted step, never afresh
    # a new job's start: a checkpoint in torch.distributed.checkpoint's default format
    # (ours, torchtitan's, or any dcp.save of torchtitan's keys), sharded models only
    init_from: str | None = None

    def __post_init__(self) -> None:
        if self.init_from is not None and not self.init_from.strip():
            raise ConfigError("{init_from} is empty: name the checkpoint's directory")
        if self.init_from is not None and self.resume:
            raise ConfigError("{init_from} starts a new job and {resume} continues one: "
                              "give one of them")
        if self.url is not None and not self.url.strip():
            raise ConfigError("{url} is empty: name a directory or s3://bucket/prefix")
        for name in ("every", "keep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{{{name}}} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.cpu_share <= 1:  # NaN fails too
            raise ConfigError(f"{{cpu_share}} must be in (0, 1], got {self.cpu_share}")
        if self.resume and not self.url:
            raise ConfigError("{resume} needs {url} (where the job's checkpoints are)")


class StragglerAction(str, enum.Enum):
    """What is done with a straggler (`--straggler`)."""

    OFF = "off"
    REPORT = "report"  # an event and a console line
    SWAP = "swap"  # a spare takes its rank
    REBALANCE = "rebalance"  # it gets fewer microbatches

    __format__ = str.__format__  # f"{action}" is the value on every Python

    def __str__(self) -> str:
        return self.value


@dataclass(kw_only=True, frozen=True, slots=True)
class Stragglers:
    """Finding a rank that makes the others wait (train/straggler.py): each rank's time
    per step (step start to ready to reduce) over the median of the other ranks', its
    lower quartile over the last `window` steps (slower on three steps in four), flagged
    at `ratio` or more; or its process's stalls (stopped, frozen) adding up, on two steps
    or more, to `ratio - 1` times the others' time over the window."""

    action: StragglerAction = StragglerAction.REPORT  # (its value is taken too)
    window: int = 20
    # 2: on this 2-core machine, 3 workers beside a busy process and a test suite, the
    # highest median ratio over 20 steps of a failure-free run was 1.41, once 1.56
    ratio: float = 2.0

    ACTIONS = tuple(a.value for a in StragglerAction)

    def __post_init__(self) -> None:
        if self.action not in self.ACTIONS:
            raise ConfigError(f"{{action}} must be one of {', '.join(self.ACTIONS)}, got "
                              f"{self.action!r}")
        object.__setattr__(self, "action", StragglerAction(self.action))
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 3:
            raise ConfigError(f"{{window}} must be an integer >= 3 (steps), got {self.window}")
        if not (isinstance(self.ratio, (int, float)) and math.isfinite(self.ratio)
                and self.ratio > 1):
            raise ConfigError(f"{{ratio}} must be a finite number > 1, got {self.ratio}")


@dataclass(kw_only=True, frozen=True, slots=True)
class Fingerprints:
    """Silent data corruption found by consensus (train/consensus.py): every `every`
    steps each rank digests the step's reduced gradients and its parameters, which every
    data-parallel rank must hold bit for bit, and a strict majority (or a replay of the
    step's collectives) names the rank that differs; every step each rank checks its own
    unique state against its last snapshot's seal. 0: off. Every `recompute_every` steps
    each rank also recomputes two peers' first microbatches, so faults in the arithmetic
    that every rank would sum alike are found (train/recompute.py); 0: off (the default:
    it needs each microbatch's data drawn from its id)."""

    every: int = 1
    # "carried": the digests ride in the step's own all-reduce (the step before's reduced
    # gradients, the state now), a difference found rolls back to the step before it;
    # "separate": one more tiny all-reduce after the step's, before its update
    vote: str = "carried"
    recompute_every: int = 0
    # benchmark only: the checks on for K steps, off for K, ... (bench consensus measures
    # their cost inside one run, as bench overhead does the snapshots')
    blocks: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise ConfigError(f"{{every}} must be an integer >= 0 (0: off), got {self.every}")
        if isinstance(self.blocks, bool) or not isinstance(self.blocks, int) or self.blocks < 0:
            raise ConfigError(f"{{blocks}} must be an integer >= 0 (0: always on), got {self.blocks}")
        if self.vote not in ("carried", "separate"):
            raise ConfigError(f"{{vote}} must be carried or separate, got {self.vote!r}")
        k = self.recompute_every
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError(f"{{recompute_every}} must be an integer >= 0 (0: off), got {k}")


@dataclass(kw_only=True, frozen=True, slots=True)
class Groups:
    """Process groups across generations (train/kept_groups.py): a new generation keeps
    every mesh group whose members and collectives it finds whole, and rebuilds the rest.
    keep=False rebuilds every group every generation (the behaviour before; a
    benchmark's baseline)."""

    keep: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.keep, bool):
            raise ConfigError(f"{{keep}} must be true or false, got {self.keep!r}")


def build(cls: type, data: dict[str, Any]) -> Any:
    """`cls` from a nested dict (JSON, or what a CLI collected): branches that are
    dataclasses are built from their own dicts, enums from their values, and a
    `ConfigError` names the path of the setting at fault. Unknown keys are errors."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown setting{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(unknown)} for {cls.__name__}")
    kwargs = {}
    for key, value in data.items():
        kind = hints[key]
        try:
            if dataclasses.is_dataclass(kind) and isinstance(value, dict):
                value = build(kind, value)
            elif isinstance(kind, type) and issubclass(kind, enum.Enum) and \
                    not isinstance(value, kind):
                try:
                    value = kind(value)
                except ValueError:
                    choices = ", ".join(repr(m.value) for m in kind)
                    raise ConfigError(f"{{{key}}} must be one of {choices}, got {value!r}") \
                        from None
        except ConfigError as exc:
            raise exc.within(key) if dataclasses.is_dataclass(kind) else exc from None
        kwargs[key] = value
    return cls(**kwargs)


def to_dict(obj: Any) -> dict[str, Any]:
    """A config tree as plain JSON-able data (`build` takes it back)."""
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            v = to_dict(v)
        elif isinstance(v, enum.Enum):
            v = v.value
        out[f.name] = v
    return out


def default_of(cls: type, path: str) -> Any:
    """The default of the setting at `path` (dotted) in the tree rooted at `cls`."""
    head, _, rest = path.partition(".")
    f = next((f for f in dataclasses.fields(cls) if f.name == head), None)
    if f is None:
        raise KeyError(f"{cls.__name__} has no setting {head!r}")
    if rest:
        return default_of(typing.get_type_hints(cls)[head], rest)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None
