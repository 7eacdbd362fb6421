"""Summarise an ncu source-page CSV (device_run.sh step `ncusrc`) by kernel region.

    python3 bench/cuda/ncu_regions.py logs/ws_sass.csv [--top N]

Regions are cut at the warp-specialised kernel's landmarks: the two setmaxnreg instructions
(state group first in the SASS, then the prep group) and every barrier (BAR.SYNC / BAR.ARV) after
them; in a kernel without setmaxnreg (dqk_kernel, step `ncudqk`) at its barriers alone. Per region: warp instructions executed per (CTA x chunk) when --per N is given (N = CTAs x
chunks, e.g. 8192 at B8 T4096 H16 D128), stall samples and the top stall reasons. --top lists the
instructions with the most samples.
"""
import argparse
import csv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=0)
    ap.add_argument("--per", type=float, default=1.0, help="divide executed counts by this (CTAs x chunks)")
    a = ap.parse_args()
    rows = list(csv.reader(open(a.csv)))
    hdr = next(r for r in rows if r and r[0] == "Address")
    idx = {h: i for i, h in enumerate(hdr)}
    data = [r for r in rows if len(r) == len(hdr) and r[0].startswith("0x")]
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    base = int(data[0][0], 16)
    regions, cur = [], None
    for r in data:
        text = r[idx["Source"]].strip()
        if cur is None or "USETMAXREG" in text or "BAR.SYNC" in text or "BAR.ARV" in text:
            cur = {"start": int(r[0], 16) - base, "first": text, "e": 0, "s": 0, "st": {}}
            regions.append(cur)
        cur["e"] += int(r[idx["Instructions Executed"]] or 0)
        cur["s"] += int(r[idx["Warp Stall Sampling (All Samples)"]] or 0)
        for s in stalls:
            cur["st"][s[6:]] = cur["st"].get(s[6:], 0) + int(r[idx[s]] or 0)
    total = sum(g["s"] for g in regions) or 1
    for g in regions:
        if g["e"] == 0 and g["s"] == 0:
            continue
        top = sorted(g["st"].items(), key=lambda x: -x[1])[:4]
        print(f"{g['start']:7x} instr {g['e'] / a.per:9.0f} samples {g['s']:6d} ({100 * g['s'] / total:4.1f}%)  "
              + " ".join(f"{k}:{v}" for k, v in top) + f"   [{g['first'][:40]}]")
    if a.top:
        print()
        ranked = sorted(data, key=lambda r: -int(r[idx["Warp Stall Sampling (All Samples)"]] or 0))[: a.top]
        for r in ranked:
            print(f"{int(r[0], 16) - base:7x} {r[idx['Warp Stall Sampling (All Samples)']]:>6} {r[idx['Source']].strip()}")


if __name__ == "__main__":
    main()
