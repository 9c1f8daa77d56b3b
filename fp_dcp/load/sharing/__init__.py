"""Reads shared between the ranks of a load: a box several ranks need is read
by one of them and its parts handed to the others (``plan``: the coordinator's
plan; ``rounds``: running it; ``transport``: how parts move).
"""
