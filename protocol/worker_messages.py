"""The daemon <-> gpu_worker link (docs/architecture.md §7): one StepPlan at a time, one
StepResult (or WorkerError) back; READY once at start, heartbeats while alive."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar

import numpy as np

from protocol.fields import array_field, check
from protocol.kinds import MsgKind
from protocol.sampling import SamplingDefaults, SamplingParams

MAX_ROUTE_KEY = 1 << 63  # SlotWork.route_key is below it (an int64 on the device)


class WorkKind(IntEnum):
    PREFILL = 1  # a chunk of the prompt
    DECODE = 2  # last committed token, then 0..k drafts


class DraftSource(IntEnum):
    MTP = 1
    SUFFIX = 2  # the request's own history
    GLOBAL_SUFFIX = 3  # text other requests hold (daemon/proposers/global_suffix.py)


class Phase(IntEnum):
    PREFILL = 1
    DECODE = 2


class CacheOpKind(IntEnum):
    ALLOCATE = 1  # slot; num_tokens = KV tokens to reserve
    FREE = 2  # slot
    SHARE_PREFIX = 3  # slot <- first num_tokens of entry_id, copy-on-write
    CHECKPOINT = 4  # slot's recurrent state (+ KV block refs) at num_tokens -> entry_id
    SWAP_OUT = 6  # slot's KV blocks and states -> host memory as entry_id; slot freed
    SWAP_IN = 7  # entry_id -> slot; entry consumed
    DROP_CHECKPOINT = 8  # forget entry_id (checkpoint, prefix entry or swapped-out slot)
    OFFLOAD = 9  # prefix entry entry_id -> host memory (KV and state copied, its blocks freed)


class WorkerErrorCode(IntEnum):
    INTERNAL = 1
    BAD_PLAN = 2  # the worker refused a plan (e.g. a cache op named an unknown entry)
    MODEL_LOAD = 4
    CPU_WORKER_DIED = 5
    PROTOCOL = 6


@dataclass(slots=True, kw_only=True)
class SlotWork:
    """One slot's rows in a step: input_ids, then draft_ids, at positions start_pos...

    Rows = num_tokens + len(draft_ids). For decode, input_ids is the last committed token.
    """

    slot: int
    request_id: str
    kind: WorkKind
    input_ids: np.ndarray = array_field(np.int32, 1)  # [num_tokens]
    start_pos: int  # absolute position of input_ids[0]
    num_tokens: int
    needs_logits: bool  # sample after the last row; False for a non-final prefill chunk
    sampling: SamplingParams = field(default_factory=SamplingParams)
    draft_ids: np.ndarray = array_field(np.int32, 1, empty=True)  # [k]
    draft_sources: np.ndarray = array_field(np.uint8, 1, empty=True)  # [k] DraftSource
    prompt_len: int
    cached_len: int = 0
    mtp_drafts: int = 0  # keep the slot's MTP state and propose this many drafts after it
    # a synthetic model's routing key for the request's rows (the daemon's hash of its
    # `user`, 0 <= key < 2**63; None: the slot). Real models ignore it (docs/synthetic.md)
    route_key: int | None = None

    def __post_init__(self) -> None:
        check(self.slot >= 0 and self.start_pos >= 0, "slot and start_pos must be >= 0")
        check(self.route_key is None or 0 <= self.route_key < MAX_ROUTE_KEY,
              "route_key must be in 0..2**63-1")
        check(0 <= self.mtp_drafts <= 64, "mtp_drafts must be in 0..64")
        check(self.num_tokens == len(self.input_ids) > 0,
              "num_tokens must equal len(input_ids) > 0")
        check(len(self.draft_ids) == len(self.draft_sources), "one draft source per draft")
        check(self.kind == WorkKind.DECODE or len(self.draft_ids) == 0, "drafts only in decode")
        check(0 <= self.cached_len <= self.prompt_len, "need 0 <= cached_len <= prompt_len")
        check(self.sampling.seed is not None, "the daemon resolves the seed before planning")

    @property
    def num_rows(self) -> int:
        return self.num_tokens + len(self.draft_ids)


_OP_NEEDS = {  # op -> (needs slot, needs entry_id)
    CacheOpKind.ALLOCATE: (True, False), CacheOpKind.FREE: (True, False),
    CacheOpKind.SHARE_PREFIX: (True, True), CacheOpKind.CHECKPOINT: (True, True),
    CacheOpKind.SWAP_OUT: (True, True), CacheOpKind.SWAP_IN: (True, True),
    CacheOpKind.DROP_CHECKPOINT: (False, True), CacheOpKind.OFFLOAD: (False, True),
}


@dataclass(slots=True, kw_only=True)
class CacheOp:
    """A cache command; entry ids (checkpoints, prefix entries, swap handles) are the daemon's."""

    op: CacheOpKind
    slot: int | None = None
    num_tokens: int = 0
    entry_id: int | None = None

    def __post_init__(self) -> None:
        check(self.num_tokens >= 0, "num_tokens must be >= 0")
        need_slot, need_entry = _OP_NEEDS[self.op]
        check((self.slot is not None) == need_slot, f"{self.op.name}: slot {need_slot=}")
        check((self.entry_id is not None) == need_entry, f"{self.op.name}: entry_id {need_entry=}")
        check(self.op != CacheOpKind.SHARE_PREFIX or self.num_tokens > 0,
              "SHARE_PREFIX needs num_tokens > 0")


