"""How fast this machine's cores are right now, on one thread: a reading to set beside a measured run.

    python .ci/speed_probe.py [--repeats N]

Prints one line: the seconds 400 products of 512x512 float64 matrices took (NumPy, its BLAS on one thread) and the
seconds a 3-million-step Python loop took, each the fastest of N tries (default 2). The same kind of machine has read
0.95 s and 1.9 s for the products on two days (docs/experiments.md), while the loop stayed at 0.2 s: runs of
`make test` compare only where their readings agree. .ci/measure records one before and one after each run.
Needs NumPy (the project's venv has it); about 2 to 5 s.
"""

from __future__ import annotations

import argparse
import os
import sys

# Before NumPy loads its BLAS: one thread, whatever the machine has.
for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"

import time  # noqa: E402


def products_s(size: int = 512, count: int = 400) -> float:
    import numpy

    a = numpy.random.default_rng(0).random((size, size))
    start = time.perf_counter()
    for _ in range(count):
        a @ a
    return time.perf_counter() - start


def loop_s(steps: int = 3_000_000) -> float:
    """The loop at a module's top level (its names global, as the readings in docs/experiments.md were taken)."""
    namespace = {"steps": steps}
    start = time.perf_counter()
    exec("total = 0\nfor i in range(steps):\n    total += i", namespace)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="tries of each part; the fastest is printed (default 2)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give 1 or more")
    try:
        products = min(products_s() for _ in range(args.repeats))
    except ImportError:
        print(f"error: the speed probe needs NumPy, which {sys.executable} lacks: run it with the project's venv "
              "(.venv/bin/python .ci/speed_probe.py)", file=sys.stderr)
        return 2
    loop = min(loop_s() for _ in range(args.repeats))
    print(f"matrix products {products:.2f} s, Python loop {loop:.2f} s (one thread, fastest of {args.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
