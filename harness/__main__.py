"""``python -m harness``: hands over to the one argparse tree in ``harness.cli.main``."""
from harness.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
