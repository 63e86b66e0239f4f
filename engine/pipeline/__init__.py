"""Rounds over the whole model: the round runner protocol and the pure round builder, the
one-process runner, and a ring of stage processes (boot, liveness, rank 0's runner, followers)."""
