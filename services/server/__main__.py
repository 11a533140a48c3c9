"""python -m services.server: not implemented yet (issue #9). It exits non-zero rather than pretend."""

import argparse
import sys


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.server", description=__doc__)
    parser.parse_known_args(argv)
    sys.exit("services.server is not implemented yet (issue #9)")


if __name__ == "__main__":
    main()
