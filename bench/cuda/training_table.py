"""The results table of bench/results/cuda_backward.md from bench_training.py's --json files (one per
device call, rows in the order given), with issue 14's targets: 4x at B8 T4096 H16 D128 (forward and
forward+backward), 3x on every other case, and forward+backward's extra peak memory at most 0.5x fla's.

    python3 bench/cuda/training_table.py call1/training.json call2/training.json
"""
import json
import sys

FOUR_X_CASE = "B8 T4096 H16 D128"
PEAK_BOUND = 0.5  # forward+backward's extra peak memory, as a fraction of fla's


def target(row):
    return 4 if row["case"] == FOUR_X_CASE else 3


def table_lines(rows):
    yield ("| case | pass | libgla ms | fla ms | ratio | b2b libgla / fla ms | b2b ratio "
           "| extra peak MiB libgla / fla | target |")
    yield "|---|---|---|---|---|---|---|---|---|"
    for r in rows:
        want = target(r)
        memory = f"{r['extra_peak_mib_libgla']:.0f} / {r['extra_peak_mib_fla']:.0f}"
        if r["pass"] == "fwd+bwd":
            share = r["extra_peak_mib_libgla"] / r["extra_peak_mib_fla"]
            memory += f" ({share:.2f}×) {'✓' if share <= PEAK_BOUND else '✗'}"
        yield (f"| {r['case']} | {r['pass']} | {r['libgla_ms']:.3f} | {r['fla_ms']:.3f} | "
               f"**{r['ratio']:.2f}×** {'✓' if r['ratio'] >= want else '✗'} | "
               f"{r['b2b_libgla_ms']:.3f} / {r['b2b_fla_ms']:.3f} | {r['b2b_ratio']:.2f}× | {memory} | {want}× |")


def main(paths):
    if not paths:
        sys.exit(__doc__)
    rows = [row for path in paths for row in json.load(open(path))]
    for line in table_lines(rows):
        print(line)
    print(f"\nGradients against fla's: relative RMS ≤ {max(r['max_rel_rms_vs_fla'] for r in rows):.1e}.")


if __name__ == "__main__":
    main(sys.argv[1:])
