"""The scheduler → worker step contract as plain Python types.

These mirror ``strata.worker.v1`` (see ``protos/strata/worker/v1/worker.proto``); protobuf
messages are converted to and from them at the gRPC edge (``services.common.step_codec``), so
the scheduler, the in-process link and the worker engine never handle protobuf.

One step = cache operations executed in order, then one forward pass over ``reqs``, then one
sample for each request with ``sample=True``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Validated, defaulted sampling parameters (the scheduler fills every field)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # [0, 1]
    repetition_penalty: float = 1.0  # (0, 2], 1 = off
    frequency_penalty: float = 0.0  # [-2, 2]
    presence_penalty: float = 0.0  # [-2, 2]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


GREEDY = SamplingParams(temperature=0.0)

# Numbers both sides of the step stream rely on, named once.
MAX_TOP_LOGPROBS = 20  # alternatives a sample may report (the API's ``top_logprobs`` bound)
STATES_PER_ROW = 3  # state slots one running request pins at most: working, locked match, fork in flight
HOST_PAGE_TOKENS = 64  # tokens per host / L3 page unless the worker is told otherwise


@dataclass(frozen=True, slots=True)
class MambaCopy:
    """Copy Mamba state ``src`` → ``dst`` (copy-on-write or fork); ``src`` is never modified."""

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class MambaReset:
    """Zero Mamba state ``slot`` so a request starts from the empty state."""

    slot: int


@dataclass(frozen=True, slots=True)
class ReleaseRow:
    """Forget row ``row`` of req_to_token and the worker's per-request state (not its slots)."""

    row: int


@dataclass(frozen=True, slots=True)
class PoolResize:
    """Set the KV and Mamba pools' capacities (absolute targets, in slots) without moving them.

    Growing backs fresh slots (they read as zero, or hold what they last held when their page
    was never released). Shrinking releases the tail: the scheduler must already have freed every
    slot at or above the new capacity, whose contents are lost. ``kv_slots`` is in
    ``[0, max_slots]`` and a multiple of ``WorkerInfo.slot_granularity`` (or ``max_slots``);
    ``mamba_slots`` is in ``[0, max_mamba_slots]`` (0 on a dense model). Ops and requests after
    it in the same step are validated against the new capacities.
    """

    kv_slots: int
    mamba_slots: int


@dataclass(frozen=True, slots=True)
class HostBackup:
    """Copy device KV slots into host pages (the L2 tier): ``host_pages[j]`` ←
    ``slots[j*P:(j+1)*P]`` with ``P = WorkerInfo.host_page_tokens``, every layer, K and V. Runs
    in op order, so it reads what earlier steps wrote and finishes before this step's forward."""

    job_id: int
    slots: tuple[int, ...]
    host_pages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class HostLoad:
    """Copy host pages into device KV slots (the layout of ``HostBackup``, reversed), in op order,
    before this step's forward (which may read the loaded slots)."""

    job_id: int
    host_pages: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StateBackup:
    """Copy device Mamba state slots into host state slots (hybrid models): ``host_states[j]`` ←
    ``slots[j]``, every linear-attention layer's conv and recurrent state, bit for bit. Runs in op
    order (it reads the Mamba pool as the ops before it left it, e.g. after a ``MambaCopy``) and
    finishes before this step's forward. Host state layout: ``WorkerInfo.state_layout``."""

    job_id: int
    slots: tuple[int, ...]  # device Mamba slots (read), each in [0, num_mamba_slots)
    host_states: tuple[int, ...]  # host state slots (written), same length, distinct


@dataclass(frozen=True, slots=True)
class StateLoad:
    """Copy host state slots into device Mamba slots (``StateBackup`` reversed): ``slots[j]`` ←
    ``host_states[j]``, in op order, before this step's forward (which may run from them)."""

    job_id: int
    host_states: tuple[int, ...]  # host state slots (read)
    slots: tuple[int, ...]  # device Mamba slots (written), same length, distinct


