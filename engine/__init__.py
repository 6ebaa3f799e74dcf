"""Engine-side code kvtier owns: what runs inside an inference engine's processes.

An engine adapter (`kvtier.integrations.*`) translates its engine's calls; everything below it
that is kvtier's own lives here: the node-service client (attached mode), the embedded stack
(embedded mode), engine KV registration and the host-pool copier. Layers:
integrations -> engine -> admin -> manager -> worker.
"""
