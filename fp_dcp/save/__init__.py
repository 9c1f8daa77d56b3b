"""The save path: from DCP's save calls to bytes on disk, one concern a module
(the map of its modules is docs/ARCHITECTURE.md, ``fp_dcp/save/``).
"""
