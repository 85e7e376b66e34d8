"""Prefix groups: requests of a batch whose KV begins with the same run of slots.

The radix tree hands requests that share a cached prefix the *same* slots, so the worker finds the
groups by comparing the leading entries of the requests' ``req_to_token`` rows: two requests that
hold the same slot at the same position read the same K/V there (a slot belongs to one cached token,
locked while any request uses it). Attention over a shared run is then computed once per group —
one matmul of all the group's queries against the run — and merged with each request's own pass
over the rest of its row by log-sum-exp (``kernels.attention.merge``): on the CPU by
``kernels.attention.cpu``, on a GPU by the Triton cascade decode (``kernels.attention.launch``).

Layout of one ``PrefixGroups`` for a batch of B requests::

    members       [M]      batch indices, group after group (M <= B; a request is in at most one group)
    group_starts  [G + 1]  group g = members[group_starts[g] : group_starts[g + 1]]  (>= 2 members)
    shared_lens   [G]      the run every member of g holds at positions [0, shared_lens[g])
    kv_start      [B]      where each request's own pass begins: its group's shared length, 0 alone

A group's shared run lies strictly before the first new token of each member (a query never finds
itself or a later token in the shared run), so the shared pass needs no causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Below this many shared slots a group is not worth a separate pass: the merge and the extra
# kernel cost more than reading a few keys twice.
MIN_SHARED_TOKENS = 16


@dataclass(frozen=True, slots=True)
class PrefixGroups:
    """Groups of a batch (see the module docstring). Python lists drive the CPU planning without
    device synchronisation; the tensors (on the batch's device) feed the GPU kernels."""

    members: list[int]
    group_starts: list[int]
    shared_lens: list[int]
    kv_start: list[int]
    members_t: torch.Tensor
    group_starts_t: torch.Tensor
    shared_lens_t: torch.Tensor
    kv_start_t: torch.Tensor

    @property
    def num_groups(self) -> int:
        return len(self.shared_lens)

    def group(self, g: int) -> list[int]:
        return self.members[self.group_starts[g] : self.group_starts[g + 1]]

    @classmethod
    def from_lists(
        cls, groups: list[tuple[list[int], int]], batch_size: int, device: torch.device | str = "cpu"
    ) -> PrefixGroups:
        """From ``[(member batch indices, shared length), ...]``; members of different groups are disjoint."""
        members: list[int] = []
        starts = [0]
        lens: list[int] = []
        kv_start = [0] * batch_size
        for idx, shared in groups:
            if len(idx) < 2 or shared < 1:
                raise ValueError(f"a prefix group needs >= 2 members and a shared length >= 1, got {idx}, {shared}")
            for b in idx:
                if not 0 <= b < batch_size or kv_start[b]:
                    raise ValueError(f"batch index {b} is out of range or in two prefix groups")
                kv_start[b] = shared
            members.extend(idx)
            starts.append(len(members))
            lens.append(shared)

        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(members, starts, lens, kv_start, t(members), t(starts), t(lens), t(kv_start))


def find_prefix_groups(
    req_to_token: torch.Tensor,
    rows: list[int],
    prefix_lens: list[int],
    device: torch.device | str = "cpu",
    min_shared: int = MIN_SHARED_TOKENS,
) -> PrefixGroups | None:
    """The groups of requests (batch index ``b`` owns ``rows[b]``) that share a leading slot run.

    ``prefix_lens[b]`` is how many leading positions request ``b`` may share: its tokens already in
    the cache before this step (``start_pos``), so the new tokens always stay in the request's own
    pass. Requests are bucketed by their slots at positions 0 and ``min_shared - 1``. In a bucket,
    each member's run in common with the bucket's first member (equal slots at equal positions,
    capped by both ``prefix_lens``) is measured; the group is the ``k`` members with the longest
    runs and shares the k-th longest run, ``k`` chosen to save the most key reads (``(k - 1) *
    run``). The members left out form a bucket again. Returns ``None`` when no group reaches
    ``min_shared`` tokens.

    Cost: one ``[n, L]`` comparison per bucket of ``n`` requests on the slot table, which must be a
    CPU tensor (the worker keeps a host mirror when its pools live on a GPU).
    """
    # Bucketed by the slots at positions 0 and min_shared - 1: a run of min_shared equal slots
    # holds both, and requests that merely share a first token (common with small vocabularies and
    # page size 1) are not compared position by position for nothing.
    buckets: dict[tuple[int, int], list[int]] = {}
    if min_shared > req_to_token.shape[1]:
        return None  # no row is that long
    ends = req_to_token[:, [0, max(min_shared, 1) - 1]][rows].tolist()  # one gather, not one per request
    for b, ((head, tail), n) in enumerate(zip(ends, prefix_lens, strict=True)):
        if n >= min_shared:
            buckets.setdefault((head, tail), []).append(b)
    found: list[tuple[list[int], int]] = []
    pending = [m for m in buckets.values() if len(m) > 1]
    while pending:
        members = pending.pop()
        lead = members[0]
        limit = max(prefix_lens[b] for b in members)
        table = req_to_token[[rows[b] for b in members], :limit]
        differs = table != table[0]
        # First position where each member leaves the leader (limit if never), capped by both lengths.
        first = torch.where(differs.any(1), differs.int().argmax(1), limit).tolist()
        runs = [min(f, prefix_lens[b], prefix_lens[lead]) for b, f in zip(members, first, strict=True)]
        order = sorted(range(len(members)), key=lambda i: -runs[i])
        best_k, best_gain = 0, 0
        for k in range(2, len(order) + 1):
            gain = (k - 1) * runs[order[k - 1]]
            if runs[order[k - 1]] >= min_shared and gain > best_gain:
                best_k, best_gain = k, gain
        if best_k == 0:
            continue
        chosen = sorted(members[i] for i in order[:best_k])
        found.append((chosen, runs[order[best_k - 1]]))
        rest = [members[i] for i in order[best_k:]]
        if len(rest) > 1:
            pending.append(sorted(rest))
    if not found:
        return None
    found.sort(key=lambda g: g[0][0])
    return PrefixGroups.from_lists(found, len(rows), device)
