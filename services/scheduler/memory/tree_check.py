"""`PrefixTree.sanity_check`: recount the tree from scratch and compare with its incremental
counters and index sets. Reads the tree's internals on purpose: it is the tree's own check, kept
apart so the tree's logic reads without it. Raises AssertionError (also under ``python -O``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.scheduler.memory.tree_util import check, child_key

if TYPE_CHECKING:
    from services.scheduler.memory.tree import PrefixTree


def check_tree(t: PrefixTree) -> None:
    ps = t.page_size
    evictable = protected = s_evictable = s_protected = leaves = stateful = 0
    seen_kv: set[int] = set()
    seen_states: set[int] = set()
    for extra, root in t.books.roots.items():
        check(root.parent is None and not root.key and root.extra == extra, "malformed root")
        check(root.state is None and root.own_lock == 0, "a root holds a state or a lock")
        check(bool(root.children), f"empty root kept for extra {extra!r}")
        stack = [root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for ck, child in node.children.items():
                check(child.parent is node and not child.evicted, "broken parent link")
                check(child.extra == extra, "node shared across extra keys")
                check(len(child.key) > 0 and len(child.key) % ps == 0, "edge not whole pages")
                check(len(child.value) == len(child.key), "key/value length mismatch")
                check(child.depth == node.depth + len(child.key), "stale depth")
                check(ck == child_key(child.key, 0, ps), "child indexed under the wrong key")
                child_locks += child.lock_ref
                stack.append(child)
            if node is root:
                continue
            check(node.own_lock >= 0, "negative lock count")
            check(node.lock_ref == node.own_lock + child_locks, "lock counts disagree with the subtree")
            if node.lock_ref:
                protected += len(node.value)
            else:
                evictable += len(node.value)
            before = len(seen_kv)
            seen_kv.update(node.value)
            check(len(seen_kv) == before + len(node.value), "a KV slot is cached twice")
            check((not node.children) == (node in t.books.leaves), "leaf set out of date")
            leaves += not node.children
            check((node.state is not None) == (node in t.books.stateful), "stateful set out of date")
            if not t.has_states:
                check(node.state is None, "a state in a tree without states")
                continue
            check(bool(node.children) or node.state is not None, "a leaf is a tombstone")
            if node.state is None:
                check(node.own_lock == 0, "a lock on a node without a state")
                continue
            stateful += 1
            check(node.state not in seen_states, f"state slot {node.state} is cached twice")
            seen_states.add(node.state)
            if node.own_lock:
                s_protected += 1
            else:
                s_evictable += 1
    check(leaves == len(t.books.leaves), "leaf set holds removed nodes")
    check(stateful == len(t.books.stateful), "stateful set holds removed nodes")
    check(evictable == t.books.evictable, f"evictable {t.books.evictable} != recount {evictable}")
    check(protected == t.books.protected, f"protected {t.books.protected} != recount {protected}")
    check(s_evictable == t.books.state_evictable, f"state_evictable {t.books.state_evictable} != {s_evictable}")
    check(s_protected == t.books.state_protected, f"state_protected {t.books.state_protected} != {s_protected}")
