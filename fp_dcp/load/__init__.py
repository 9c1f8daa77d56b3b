"""The load path: where a load's bytes come from, one concern a module
(the map of its modules is docs/ARCHITECTURE.md, ``fp_dcp/load/``).
"""