@dataclass(slots=True, kw_only=True)
class StepPlan:
    """daemon -> worker: run cache_ops, one forward over all slots' rows (narrow speculation:
    one more per drafted slot), then cache_ops_after."""

    KIND: ClassVar[MsgKind] = MsgKind.STEP_PLAN
    step_id: int
    slots: list[SlotWork] = field(default_factory=list)
    cache_ops: list[CacheOp] = field(default_factory=list)
    cache_ops_after: list[CacheOp] = field(default_factory=list)  # e.g. end-of-prompt checkpoint
    wide: bool = True  # drafted slots in the one forward pass; False: one pass each (narrow)
    # report each decode slot's CPU experts (SlotResult.cpu_experts) where the WorkerConfig's
    # slot_routing allows: the adaptive draft budget asks on the steps before it chooses again
    slot_routing: bool = True

    def __post_init__(self) -> None:
        ids = [s.slot for s in self.slots]
        check(len(ids) == len(set(ids)), "a slot appears twice in one StepPlan")

    @property
    def num_rows(self) -> int:
        return sum(s.num_rows for s in self.slots)


@dataclass(slots=True, kw_only=True)
class PromptPhase:
    """Where a slot's prompt stands after a step (docs/architecture.md §8)."""

    phase: Phase
    prompt_tokens_this_step: int  # 0 unless this step did prompt work for the slot
    prompt_len: int
    cached_len: int  # prompt tokens reused from the prefix cache, never prefilled

    def __post_init__(self) -> None:
        check(0 <= self.cached_len <= self.prompt_len, "need 0 <= cached_len <= prompt_len")
        check(0 <= self.prompt_tokens_this_step <= self.prompt_len,
              "prompt_tokens_this_step out of range")


@dataclass(slots=True, kw_only=True)
class SlotResult:
    slot: int
    request_id: str
    token_ids: list[int]  # accepted drafts + one sampled token; [] if nothing was sampled
    num_accepted: int  # drafts accepted
    prompt: PromptPhase
    drafts: list[int] = field(default_factory=list)  # MTP drafts for the slot's next step
    # a decode slot's distinct CPU experts this step (layer * experts per layer + expert) and
    # how many of its rows picked each; sent only when WorkerConfig.slot_routing and the
    # StepPlan's ask
    cpu_experts: np.ndarray = array_field(np.int32, 1, empty=True)  # [K]
    cpu_expert_rows: np.ndarray = array_field(np.uint16, 1, empty=True)  # [K]

    def __post_init__(self) -> None:
        check(0 <= self.num_accepted <= max(len(self.token_ids) - 1, 0), "num_accepted too big")
        check(len(self.cpu_experts) == len(self.cpu_expert_rows), "one row count per expert")
        check(not len(self.cpu_experts) or (int(self.cpu_experts.min()) >= 0
                                            and int(self.cpu_expert_rows.min()) >= 1),
              "cpu_experts must be >= 0, each picked by >= 1 row")


