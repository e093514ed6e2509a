"""A rank for tests/distributed/test_launch.py: writes the OMP_NUM_THREADS it sees to $OMP_REPORT.<rank>."""

import os

with open(f"{os.environ['OMP_REPORT']}.{os.environ['RANK']}", "w") as f:
    f.write(os.environ.get("OMP_NUM_THREADS", "unset"))
