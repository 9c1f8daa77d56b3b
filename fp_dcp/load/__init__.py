"""The load path: where a load's bytes come from.  Data flows one way:

* :mod:`.reader`: ``FastPersistReader``, the DCP ``StorageReader`` protocol,
  and the engines it owns;
* :mod:`.jobs`: read items turned into jobs (pieces of engine calls and the
  copies after them), using the pure grid functions of :mod:`.plan`;
* :mod:`.execute`: jobs run through the engine (batches, fillers,
  checksums, the arena);
* :mod:`.sharing`: reads shared between ranks (the coordinator's plan, the
  rounds, the peer-memory transport);
* :mod:`.objects`, :mod:`.stock`: bytes items rebuilt safely; stock DCP
  checkpoints read without unpickling code.
"""
