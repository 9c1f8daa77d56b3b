"""Multi-tier checkpointing (``docs/TIERS.md``): every step to node-local
storage, replicated to other nodes over a process group, drained to a
persistent root every N steps; restore from the fastest complete tier on
any world size.

The public entry point is :class:`fp_dcp.tiers.manager.TierManager` (also
``fp_dcp.TierManager``).  Modules, one concern each: ``topology`` (nodes,
replica placement), ``store`` (owned directories, retention, through
:mod:`fp_dcp.files`), ``integrity`` (checksummed copies), ``replicate``
(bytes between ranks), ``agree`` (every rank's outcome of a phase, as plain
data: :mod:`fp_dcp.wire`), ``drain`` (local -> persistent commit),
``plan`` (a restore's records and planning), ``moves`` (a restore's replica
transfers), ``restore`` (agreement, assembly, load), ``manager`` (the
loop's API).
"""
