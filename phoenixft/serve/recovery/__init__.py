"""The recovery log: what lets another engine take a crashed one's requests over.

``recorder`` (the engine's ``StepRecorder``: one task per step onto ``ring``), ``executor``
(the process that turns tasks into ``log`` records, capturing KV through ``kv_slots``),
``regions`` (the registered state: KV slots and request state, captured and applied),
``restore`` (replay up to the last valid commit into a fresh engine).

It depends on the engine, never on the HTTP server. Nothing is imported here: the log
executor's process imports modules of this package without paying for torch.
"""
