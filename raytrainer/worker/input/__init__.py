"""How a rank reads its micro-batches: in this thread or loader processes over the BatchPlan
(input), or a Ray Data stream (raydata).

Below loop/; it may import the base modules only (not state/: the two do not meet).
"""
