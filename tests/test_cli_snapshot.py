"""`areno train --help`, `areno serve --help` and `areno eval --help` list the same options, metavars and defaults as
the committed snapshot (tests/data/cli_snapshot.json, taken before the package was restructured). A deliberate change
of the CLI surface regenerates it: `python tests/test_cli_snapshot.py` and review the diff."""

import contextlib
import io
import json
import os
import re
import sys
from pathlib import Path

import pytest

SNAPSHOT = Path(__file__).parent / "data" / "cli_snapshot.json"
OPTION = re.compile(r"^  (-[^ ].*?)(?:  +(.*))?$")
DEFAULT = re.compile(r"\(default: (.*)\)$")


def options(command: str) -> dict[str, dict]:
    """{option: {"usage": its flags and metavar, "default": the default its help names, or None}}."""
    from areno.cli import main

    out = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "10000"  # one line per option
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            main([command, "--help"])
    finally:
        if old is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = old
    found = {}
    for line in out.getvalue().splitlines():
        m = OPTION.match(line)
        if not m:
            continue
        usage, help_text = m.group(1).strip(), (m.group(2) or "").strip()
        d = DEFAULT.search(help_text)
        found[usage.split()[0].rstrip(",")] = {"usage": usage, "default": d.group(1) if d else None}
    return found


def current() -> dict:
    return {command: options(command) for command in ("train", "serve", "eval")}


@pytest.mark.parametrize("command", ["train", "serve", "eval"])
def test_help_lists_the_snapshot_options_and_defaults(command):
    want = json.loads(SNAPSHOT.read_text())[command]
    got = options(command)
    added, removed = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    assert not added and not removed, f"options added {added}, removed {removed}"
    changed = {k: (want[k], got[k]) for k in want if want[k] != got[k]}
    assert not changed, f"usage or default changed: {changed}"


if __name__ == "__main__":
    SNAPSHOT.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")
    sys.exit(0)
