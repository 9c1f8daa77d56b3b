"""Staging: ``FastPersistWriter`` as DCP's ``AsyncStager`` (docs/STAGING.md).
The rest of the package uses only what is exported here.
"""

from fp_dcp.staging.crc_registry import any_staged_checksums, forget_staged_checksums, staged_checksums
from fp_dcp.staging.stager import AsyncStagingMixin

__all__ = ["AsyncStagingMixin", "staged_checksums", "forget_staged_checksums", "any_staged_checksums"]
