"""The tools around checkpoints, all behind ``fp-dcp``: ``cli``, ``verify``,
``convert``, ``rotation``, ``tune``, ``export_hf``.
"""
