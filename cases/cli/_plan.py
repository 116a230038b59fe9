"""``check``'s planning in this process: what ``python -m harness check`` decides before any rank starts."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness.cli import parser
from harness.cli.check_plan import Plan, validate


def parse(config: Path, *extra: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    parser.add_check_arguments(ap)
    return ap.parse_args(["--ds-config", str(config), "--no-report", *extra])


def plan(tmp_path: Path, cfg: dict, *extra: str) -> Plan:
    """The plan for ``cfg`` written to a file, with ``extra`` flags (``--shapes 16x8`` unless given)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    if "--shapes" not in extra and "--model" not in extra:
        extra = ("--shapes", "16x8", *extra)
    return validate(parse(path, *extra))
