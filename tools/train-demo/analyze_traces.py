#!/usr/bin/env python3
"""Routing statistics of the demo model from its traces (uint8 [token][layer][k], as train.py
writes them): skew (share of routings taken by the most-used quarter of each layer's experts),
temporal locality (how often an expert chosen at token t was also chosen at t-1, against the
k/n_expert a memoryless router would give), and how well calibration counts predict held-out
routing (hit rate of the top experts by calibration count, against a uniform choice).

    python3 analyze_traces.py tests/fixtures/demo [--layers 4 --k 4 --experts 32]
"""
import argparse
from pathlib import Path

import numpy as np


def load(path, L, k):
    a = np.fromfile(path, dtype=np.uint8)
    return a.reshape(-1, L, k)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    a = ap.parse_args()
    d = Path(a.dir)
    E = a.experts
    cal = load(d / "trace-calib.u8", a.layers, a.k)
    held = load(d / "trace-heldout.u8", a.layers, a.k)
    print(f"tokens: calibration {len(cal)}, held out {len(held)}")
    print("layer | top-quarter share cal / held | repeat rate (t vs t-1) held | hit rate held, top-25% by cal counts vs uniform 25%")
    for l in range(a.layers):
        cc = np.bincount(cal[:, l].ravel(), minlength=E)
        hc = np.bincount(held[:, l].ravel(), minlength=E)
        q = E // 4
        share_c = np.sort(cc)[::-1][:q].sum() / cc.sum()
        share_h = np.sort(hc)[::-1][:q].sum() / hc.sum()
        sets = [set(r) for r in held[:, l]]
        rep = np.mean([len(sets[t] & sets[t - 1]) / a.k for t in range(1, len(sets))])
        hot = np.argsort(-cc, kind="stable")[:q]
        hit = np.isin(held[:, l], hot).mean()
        print(f"{l:5d} | {share_c:.3f} / {share_h:.3f} | {rep:.3f} (memoryless {a.k / E:.3f}) | {hit:.3f} vs {q / E:.3f}")


if __name__ == "__main__":
    main()
