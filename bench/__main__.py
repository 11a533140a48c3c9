"""python -m bench: run every bench/bench_*.py, print one table, write bench/results.md.

Each script defines `run() -> list[dict]` with rows {"benchmark", "metric", "value", "unit", "note"}.
Numbers are medians of repeated runs; comparisons are measured side by side in one process.
"""

from __future__ import annotations

import importlib
import platform
import sys
import time
from pathlib import Path

from shared.config import command_line

HERE = Path(__file__).resolve().parent


def main(argv=None) -> None:
    parser = command_line("python -m bench", __doc__, config=False)
    parser.add_argument("names", nargs="*", help="only these benchmarks (e.g. maze rollout)")
    args = parser.parse_args(argv)
    scripts = sorted(p.stem for p in HERE.glob("bench_*.py"))
    if args.names:
        scripts = [s for s in scripts if s.removeprefix("bench_") in args.names]
    rows = []
    for name in scripts:
        started = time.perf_counter()
        print(f"running {name} ...", flush=True)
        module = importlib.import_module(f"bench.{name}")
        rows.extend(module.run())
        print(f"  done in {time.perf_counter() - started:.0f}s", flush=True)
    header = "| benchmark | metric | value | unit | note |\n|---|---|---|---|---|\n"
    body = "".join(f"| {r['benchmark']} | {r['metric']} | {r['value']:.4g} | {r['unit']} | {r.get('note', '')} |\n" for r in rows)
    machine = f"{platform.machine()}, {__import__('os').cpu_count()} CPUs, Python {sys.version.split()[0]}"
    text = f"# Benchmark results\n\nMeasured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine}.\n\n{header}{body}"
    print("\n" + header + body)
    out = HERE / "results.md"
    if args.names and out.exists():
        print("(partial run: bench/results.md left as it was)")
    else:
        out.write_text(text)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
