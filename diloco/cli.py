"""The `diloco` command: one entry point, one subcommand per component.

Each subcommand lives in the package that owns it and exposes ``main(argv) -> int``; this module only
dispatches, so importing it stays cheap and a component's heavy dependencies (PyTorch, kopf) load only
when that component runs.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": (
        "diloco.runner.cli",
        "run a local job: a synchronizer and N learners on this machine, with chaos",
    ),
    "simulate": ("diloco.simulate.cli", "simulate goodput of data-parallel vs decoupled training at scale"),
    "synchronizer": ("diloco_sync.cli", "start the synchronizer service"),
    "worker": ("diloco_worker.cli", "start a learner"),
    "operator": ("diloco_operator.cli", "start the Kubernetes operator"),
    "export": ("diloco.export", "write a job's global model from its storage as safetensors"),
    "bench": ("diloco_bench.cli", "run a benchmark and print its figures"),
}


def usage() -> str:
    lines = ["usage: diloco SUBCOMMAND [options]", "", "subcommands:"]
    lines += [f"  {name:<13} {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    lines += ["", "Run 'diloco SUBCOMMAND --help' for the options of one subcommand."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"diloco: unknown subcommand {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if name in ("worker", "synchronizer") and any(
        a in ("-f", "--file") or a.startswith("--file=") for a in rest
    ):
        from diloco_core.flags import SettingsError

        from diloco.job_file import component_argv

        try:
            rest = component_argv(name, rest)
        except SettingsError as exc:
            print(f"diloco {name}: {exc}", file=sys.stderr)
            return 2
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or "?"
        if missing == module_name or module_name.startswith(missing + "."):
            print(f"diloco: subcommand {name!r} is not available in this installation", file=sys.stderr)
        else:
            print(
                f"diloco: subcommand {name!r} needs the Python package {missing!r}; install the extra with "
                f"'pip install diloco-k8s[all]'",
                file=sys.stderr,
            )
        return 2
    result: int = module.main(rest)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
