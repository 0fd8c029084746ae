"""Busy a share of the time (argv[1], 0-1) in 10-ms periods: a co-running process for corunner.py."""
import sys
import time

if __name__ == "__main__":
    duty = float(sys.argv[1]); period = 0.01
    while True:
        t = time.perf_counter()
        while time.perf_counter() - t < duty * period: pass
        time.sleep((1 - duty) * period)
