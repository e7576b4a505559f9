"""The worker process and its control channel: the Ray actor (actor), what its setup builds
(building), the calls that answer while it trains (control), how it joins a group and takes
a state (forming), the state it builds ahead (warm), a process kept for the next run
(keeping) or left by a lost driver (orphan).

The top of the worker: it may import every package below it (userloop, loop, input, state
and the base modules); none of them imports it.
"""
