"""Prefill/decode disaggregation: a prefill instance computes prompts and their first tokens,
a decode instance continues them from the KV blocks it receives (kvserve/disagg/*.py).

- ``kvserve.config.disagg``: DisaggConfig, an instance's role and connector.
- ``params``: the ``kv_transfer_params`` that travel with a request between the instances.
- ``plan``: which blocks move (all KV groups; a sliding group's window only) and in what order.
- ``connector``: the KV connector interface; ``shm_connector`` (one host) and
  ``tcp_connector`` (two hosts) implement it, over a ``staging`` area on the prefill side.
- ``block_io``: blocks <-> transfer rows (every layer slot, int8 scales included).
- ``producer`` / ``consumer``: the engine's two sides of a transfer.
- ``router``: the OpenAI front that sends a request to a prefill, then a decode instance;
  ``launcher``: ``kvserve serve --disaggregate``, both instances and the front on one host.

The engine builds its side from ``EngineArgs.kv_transfer``.
"""
