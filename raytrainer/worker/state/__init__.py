"""The training state and where it goes: the state itself (state), DDP or FSDP2 over it
(strategy, sharded, syncbn, carrier), copies of it in memory (snapshot, copies), packed
for a hand-over (transfer), re-sharded (reshard), and checkpoints (saver, writer).

Below loop/ and input/; it may import the base modules only.
"""
