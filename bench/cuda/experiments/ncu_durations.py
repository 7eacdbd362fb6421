"""Per-kernel durations (us) from `ncu --csv --metrics gpu__time_duration.sum ...` on stdin, one line
per kernel name in launch order of first appearance, every launch's duration on it."""
import collections
import csv
import sys

SCALE = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}

rows = csv.DictReader(line for line in sys.stdin if line.startswith('"'))
durations = collections.OrderedDict()
for row in rows:
    if row.get("Metric Name") != "gpu__time_duration.sum":
        continue
    value = float(row["Metric Value"].replace(",", "")) * SCALE.get(row.get("Metric Unit", "ns"), 1e-3)
    durations.setdefault(row["Kernel Name"][:70], []).append(value)
for name, values in durations.items():
    print(f"{name:70s} " + " ".join(f"{v:.1f}" for v in values))
