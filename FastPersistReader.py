"""Not part of the package (that is fp_dcp/): reached only by `from fp_dcp import
FastPersistReader` run in the directory that holds a clone named fp_dcp, which Python then
takes for a namespace package.  FastPersistWriter.py beside it says so."""

from .FastPersistWriter import *  # noqa: F401,F403 - raises the ImportError that explains it
