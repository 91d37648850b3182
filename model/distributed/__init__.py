"""A model split by layers across the ranks of `mx.distributed` (the pipeline), and the
link between the ranks (launch checks, the shared-model handshake)."""
