"""Same-call A/B table of two `host` builds: the `host bench --json` files that
scripts/device-run.sh's `ab` step writes (ab-old-P[-bwd].json, ab-new-P[-bwd].json).

    python3 scripts/ab-table.py OUT_DIR

For each precision, direction and model: both builds' times, new/old, and new/old of
the ratio to cuBLAS measured in the same process (which cancels clock drift between
the two runs).
"""

import json
import pathlib
import sys


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    rows = []
    for old_path in sorted(out.glob("ab-old-*.json")):
        new_path = out / old_path.name.replace("ab-old-", "ab-new-")
        if not new_path.exists():
            continue
        old, new = json.loads(old_path.read_text()), json.loads(new_path.read_text())
        what = "fwd+bwd" if old["backward"] else "forward"
        for o, n in zip(old["results"], new["results"]):
            assert o["model"] == n["model"]
            rows.append((old["precision"], what, o["model"], o["ours_ms"], n["ours_ms"], o["ratio"], n["ratio"]))
    print(f"{'precision':<9} {'what':<8} {'model':<6} {'old ms':>8} {'new ms':>8} {'new/old':>8} {'vs cuBLAS new/old':>18}")
    worst = 0.0
    for p, what, m, o, n, ro, rn in rows:
        print(f"{p:<9} {what:<8} {m:<6} {o:>8.3f} {n:>8.3f} {n / o:>8.3f} {rn / ro:>18.3f}")
        worst = max(worst, abs(n / o - 1), abs(rn / ro - 1))
    print(f"{len(rows)} pairs; largest change {100 * worst:.1f}%")


if __name__ == "__main__":
    main()
