"""Multi-tier checkpointing (docs/TIERS.md): every step to node-local
storage, replicated to other nodes, drained to a persistent root every N
steps; restore from the fastest complete tier on any world size.  The entry
point is :class:`fp_dcp.tiers.manager.TierManager`.
"""
