"""The node service: `kvtier serve` as the node's KV cache, shared by every engine on the node.

* `wire`: the engine <-> service frame format (the one module both sides import).
* `namespaces`: one keyed stack per namespace, its quota and geometry.
* `server`: the Unix socket endpoint, peer checks, one session per engine connection.
"""
