"""Reads shared between the ranks of a load: a box that several ranks need is
read from disk by one of them and its parts handed to the others.

* :mod:`.plan`: the coordinator's plan (shared units, owners, rounds), pure;
* :mod:`.rounds`: running that plan on one rank, round by round, inside
  DCP's ``read_data`` (every rank runs the same collectives);
* :mod:`.transport`: how parts move: the process group's point-to-point
  transfers, or copies out of a same-machine peer's memory.
"""