@dataclass(frozen=True, slots=True)
class L3Put:
    """Write host pages to the kvstore (L3): ``host_pages[j]`` under ``keys[j]``. Starts in op
    order and overlaps the forward; acknowledged in this step's ``StepResult.jobs``. The scheduler
    keeps the pages unchanged until then (their bytes are in fact copied when the op runs).

    ``states=True``: ``host_pages`` index host *state* slots and each value is one whole host state
    (``WorkerInfo.state_layout``); ``JobResult.pages`` then counts states."""

    job_id: int
    host_pages: tuple[int, ...]
    keys: tuple[bytes, ...]
    states: bool = False


@dataclass(frozen=True, slots=True)
class L3Get:
    """Read ``keys`` from the kvstore into ``host_pages`` (same order), stopping at the first
    missing key (or value of the wrong size); ``JobResult.pages`` says how many leading pages were
    written. Overlaps the forward; nothing in this step may read those pages.

    ``states=True``: ``host_pages`` index host *state* slots, each value is one whole host state,
    and ``JobResult.pages`` counts the leading states written."""

    job_id: int
    keys: tuple[bytes, ...]
    host_pages: tuple[int, ...]
    states: bool = False


CacheOp = (
    MambaCopy | MambaReset | ReleaseRow | PoolResize | HostBackup | HostLoad | StateBackup | StateLoad | L3Put | L3Get
)
HostOp = HostBackup | HostLoad | StateBackup | StateLoad | L3Put | L3Get


@dataclass(slots=True)
class ReqInput:
    """One request's part of a step: a prefill chunk (extend) or a single decode token.

    The new tokens take positions ``start_pos, start_pos + 1, ...``; their KV is written to
    ``new_slots`` and they attend to ``row[0:start_pos]`` plus themselves (causally).
    """

    request_id: str
    row: int
    input_ids: list[int]
    start_pos: int
    new_slots: list[int]
    # When non-empty, row[0:start_pos] := prefix_slots first (a matched cached prefix).
    prefix_slots: list[int] = field(default_factory=list)
    mamba_slot: int | None = None
    sample: bool = True
    sampling: SamplingParams = GREEDY
    seed: int = 0
    output_index: int = 0
    # Sent on a row's first step when penalties are on: every token seen so far.
    history_ids: list[int] = field(default_factory=list)
    # ceil(vocab/32) int32 words, bit i set = token i allowed; None = unconstrained. With drafts
    # (``num_draft``, scheduler-side): 1 + num_draft masks back to back, one per sampled position.
    token_bitmask: bytes | None = None
    return_logprobs: bool = False
    top_logprobs: int = 0
    # Overlap: the one input token is what this row sampled in the previous step.
    use_last_sample: bool = False
    # W3C trace context (traceparent / tracestate) on a row's first step.
    trace_context: dict[str, str] = field(default_factory=dict)
    # Overlap with a grammar: this sample's bitmask depends on the previous step's token, so it
    # arrives after the step (``LateMasks``); the worker runs the forward and waits for it.
    mask_follows: bool = False
    # Speculative decoding: the last ``num_draft`` input ids are draft tokens to verify. The worker
    # samples after every one of the ``num_draft + 1`` inputs (output indices ``output_index``,
    # ``output_index + 1``, ...) and keeps the samples up to and including the first that differs
    # from the next draft token: 1 to ``num_draft + 1`` tokens, the KV of the rejected drafts void.
    num_draft: int = 0
    # With a draft model (``--speculative-algorithm draft``): the worker writes the drafts itself
    # (the scheduler sends ``num_draft`` placeholder ids).
    worker_drafts: bool = False
    # Prompt scoring (a prefill chunk): return the logprob of the prompt token after each input
    # position (``StepResult.prompt``), the one after the last input being ``next_prompt_id``; None
    # on the prompt's last chunk, whose last position predicts the sample (or nothing) instead.
    prompt_logprobs: bool = False
    next_prompt_id: int | None = None

    @property
    def num_new(self) -> int:
        return 1 if self.use_last_sample else len(self.input_ids)


