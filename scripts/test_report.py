"""`make test-report`: each tier's time and the slowest tests, from .kvtier/test-durations.json
(written by every pytest run of the suite: tests/tiers.py).

Prints, per tier in order (fast, engines, live): when its last run finished, that run's wall
time, the sum of its tests' setup + call + teardown, the count of tests by outcome; then the
20 slowest tests of all tiers with their tier and phases. Exit status 1 when the file is
missing or unreadable, with one line saying so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

TIERS = ("fast", "engines", "live")
DEFAULT = Path(__file__).resolve().parent.parent / ".kvtier" / "test-durations.json"


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:04.1f} s"


def report(data: dict[str, Any], slowest: int) -> str:
    tiers: dict[str, Any] = data["tiers"]
    order = [t for t in TIERS if t in tiers] + sorted(set(tiers) - set(TIERS))
    lines = [f"{'tier':<8} {'finished (UTC)':<21} {'run wall':>15} {'tests sum':>15}  "
             "tests"]
    rows: list[tuple[float, str, str, dict[str, float]]] = []
    for tier in order:
        t = tiers[tier]
        outcomes: dict[str, int] = {}
        for nodeid, entry in t["tests"].items():
            outcomes[entry["outcome"]] = outcomes.get(entry["outcome"], 0) + 1
            total = entry["setup"] + entry["call"] + entry["teardown"]
            rows.append((total, tier, nodeid, entry))
        shared = "" if t["tiers_in_run"] == [tier] else f" (one run: {'+'.join(t['tiers_in_run'])})"
        counts = ", ".join(f"{n} {what}" for what, n in sorted(outcomes.items()))
        lines.append(f"{tier:<8} {t['finished_at']:<21} {minutes(t['run_wall_s']):>15} "
                     f"{minutes(t['sum_s']):>15}  {counts}{shared}"
                     + ("" if t["exitstatus"] == 0 else f"  [exit status {t['exitstatus']}]"))
    rows.sort(key=lambda r: r[0], reverse=True)
    lines += ["", f"the {min(slowest, len(rows))} slowest tests (setup + call + teardown):"]
    for total, tier, nodeid, entry in rows[:slowest]:
        lines.append(f"{total:8.1f} s  {tier:<7}  {nodeid}  (setup {entry['setup']:.1f}, "
                     f"call {entry['call']:.1f}, teardown {entry['teardown']:.1f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=Path, default=DEFAULT)
    parser.add_argument("--slowest", type=int, default=20)
    args = parser.parse_args(argv)
    try:
        data = json.loads(args.file.read_text())
        print(report(data, args.slowest))
    except FileNotFoundError:
        print(f"test-report: {args.file} does not exist: run a tier first (make test)",
              file=sys.stderr)
        return 1
    except (ValueError, KeyError, TypeError) as exc:
        print(f"test-report: {args.file} is not a durations file of this suite ({exc!r})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
