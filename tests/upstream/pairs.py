"""The storages and planners the upstream scenarios run through: DCP's own
beside fp_dcp's, by name."""

from __future__ import annotations

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from fp_dcp import FastPersistReader, FastPersistWriter
from fp_dcp.planners import FastPersistLoadPlanner, FastPersistSavePlanner

STORAGES = {
    "stock": (FileSystemWriter, FileSystemReader),
    "fp_dcp": (FastPersistWriter, FastPersistReader),
}
PLANNERS = {
    "dcp": (DefaultSavePlanner, DefaultLoadPlanner),
    "fp_dcp": (FastPersistSavePlanner, FastPersistLoadPlanner),
}
