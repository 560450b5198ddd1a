"""`python -m segue.sim ...`, the same as `segue sim ...`."""
import sys
import time

from segue.sim.run import main

t0 = time.perf_counter()
rc = main()
print(f"total {time.perf_counter() - t0:.1f} s", file=sys.stderr)
sys.exit(rc)
