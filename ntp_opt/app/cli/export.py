"""The ``ntp-opt export`` sub-command: :func:`add_parser` and :func:`run`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ntp_opt.app.cli.common import error_line
from ntp_opt.model.echo import echo
from ntp_opt.model.files import (
    load_instance,
    load_plan,
)


def run(args: argparse.Namespace) -> int:
    from ntp_opt.app.export import equal_batch, export_megatron, power_only
    from ntp_opt.planners.megatron import MegatronError
    from ntp_opt.rules.validate import PlanError

    k8s = None
    if args.to == "k8s":
        from ntp_opt.app.export import K8sOptions

        try:
            k8s = K8sOptions.from_cli(
                args.image, args.name, args.namespace, args.command, args.master_port
            )
        except ValueError as err:
            print(error_line(str(err)), file=sys.stderr)
            return 2
    instance = load_instance(args.instance)
    plan = load_plan(args.plan)
    hosts = [h for h in (args.placeholder_hosts or "").split(",") if h]
    try:
        if args.equal_batch:
            before = plan.metrics.get("relative_goodput")
            plan = equal_batch(instance, plan)
            print(
                f"equal local batch {plan.replicas[0].local_batch if plan.replicas else 0}: "
                f"relative goodput {before} -> {plan.metrics.get('relative_goodput')}"
            )
        if args.to == "power-limits":
            written = power_only(instance, plan, args.output, inputs=[args.plan, args.instance])
            print(f"wrote {echo(', '.join(written))} in {echo(args.output)}")
            return 0
        if k8s is not None:
            from ntp_opt.app.export import export_k8s

            ex = export_k8s(
                instance,
                plan,
                args.output,
                k8s,
                reorder=args.reorder,
                placeholder_hosts=hosts,
                placeholder_gpus=args.placeholder_gpus,
                inputs=[args.plan, args.instance],
            )
        else:
            ex = export_megatron(
                instance,
                plan,
                args.output,
                reorder=args.reorder,
                placeholder_hosts=hosts,
                placeholder_gpus=args.placeholder_gpus,
                inputs=[args.plan, args.instance],
            )
    except (PlanError, MegatronError) as err:
        violations = err.violations
        v = violations[0]
        more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
        print(error_line(f"{args.plan}: {v.rule}: {v.message}") + more, file=sys.stderr)
        return 2
    out = echo(args.output)
    print(f"wrote {len(ex.files)} files in {out} (see {out}/LAUNCH.md)")
    if k8s is not None:
        from ntp_opt.app.export import K8S_NAME, k8s_notes

        print(f"kubectl apply -f {out}/{K8S_NAME}")
        for line in k8s_notes(instance, ex, k8s):
            print(f"note: {echo(line, None)}")
    elif ex.torchrun_note:
        print(f"note: {echo(ex.torchrun_note, None)}")
    return 0


def add_parser(sub: Any) -> None:
    """The ``ntp-opt export`` subcommand."""
    x = sub.add_parser("export", help="write a plan's launch configuration for a runtime")
    x.add_argument("plan", help="plan file")
    x.add_argument(
        "--to",
        choices=["megatron-ntp", "k8s", "power-limits"],
        required=True,
        help="megatron-ntp: Megatron-LM NTP config, launchers and power limits "
        "(docs/export.md); k8s: the same plus Kubernetes objects (k8s.json: one "
        "pinned Job per host); power-limits: only the nvidia-smi scripts",
    )
    x.add_argument("--instance", required=True, help="the plan's instance file")
    x.add_argument(
        "-o",
        "--output",
        required=True,
        help="output directory, written all at once; a previous export there is replaced, "
        "your own files in it are kept (docs/export.md, Writing the directory)",
    )
    x.add_argument("--reorder", action="store_true", help="move reduced replicas first")
    x.add_argument(
        "--uniform-batch",
        action="store_true",
        help="accepted for compatibility: one local batch is now always required",
    )
    x.add_argument(
        "--equal-batch",
        action="store_true",
        help="give every replica the same local batch first (the smallest; fixed: B / replicas)",
    )
    x.add_argument(
        "--placeholder-hosts",
        metavar="H1,H2,...",
        help="hosts outside the cluster for the inactive (placeholder) ranks, used only when "
        "the cluster has too few free healthy GPUs or when they keep torchrun possible",
    )
    x.add_argument(
        "--placeholder-gpus",
        type=int,
        metavar="N",
        help="GPUs per placeholder host, 1..1024 (default: the most GPUs of one cluster host)",
    )
    k = x.add_argument_group("--to k8s (docs/export.md, Kubernetes)")
    k.add_argument("--image", help="container image with PyTorch, Megatron-LM and the script")
    k.add_argument("--name", default="ntp", help="object name prefix (DNS-1123 label; ntp)")
    k.add_argument("--namespace", help="namespace written into every object")
    k.add_argument(
        "--command",
        metavar="'CMD ARGS'",
        help="training command, split like a shell would (default 'python "
        "pretrain_gpt_ntp.py'); the flags of megatron-args.txt are appended",
    )
    k.add_argument(
        "--master-port", type=int, default=29500, help="rendezvous port (MASTER_PORT; 29500)"
    )
    x.set_defaults(func=run)
