"""A Task's step and epoch loop (plain torch, no Ray) and what it is made of: the step
(step), validation (evaluate, validation), metrics (window), sizing and the LR schedule
(sizing, schedule), recovery (handover, rollback, nonfinite), stopping, compiling, chaos.

Below process/ and userloop/; it may import input/, state/ and the base modules only.
"""
