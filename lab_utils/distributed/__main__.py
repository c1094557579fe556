"""``python -m lab_utils.distributed``: run a strategy locally, or be one rank under torchrun.

    python -m lab_utils.distributed run --strategy fsdp --world-size 2 --steps 3
    python -m lab_utils.distributed run --param strategy=fsdp+cp_ring --param world_size=4
    torchrun --nproc-per-node 2 -m lab_utils.distributed worker --spec spec.json --out out/

``run`` validates the parameters (a bad one is refused before any process starts),
launches the ranks on this machine and prints the losses, per-rank communication and
overlap; ``worker`` is one rank (see :mod:`lab_utils.distributed.worker`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

import yaml

from lab_utils.core.config import ConfigError
from lab_utils.distributed.launch import DistRunError, launch
from lab_utils.distributed.spec import DistConfig
from lab_utils.distributed.worker import main as worker_main


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m lab_utils.distributed")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="launch a run on this machine")
    r.add_argument("--strategy", default=None)
    r.add_argument("--world-size", type=int, default=None)
    r.add_argument("--steps", type=int, default=None)
    r.add_argument("--param", action="append", default=[], help="key=value (YAML value), any DistConfig field")
    r.add_argument("--out", default=None, help="folder for the ranks' results and traces")
    w = sub.add_parser("worker", help="one rank (torchrun sets RANK/WORLD_SIZE/MASTER_*)")
    w.add_argument("--spec", required=True)
    w.add_argument("--out", required=True)
    return ap.parse_args(argv)


def _params(args: argparse.Namespace) -> dict:
    params: dict = {}
    for kv in args.param:
        k, eq, v = kv.partition("=")
        if not eq or not k:
            raise ConfigError("--param", kv, "key=value with a DistConfig field as key")
        try:
            params[k] = yaml.safe_load(v)
        except yaml.YAMLError as e:
            raise ConfigError(k, v, f"a YAML value ({str(e).splitlines()[0]})") from None
    for k in ("strategy", "world_size", "steps"):
        if getattr(args, k) is not None:
            params[k] = getattr(args, k)
    return params


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.cmd == "worker":
        code = worker_main(Path(args.spec), Path(args.out))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # a failed rank must not wait on peers in interpreter teardown
    try:
        cfg = DistConfig.from_params(_params(args), strict=True)
    except ConfigError as e:  # a refused configuration is one line and exit code 2, as `perflab` does
        print(f"python -m lab_utils.distributed run: {e}", file=sys.stderr)
        return 2
    # without --out the ranks' results and traces (about 11 MB) go to a temporary folder, removed at
    # the end, also after a failure or Ctrl-C
    with contextlib.ExitStack() as stack:
        out = args.out or stack.enter_context(tempfile.TemporaryDirectory(prefix="perflab-dist-"))
        try:
            res = launch(cfg, out)
        except ConfigError as e:  # this machine cannot host the run (NCCL without GPUs, too few GPUs)
            print(f"python -m lab_utils.distributed run: {e}", file=sys.stderr)
            return 2
        except DistRunError as e:
            print(f"run failed ({e.kind}): {e}", file=sys.stderr)
            return 1
        print(json.dumps({"strategy": cfg.strategy, "world_size": cfg.world_size, "losses": res.losses}, indent=1))
        for rk in res.ranks:
            if "overlap" in rk:
                print(f"rank {rk['rank']}: " + json.dumps({k: round(v, 3) for k, v in rk["overlap"].items()}))
    print(
        f"results and traces: {res.out}" if args.out else "results and traces: not kept (pass --out DIR to keep them)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
