"""The tools around checkpoints, each one concern, all behind ``fp-dcp``.

``cli``       the ``fp-dcp`` command line (``python -m fp_dcp``): argument
              parsing and one error path; it imports the others lazily
``verify``    read every block of a checkpoint and check its CRC-32C
``convert``   fp_dcp <-> torch.save / stock DCP checkpoints, objects through
              the safe unpickler
``rotation``  the committed checkpoints under a folder; keep the newest N,
              deleting only files provably a checkpoint's own
"""
