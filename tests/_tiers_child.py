"""A one-rank job of TierManager saves whose drain of step 4 is killed at a
chosen point: ``python -m tests._tiers_child ROOT POINT``.

Steps 1-4 are saved (local tier under ROOT/node0, persistent tier under
ROOT/persist, a drain every 2 steps).  POINT is a drain protocol point
(``start``, ``copied``, ``before-commit``, ``committed``: the process
exits with status 9 when step 4's drain reaches it), ``delay:SECONDS``
(killed that long after step 4's drain starts, wherever it is) or
``never``.  Step ``s``'s state: ``w`` filled with ``s``, ``v`` =
``arange(100 s)``, ``step`` = ``s`` (:func:`expected`).  Prints the drains'
outcomes as JSON when it is not killed.
"""

from __future__ import annotations

import json
import os
import sys
import threading


def state(step: int):
    import torch

    return {"w": torch.full((1000, 300), float(step)), "v": torch.arange(step * 100.0), "step": step}


def check_loads(path: str, step: int) -> None:
    """``path`` (a persistent step directory) loads bit-exact as ``step``."""
    import torch
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader

    sd = {"w": torch.zeros(1000, 300), "v": torch.zeros(step * 100), "step": 0}
    dcp.load(sd, storage_reader=FastPersistReader(path), no_dist=True)
    want = state(step)
    if not (sd["step"] == step and torch.equal(sd["w"], want["w"]) and torch.equal(sd["v"], want["v"])):
        raise AssertionError(f"{path} does not hold step {step}")


def main(root: str, kill_at: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="file://" + os.path.join(root, f"rdv-{os.getpid()}"),
                            rank=0, world_size=1)
    from fp_dcp import TierManager
    from fp_dcp.tiers import drain

    current = [0]

    def hook(point: str) -> None:
        if current[0] != 4:
            return
        if kill_at.startswith("delay:") and point == "start 4":
            threading.Timer(float(kill_at[6:]), os._exit, (9,)).start()
        elif point.startswith(kill_at):
            os._exit(9)

    drain.fault_hook = hook
    mgr = TierManager(os.path.join(root, "node{node}"), os.path.join(root, "persist"), replicas=0,
                      persist_every=2, ranks_per_node=1, keep_persistent=5)
    for step in range(1, 5):
        current[0] = step
        mgr.save(step, state(step))
        mgr.wait()
    mgr.close()
    print(json.dumps({s: h["drain"].ok for s, h in mgr.history.items() if "drain" in h}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
