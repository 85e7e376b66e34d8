"""Paged attention over the slot-indexed KV pool: extend (prefill with a cached prefix) and decode.

Memory layout (one layer)::

    k_cache, v_cache   [S, Hkv, D]   slot s = one token's K/V for every KV head
    req_to_token       [R, L]        row r lists, position by position, the slot of each token of the
                                     request that owns row r (only the first seq_len entries are valid)

A request b of the batch owns row ``rows[b]``. Its keys are ``k_cache[req_to_token[rows[b], :n]]``.
The K/V of the tokens being computed are already stored (see ``kernels.kv_store``), so a new token
attends to itself through the cache like to any other position. GQA: query head ``h`` reads KV head
``h // (Hq // Hkv)`` (the layout of Hugging Face's ``repeat_kv``). Scores and softmax are in fp32.

The modules, one per implementation; the worker picks one set once, through its attention backend
(``services.worker.attention``):

* ``reference``: the torch references, the truth every other path is tested against;
* ``triton`` + ``launch``: the Triton kernels (flat extend and decode; the cascade decode's shared
  and tail passes) and their checked launchers;
* ``cpu``: torch's fused CPU flash attention pass by pass, plus the native paged decode
  (``kernels.native``), planned once per forward;
* ``prefix_groups``: which requests of a batch share a leading run of slots (the cascade's groups);
* ``merge``: the exact log-sum-exp merge of passes over disjoint keys.
"""
