"""The save path: from DCP's save calls to bytes on disk, one concern a module.

``writer``       ``FastPersistWriter``: the DCP ``StorageWriter`` protocol only
``plan``         what each rank reports, the coordinator's assignment of pieces,
                 and the per-process records behind DCP's plan caching
``balance``      the placement: replicated bytes divided among their holders,
                 each host's bytes striped over its devices (pure)
``layout``       where extents go in a file (pure)
``directories``  the checkpoint directory and the per-device data directories
``execute``      one rank's write: its pieces, one file per device, the engine
``device_copy``  CUDA tensors through two page-locked host buffers
``results``      what a rank reports of its write; the merge into the layout
``commit``       the lock, tmp+rename, directory syncs, clean-up
"""
