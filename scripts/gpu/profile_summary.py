#!/usr/bin/env python3
"""Sums an Nsight Compute per-kernel CSV (scripts/gpu/session.sh's `profile` stages) by kernel.

    python3 scripts/gpu/profile_summary.py profile-bf16.csv [rows]

Prints the step's total GPU time and launches, then the kernels by time: milliseconds, launches,
name (up to its first parenthesis). Each CSV row is one kernel name and launch configuration,
with its launch count and mean `gpu__time_duration.sum` (ns); the total is count x mean summed.
"""
import collections
import csv
import sys


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    total, launches = 0.0, 0
    by_name, counts = collections.Counter(), collections.Counter()
    with open(sys.argv[1], newline="") as f:
        for r in csv.reader(f):
            if len(r) < 15 or r[10] != "gpu__time_duration.sum":
                continue
            name = r[3].split("(")[0][:90]
            n, mean_ns = int(r[8]), float(r[14].replace(",", ""))
            by_name[name] += n * mean_ns
            counts[name] += n
            total += n * mean_ns
            launches += n
    print(f"total {total / 1e6:.2f} ms of GPU time in {launches} launches")
    for name, ns in by_name.most_common(rows):
        print(f"{ns / 1e6:8.3f} ms {counts[name]:5d}  {name}")


if __name__ == "__main__":
    main()
