"""A rank that says it started and then sleeps (for the launcher's timeout test): ``python -m sleep_worker MARK``."""

import sys
import time

if __name__ == "__main__":
    print(f"started {sys.argv[1]}", flush=True)
    time.sleep(600)
