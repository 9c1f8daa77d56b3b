"""Pinning host memory (``mlock``, CUDA host registration) for the staging arena
and the CUDA double buffers; a failure warns and the save goes on, slower."""

from __future__ import annotations

import warnings

import torch

from fp_dcp import _native

__all__ = ["lock_pages", "cuda_register", "cuda_unregister"]

# cudaHostRegister flags (cuda_runtime_api.h)
_CUDA_HOST_REGISTER_DEFAULT = 0
_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, not only the current device's


def lock_pages(address: int, size: int, what: str) -> bool:
    """``mlock`` ``size`` bytes at ``address``; whether it worked.  The first
    failure in this process warns (naming ``what``), later ones are silent.
    The extension does the locking (the same call and warning as its
    ``AlignedBuffer``)."""
    return _native.lock_pages(address, size, what)


def cuda_register(address: int, size: int, what: str, *, portable: bool = False) -> bool:
    """Register ``size`` bytes at ``address`` with CUDA (``cudaHostRegister``)
    so that device-to-host copies into them are DMA transfers; whether it
    worked (a failure warns, naming ``what``).  ``portable``: for every
    device's context.  The caller checks ``torch.cuda.is_available()``."""
    flags = _CUDA_HOST_REGISTER_PORTABLE if portable else _CUDA_HOST_REGISTER_DEFAULT
    rc = torch.cuda.cudart().cudaHostRegister(address, size, flags)
    if int(rc) == 0:
        return True
    warnings.warn(
        f"fp_dcp: cudaHostRegister of the {size}-byte {what} failed ({rc}); "
        f"device-to-host copies into it will not be DMA transfers",
        RuntimeWarning,
        stacklevel=3,
    )
    return False


def cuda_unregister(address: int) -> None:
    """Undo :func:`cuda_register`; quiet when CUDA is already torn down (a
    finalizer at interpreter exit)."""
    try:
        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:  # noqa: BLE001
        pass
