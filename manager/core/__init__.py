"""The cache core: the one owner of node state (see `nodes` for the state diagram).

* `nodes`: the nodes, their flags and state diagram, the intrusive LRU lists.
* `ledger`: `TaskLedger`, tasks from sequence number to completion.
* `cache`: `CacheCore`, the map, pools, LRU lists, counters, invariants and every transition.
* `hooks`: what the core's clients see of each other (`RequestState`, `StorageHooks`).
"""
