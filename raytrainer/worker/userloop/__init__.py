"""Your own loop (task.loop): fn(ctx) in the group formed (userloop), and the sharded
state it saves and loads through ctx (loopshards).

Below process/; it may import loop/, input/, state/ and the base modules, never process/.
"""
