"""Print the GPU check's final table from the JSON that gpu_kernels.py / gpu_e2e.py wrote and the test log.

    python bench/gpu_report.py --tests-log tests.log --tests-rc 0 kernels.json e2e.json
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any


def _metric(r: dict[str, Any]) -> str:
    if "gbps" in r:
        return f"{r['gbps']:.0f} GB/s"
    if "tflops" in r:
        return f"{r['tflops']:.0f} TFLOP/s"
    if "tok_per_s" in r:
        return f"{r['tok_per_s']:.0f} tok/s"
    if "speedup" in r:
        return f"x{r['speedup']:.2f} vs torch"
    return ""


def _detail(r: dict[str, Any]) -> str:
    parts = []
    if "pct_ceiling" in r:
        parts.append(f"{r['pct_ceiling']:.0f}% of ceiling")
    if "pct_roofline" in r:
        bound = f", {r['bound']}-bound" if "bound" in r else ""
        parts.append(f"{r['pct_roofline']:.0f}% of roofline ({r['roofline_ms']:.2f} ms{bound})")
    if "speedup" in r and ("gbps" in r or "tflops" in r):
        parts.append(f"x{r['speedup']:.2f} vs torch ({r['torch_ms']:.3f} ms)")
    if "sdpa_ms" in r:
        parts.append(f"SDPA {r['sdpa_ms']:.3f} ms (x{r['vs_sdpa']:.2f})")
    if r.get("splits", 1) != 1:
        parts.append(f"splits={r['splits']}")
    if "prefill_s" in r:
        parts.append(f"prefill+1st {r['prefill_s']:.2f} s")
    if "rel_err" in r:
        parts.append(f"err {r['rel_err']}")
    if "agree" in r:
        parts.append(f"same token {r['agree']}")
    if "vs_one_launch" in r:
        parts.append(f"x{r['vs_one_launch']:.2f} vs one launch ({r['one_launch_ms']:.3f} ms)")
    if "vs_eager" in r:
        parts.append(f"x{r['vs_eager']:.2f} vs eager launches")
    if "note" in r:
        parts.append(r["note"])
    if "error" in r:
        parts.append(f"ERROR {r['error']}")
    return ", ".join(parts)


def _tests_summary(log: Path | None, rc: int | None) -> str:
    if log is None or not log.exists():
        return "not run"
    text = log.read_text(errors="replace")
    found = re.findall(r"^=*\s*(\d+ (?:passed|failed|error|errors|skipped)\b.* in [0-9.]+s.*?)\s*=*$", text,
                       flags=re.MULTILINE)
    summary = found[-1] if found else "no pytest summary (timed out or crashed?)"
    return f"{summary} (rc {rc})" if rc is not None else summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="*", type=Path)
    ap.add_argument("--tests-log", type=Path, default=None)
    ap.add_argument("--tests-rc", type=int, default=None)
    args = ap.parse_args()

    rows: list[dict[str, Any]] = []
    for path in args.results:
        if path.exists():
            rows += json.loads(path.read_text()).get("rows", [])
        else:
            rows.append({"section": "error", "name": path.name, "ms": float("nan"), "error": "no results file"})
    table = [("section", "case", "ms", "metric", "details", "target")]
    table.append(("tests", "kernel tests on the device", "", "", _tests_summary(args.tests_log, args.tests_rc), ""))
    for r in rows:
        if r["section"] == "sweep":
            continue  # printed above the table, as JSON lines
        target = ""
        if r.get("target"):
            target = f"{r['target']}: {'PASS' if r.get('ok') else 'MISS'}"
        ms = r.get("ms")
        table.append((r["section"], r["name"], "" if ms is None or ms != ms else f"{ms:.3f}", _metric(r),
                      _detail(r), target))
    best_sweep: dict[str, tuple[float, str]] = {}
    for r in rows:
        if r["section"] == "sweep" and r.get("ms") == r.get("ms") and "error" not in r:
            case = " ".join(r["name"].split(" ")[:4])
            if case not in best_sweep or r["ms"] < best_sweep[case][0]:
                best_sweep[case] = (r["ms"], r["name"])
    for case, (ms, name) in best_sweep.items():
        table.append(("sweep", f"best for {case}", f"{ms:.3f}", "", name[len(case):].strip(), ""))

    decisions = _decisions(rows, best_sweep)
    widths = [max(len(str(row[i])) for row in table) for i in range(len(table[0]))]
    line = "+".join("-" * (w + 2) for w in widths)
    print("\n" + "=" * len(line))
    print("streamer GPU check")
    print("=" * len(line))
    for i, row in enumerate(table):
        print(" | ".join(str(c).ljust(w) for c, w in zip(row, widths)))
        if i == 0:
            print(line)
    if decisions:
        print("\nwhat the rows say (defaults to revisit; each a suggestion, from this run alone):")
        for d in decisions:
            print(f"- {d}")


def _decisions(rows: list[dict[str, Any]], best_sweep: dict[str, tuple[float, str]]) -> list[str]:
    """The default-changing conclusions the next session would otherwise work out by hand: a sweep shape >= 5%
    faster than the default launch at a target case, the Triton sampler's standing against torch's, the mixed-step
    split against one launch."""
    by_name = {r["name"]: r for r in rows if r["section"] != "sweep" and r.get("ms") == r.get("ms")}
    out = []
    for case, (ms, name) in best_sweep.items():
        main = by_name.get(case)
        if main is not None and ms < 0.95 * main["ms"]:
            out.append(f"{case}: the sweep's {name[len(case):].strip()} ran {main['ms'] / ms:.2f}x faster than the "
                       f"default launch ({ms:.3f} vs {main['ms']:.3f} ms): make it attention_config's default there")
    sampler = [r for name, r in by_name.items() if name.startswith("engine sampler: triton vs torch")]
    if sampler:
        wins = [r["name"].rsplit("[", 1)[-1].rstrip("]") for r in sampler if r.get("speedup", 0) > 1.0]
        verdict = ("faster than torch's at every batch timed: make it the CUDA default (config.sampling_backend)"
                   if len(wins) == len(sampler) else f"faster only at {', '.join(wins) or 'no batch'}: keep it opt-in")
        ratios = ", ".join(f"x{r.get('speedup', 0):.2f}" for r in sampler)
        out.append(f"Triton sampler: {verdict} ({ratios})")
    for name, r in by_name.items():
        if "vs_one_launch" in r and r["vs_one_launch"] < 1.0:
            out.append(f"{name}: the decodes' own launch was slower than one launch (x{r['vs_one_launch']:.2f}): "
                       "raise the split's threshold in unified_attention")
    return out


if __name__ == "__main__":
    main()
