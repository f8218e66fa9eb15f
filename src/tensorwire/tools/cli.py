"""The `tensorwire` command: `run` (launcher), `bench` (benchmark), `plan` (the cost model),
`topo` (the job's topology), `version`.

Subcommands are dispatched by hand rather than through argparse subparsers so that each one
owns its full argument syntax (the launcher passes everything after the script through
untouched) and its own `--help`; heavy modules are imported only when their command runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence

DESCRIPTION = """\
tensorwire: collective communication for distributed AI and HPC (shared memory and TCP,
torch.distributed-style and MPI-style APIs). Run `tensorwire COMMAND --help` for the
options of one command.
"""

COMMANDS: dict[str, tuple[str, str]] = {
    "run": (
        "start N ranks of a Python program per node, like torchrun",
        "Hosts the rendezvous store, sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT for every "
        "rank, relays their output, and on a failure reports which rank failed first and why. "
        "Example: tensorwire run -n 4 train.py --epochs 3",
    ),
    "bench": (
        "measure collective latency and bus bandwidth, nccl-tests style",
        "Sweeps message sizes for a collective (or all of them) with nccl-tests' flags and columns: "
        "time, algorithm bandwidth, bus bandwidth and #wrong per size, out-of-place and in-place. "
        "--np N starts N ranks through the launcher; --compare gloo,mpi runs the same sweep through Gloo "
        "and Open MPI, interleaved, and prints per-size time ratios (--plot, --markdown, --json). "
        "Example: tensorwire bench all_reduce -b 8 -e 64M -f 4 --np 2 --compare gloo,mpi "
        "(see tensorwire bench --help)",
    ),
    "plan": (
        "predict each algorithm's time for a collective with the cost model",
        "Prints the α-β-γ prediction of every algorithm and the sizes where the cheapest one changes, "
        "on this host's calibrated links (shm, tcp) or on hypothetical ones (nvlink, pcie, ib-ndr, "
        "eth25g). Example: tensorwire plan all_reduce 64MiB --np 16 --tier shm,ib-ndr "
        "(see tensorwire plan --help)",
    ),
    "topo": (
        "print the job's topology and the orders collectives run in",
        "Hosts and their ranks, each rank's cores, NUMA node, GPU and network interface, the tier of its "
        "pairs, and the ring, tree and hierarchy orders of the world group. Inside a job every rank joins "
        "and rank 0 prints; --np N starts N ranks on this host. Example: tensorwire topo --np 4 "
        "(see tensorwire topo --help)",
    ),
    "version": (
        "print the versions of tensorwire, Python and numpy (--all: what this installation can do)",
        "With --all also the compiled module, torch, CUDA and the device-flag path, ml_dtypes, mpi4py, "
        "/dev/shm, the open-files limit and the TENSORWIRE_* settings in force: the lines a bug report "
        "needs. Example: tensorwire version --all",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; used for `tensorwire --help` and for unknown commands."""
    parser = argparse.ArgumentParser(
        prog="tensorwire", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  tensorwire run -n 4 train.py --epochs 3\n"
               "  tensorwire bench all_reduce -b 8 -e 64M -f 4 --np 2\n"
               "  tensorwire topo --np 4\n"
               "  tensorwire version\n",
    )
    parser.add_argument("--version", action="store_true", help="same as `tensorwire version`")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (summary, detail) in COMMANDS.items():
        sub.add_parser(name, help=summary, description=f"{summary}. {detail}")
    return parser


def version_text() -> str:
    """Installed distribution version if known, else the package's own, plus the runtime."""
    from importlib import metadata

    try:
        ours = metadata.version("tensorwire")
    except metadata.PackageNotFoundError:
        import tensorwire

        ours = getattr(tensorwire, "__version__", "unknown")
    try:
        import numpy

        numpy_version = numpy.__version__
    except ImportError:
        numpy_version = "not installed"
    py = ".".join(str(v) for v in sys.version_info[:3])
    return f"tensorwire {ours} (python {py}, numpy {numpy_version})"


def _run(argv: list[str]) -> int:
    from . import launcher

    return launcher.main(argv, prog="tensorwire run")


def _bench(argv: list[str]) -> int:
    device, rest = _take_option(argv, "--device")
    if device == "cuda":
        from .benchmarks import cuda

        return cuda.main(rest)
    if device not in (None, "cpu"):
        print(f"tensorwire bench: --device {device}: expected cpu or cuda", file=sys.stderr)
        return 2
    argv = rest
    try:
        from . import bench
    except ImportError as exc:
        print(f"tensorwire bench: not available in this installation ({exc})", file=sys.stderr)
        return 1
    result = bench.main(argv)
    return int(result or 0)


def _take_option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """(value of `name` as `name V` or `name=V`, or None; argv without it)."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1:]
    return None, argv


def _plan(argv: list[str]) -> int:
    from . import plan

    return plan.main(argv)


def _topo(argv: list[str]) -> int:
    from . import topo

    return topo.main(argv)


def _version(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print("usage: tensorwire version [--all]\n\nPrint the versions of tensorwire, Python and numpy; "
              "with --all also what this installation can do\n(compiled module, torch, CUDA, device flags, "
              "ml_dtypes, mpi4py, /dev/shm, open files, TENSORWIRE_* settings).")
        return 0
    if argv and argv != ["--all"]:
        print(f"tensorwire version: unknown argument {argv[0]!r} (expected --all)", file=sys.stderr)
        return 2
    print(version_text())
    if argv:
        from . import about

        print(about.report())
    return 0


HANDLERS: dict[str, Callable[[list[str]], int]] = {"run": _run, "bench": _bench, "plan": _plan,
                                                   "topo": _topo, "version": _version}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tensorwire` script; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in HANDLERS:
        try:
            code = HANDLERS[args[0]](args[1:])
            sys.stdout.flush()  # here, not at exit: a reader gone is caught below
            return code
        except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as `ls | head` does
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
            return 128 + signal.SIGPIPE
    parser = build_parser()
    try:
        ns = parser.parse_args(args)
    except SystemExit as exc:  # --help, or an unknown command (argparse printed why)
        return exc.code if isinstance(exc.code, int) else 2
    if ns.version:
        return _version([])
    parser.print_help()
    return 2 if not args else 0


if __name__ == "__main__":
    raise SystemExit(main())
