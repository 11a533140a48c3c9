"""python -m services.dashboards: not implemented yet (issue #10). It exits non-zero rather than pretend."""

import argparse
import sys


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.dashboards", description=__doc__)
    parser.parse_known_args(argv)
    sys.exit("services.dashboards is not implemented yet (issue #10)")


if __name__ == "__main__":
    main()