@dataclass(slots=True)
class StepRequest:
    step_id: int
    ops: list[CacheOp] = field(default_factory=list)
    reqs: list[ReqInput] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LateMasks:
    """The bitmasks of step ``step_id``'s requests with ``mask_follows``, in request order."""

    step_id: int
    masks: list[bytes]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class PromptScores:
    """What one chunk with ``prompt_logprobs`` scored: for each of its positions whose next token is
    a prompt token, in order, that token with its logprob (the model's log-softmax: no temperature,
    penalty or mask) and ``top`` alternatives, and its rank in the vocabulary (1 = most likely)."""

    logprobs: tuple[TokenLogprob, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReqOutput:
    """The sample of one request with ``sample=True``; a step's outputs follow its requests' order
    (which is how the scheduler matches them, so no request id travels back)."""

    row: int
    token_id: int
    logprob: TokenLogprob | None = None


@dataclass(frozen=True, slots=True)
class JobResult:
    """The acknowledgement of one host or L3 op: ``ok`` and the pages it moved (``L3Get``: the
    leading pages written; ``L3Put``: pages the store accepted, ``ok`` only when all were). For
    ``StateBackup`` / ``StateLoad`` and the ``states=True`` L3 ops, ``pages`` counts states."""

    job_id: int
    ok: bool
    pages: int


@dataclass(slots=True)
class StepResult:
    step_id: int
    outputs: list[ReqOutput] = field(default_factory=list)
    ops_done: int = 0
    forward_s: float = 0.0
    sample_s: float = 0.0
    idle_s: float = 0.0
    # The pools after this step's ops (the acknowledgement of a PoolResize): capacities in slots
    # and bytes of memory held (whole backing pages).
    num_slots: int = 0
    num_mamba_slots: int = 0
    kv_committed_bytes: int = 0
    mamba_committed_bytes: int = 0
    # One per host / L3 op of the step, in op order.
    jobs: list[JobResult] = field(default_factory=list)
    # One per request with ``prompt_logprobs``, in request order.
    prompt: list[PromptScores] = field(default_factory=list)


class StepError(ValueError):
    """A step the worker refuses before touching any pool (maps to INVALID_ARGUMENT)."""


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker serves and how big its pools are (mirrors ``strata.worker.v1.WorkerInfo``).

    ``num_slots`` / ``num_mamba_slots`` are the capacities at start; ``PoolResize`` moves them
    within ``[0, max_slots]`` / ``[0, max_mamba_slots]``.
    """

    model: str
    architecture: str
    fingerprint: str
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    num_slots: int
    bytes_per_slot: int
    page_size: int
    num_rows: int
    num_mamba_slots: int
    bytes_per_mamba_slot: int
    dtype: str
    hybrid: bool
    device: str
    max_slots: int  # KV reservation in slots
    max_mamba_slots: int  # Mamba reservation (0 on dense models)
    slot_granularity: int  # KV capacities must be multiples of it (or max_slots)
    mamba_slot_granularity: int  # Mamba capacities that are multiples of it release whole pages
    pool_page_bytes: int  # the backing's commit unit (OS page, or CUDA VMM granularity)
    elastic: bool  # a shrink really returns memory (False: fixed allocation, resizes are bookkeeping)
    host_pages: int = 0  # pages of the host (L2) pool; 0 = no hierarchical cache
    host_page_tokens: int = 0  # tokens per host page (a multiple of page_size)
    kv_layout: str = ""  # names a host page's bytes (for L3 keys); empty without a host pool
    l3: bool = False  # the worker reaches the kvstore shards (L3Put / L3Get work)
    host_states: int = 0  # host state slots for Mamba states (hybrid models); 0 = none
    state_layout: str = ""  # names a host state's bytes (for L3 keys of states); empty without them
    tp_size: int = 1  # tensor-parallel ranks running the model (services.worker.tp)
    draft_model: str = ""  # the speculative draft model's name, "mtp" for the MTP head ("" = none)
