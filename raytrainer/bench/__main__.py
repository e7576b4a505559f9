"""A contender's process: `python -m raytrainer.bench _contender NAME SPEC_JSON RESULT_JSON`."""

import sys

if __name__ == "__main__":  # not when spawned workers re-run this module as __mp_main__
    if len(sys.argv) == 5 and sys.argv[1] == "_contender":
        from .run import contender_main

        sys.exit(contender_main(*sys.argv[2:]))
    sys.exit("usage: raytrainer bench [options]  (python -m raytrainer.bench is for its contenders)")
