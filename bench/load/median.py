#!/usr/bin/env python3
"""Medians over several runs of graphpool-load: p50 and p99 of every call of every run spec,
each run's value beside it, and each run's share of the cores taken by other processes.

    python3 median.py load-1.json load-2.json load-3.json
"""

import json
import statistics
import sys


def main(paths: list[str]) -> None:
    runs = [json.load(open(p)) for p in paths]
    print(f"{'mode':<10} {'n':>6}  {'rpc':<17} {'per s':>7} {'p50 µs':>7} {'runs':>15} "
          f"{'p99 µs':>7} {'runs':>17} {'other CPU %':>13}")
    for i, spec in enumerate(runs[0]["runs"]):
        rate = spec["rate_per_client"]
        label = f"{spec['clients']}" + (f"@{rate:g}" if rate > 0 else "")
        others = "/".join(str(round(r["runs"][i]["cpu"]["others_percent"])) for r in runs)
        for rpc in spec["rpcs"]:
            vals = [r["runs"][i]["rpcs"][rpc] for r in runs]
            p50 = [v["p50_us"] for v in vals]
            p99 = [v["p99_us"] for v in vals]
            per_s = statistics.median(v["per_second"] for v in vals)
            print(f"{spec['mode']:<10} {label:>6}  {rpc:<17} {per_s:>7.0f} {statistics.median(p50):>7.0f} "
                  f"{'/'.join(map(str, p50)):>15} {statistics.median(p99):>7.0f} "
                  f"{'/'.join(map(str, p99)):>17} {others:>13}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
