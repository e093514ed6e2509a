"""The installer's commands: ``python -m areno.platform check|env|warmup|record-setup|installed``."""

import argparse
import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

from areno.platform import record_setup, setup_path
from areno.platform.checks import run_check, run_env


def warmup(device: str = "cuda") -> dict[str, str]:
    """Run each public Triton kernel once on small tensors so that Triton compiles and caches it (in ~/.triton or
    $TRITON_CACHE_DIR); ``areno.kernels.warmup`` holds the recipes (imported here: it needs torch)."""
    from areno.kernels import warmup as kernels_warmup

    return kernels_warmup.warmup(device)


def run_warmup(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="python -m areno.platform warmup", description=warmup.__doc__).parse_args(argv)
    try:
        results = warmup()
    except RuntimeError as e:
        print(f"warmup: {e}")
        return 1
    for name, outcome in results.items():
        print(f"  {name}: {outcome}")
    return 1 if any(o.startswith("failed") for o in results.values()) else 0


def run_record_setup(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m areno.platform record-setup",
        description="Detect the attention setup and record it for `areno check` and the runtime.",
    )
    parser.add_argument("--kernels-built", action="store_true", help="the Triton kernels were compiled by warmup")
    parser.add_argument("--dry-run", action="store_true", help="print what would be recorded, write nothing")
    args = parser.parse_args(argv)
    record, changed = record_setup(kernels_built=args.kernels_built, dry_run=args.dry_run)
    what = f"{record['attn_backend']} ({record['reason']})"
    if not changed:
        print(f"attention setup: {what}: unchanged in {setup_path()}")
    elif args.dry_run:
        print(f"attention setup: {what}: would record it in {setup_path()}")
    else:
        print(f"attention setup: {what}: recorded in {setup_path()}")
    return 0


def unmet_requirements(repo: Path, extras: tuple[str, ...] = ("test",)) -> list[str]:
    """What keeps the installed areno from matching the checkout `repo`: areno imported from elsewhere, no `areno`
    console script, or requirements of setup.cfg (core plus `extras`) missing or at a version out of range."""
    import configparser

    from packaging.requirements import Requirement

    import areno

    problems = []
    here = Path(areno.__file__).resolve().parent.parent
    if here != repo.resolve():
        problems.append(f"areno is imported from {here}, not {repo}")
    if not (Path(sys.prefix) / "bin" / "areno").exists():
        problems.append(f"no `areno` console script in {Path(sys.prefix) / 'bin'}")
    cfg = configparser.ConfigParser()
    cfg.read(repo / "setup.cfg")
    lines = cfg.get("options", "install_requires", fallback="").splitlines()
    for extra in extras:
        lines += cfg.get("options.extras_require", extra, fallback="").splitlines()
    for line in lines:
        line = line.split("#")[0].strip()
        if not line:
            continue
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{req.name} is not installed")
            continue
        if not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req.name} {version} does not satisfy {req.specifier}")
    return problems


def run_installed(argv: list[str]) -> int:
    """Exit 0 when areno is installed from the given checkout with every requirement met (install.sh step 5)."""
    parser = argparse.ArgumentParser(prog="python -m areno.platform installed", description=run_installed.__doc__)
    parser.add_argument("repo", type=Path, help="the checkout areno should be installed from")
    parser.add_argument("--extras", default="test", help="comma-separated extras that must be met too")
    args = parser.parse_args(argv)
    problems = unmet_requirements(args.repo, tuple(e for e in args.extras.split(",") if e))
    for problem in problems:
        print(problem)
    return 1 if problems else 0


COMMANDS = {"check": run_check, "env": run_env, "warmup": run_warmup, "record-setup": run_record_setup,
            "installed": run_installed}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m areno.platform {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


