"""A rank for tests/distributed/test_launch.py: on SIGTERM it takes a while to stop (as a rank finishing its step and
saving), then writes $STOP_REPORT.<rank> and exits 143."""

import os
import signal
import time

report = f"{os.environ['STOP_REPORT']}.{os.environ['RANK']}"


def stop(signum, frame):
    time.sleep(1.0)
    with open(report, "w") as f:
        f.write("stopped")
    os._exit(128 + signum)


signal.signal(signal.SIGTERM, stop)
open(report + ".ready", "w").close()
while True:
    time.sleep(0.05)