@dataclass(slots=True, kw_only=True)
class StepResult:
    """worker -> daemon, one per StepPlan."""

    KIND: ClassVar[MsgKind] = MsgKind.STEP_RESULT
    step_id: int
    slots: list[SlotResult] = field(default_factory=list)
    timings_ms: dict[str, float] = field(default_factory=dict)  # "forward", "cpu_experts", ...
    counters: dict[str, int] = field(default_factory=dict)  # "rows", "gpu_experts", ...


@dataclass(slots=True, kw_only=True)
class KvLayout:
    """The worker's pool of KV blocks, as allocated; the prefix cache's budget is part of it."""

    block_size: int  # tokens per block
    block_bytes: int  # one block over every KV layer: K and V (+ the int8 scales)
    num_blocks: int  # max_slots * ceil(max_context / block_size) + prefix_blocks
    prefix_blocks: int  # of num_blocks, what the daemon's prefix cache may pin (0: no cache)
    dtype: str  # "int8", or the compute dtype ("float32", ...)
    state_bytes: int = 0  # one slot's recurrent (GDN) states: what each prefix entry copies

    def __post_init__(self) -> None:
        check(self.block_size > 0 and self.block_bytes >= 0, "block_size must be > 0")
        check(self.state_bytes >= 0, "state_bytes must be >= 0")
        check(0 <= self.prefix_blocks <= self.num_blocks, "prefix_blocks out of range")

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(slots=True, kw_only=True)
class ModelInfo:
    """What the daemon learns of the model from the worker (it reads no model file itself)."""

    name: str
    vocab_size: int  # prompt ids must be below it: the daemon refuses others at admission
    max_slots: int
    max_context: int
    eos_token_ids: list[int]  # generation_config.json's eos_token_id (else config.json's)
    generation_defaults: SamplingDefaults  # generation_config.json's sampling values
    kv: KvLayout
    # a synthetic model: experts are picked by SlotWork.route_key (docs/synthetic.md), so a
    # prefix's states depend on the key and the daemon shares them only within one key
    synthetic_routing: bool = False
    # decode and verify passes run padded up to the next of protocol.worker_config's
    # GRAPH_BUCKETS rows (CUDA graphs in capacity buckets, gpu_worker/graph_buckets.py): a
    # pass of 13 rows costs the GPU what one of 16 does (the adaptive draft budget's cost)
    padded_passes: bool = False


@dataclass(slots=True, kw_only=True)
class ReadyMsg:
    """worker -> daemon once, after the model is loaded and the CPU expert workers are up."""

    KIND: ClassVar[MsgKind] = MsgKind.READY
    protocol_version: int
    model: ModelInfo
    pid: int
    # the cores off the CPU expert workers' that the worker keeps to and the daemon should
    # ([]: none; protocol/host_cores.py)
    host_cores: list[int] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class WorkerError:
    """worker -> daemon. fatal: the worker exits after sending it."""

    KIND: ClassVar[MsgKind] = MsgKind.WORKER_ERROR
    code: WorkerErrorCode
    message: str
    fatal: bool = False
    step_id: int | None = None


@dataclass(slots=True, kw_only=True)
class Heartbeat:
    """worker -> daemon every `WorkerConfig.heartbeat_s` while idle, and after a step when
    one is due (a step itself is not interrupted: a long step is a long silence)."""

    KIND: ClassVar[MsgKind] = MsgKind.HEARTBEAT
    seq: int  # 0, 1, 2, ... per worker process
    time_ns: int  # the worker's time.monotonic_ns()


@dataclass(slots=True, kw_only=True)
class Shutdown:
    """daemon -> worker: exit now (between steps; the daemon sends no plan after it)."""

    KIND: ClassVar[MsgKind] = MsgKind.SHUTDOWN
    reason: str = ""
