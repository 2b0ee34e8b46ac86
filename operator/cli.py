"""`kubemoe operator`: run the MoEDeployment operator (what the Helm chart's Deployment runs).

    kubemoe operator --all-namespaces
    kubemoe operator --namespace serving --loads-interval 10

Peering: every replica joins the peering object (created here if missing) with a random priority,
so with two replicas exactly one acts and the other takes over when it stops renewing.
"""

from __future__ import annotations

import logging
import os
import random

import click

from kubemoe import logs
from kubemoe.operator.config import PREFIX, OperatorConfig


@click.command("operator")
@click.option("--namespace", "namespaces", multiple=True, metavar="NS",
              help="Watch only these namespaces (repeatable). Default: all namespaces.")
@click.option("--all-namespaces", is_flag=True, help="Watch every namespace (the default when no --namespace).")
@click.option("--peering", default="kubemoe", show_default=True,
              help="Name of the (Cluster)KopfPeering object replicas coordinate through.")
@click.option("--standalone", is_flag=True, help="No peering: only for a single replica you run by hand.")
@click.option("--priority", type=int, default=None, help="Peering priority [default: random per process].")
@click.option("--liveness", default="http://0.0.0.0:8080/healthz", show_default=True,
              help="Liveness endpoint for the kubelet's probe; '' disables it.")
@click.option("--loads-interval", type=float, default=None,
              help=f"Seconds between pulls of /loads and re-plans [default: {OperatorConfig.loads_interval_s:.0f}].")
@click.option("--scale-out-check", type=float, default=None,
              help="Seconds between reads of /loads that re-plan at once when a hot expert is short of replicas; "
                   f"0: only every --loads-interval [default: {OperatorConfig.scale_out_check_s:g}].")
@click.option("--frontend-image", default=None, help=f"Default frontend image [{OperatorConfig.frontend_image}].")
@click.option("--expert-image", default=None, help=f"Default expert-function image [{OperatorConfig.expert_image}].")
@click.option("--verbose", is_flag=True, help="Debug logging.")
def command(namespaces, all_namespaces, peering, standalone, priority, liveness, loads_interval, scale_out_check,
            frontend_image, expert_image, verbose) -> None:
    """Run the kubemoe operator (Kopf) until interrupted."""
    if namespaces and all_namespaces:
        raise click.UsageError("give --namespace or --all-namespaces, not both")
    # Flags become the environment OperatorConfig.from_env reads when the handlers are imported: one config.
    for name, value in (("loads_interval_s", loads_interval), ("scale_out_check_s", scale_out_check),
                        ("frontend_image", frontend_image), ("expert_image", expert_image)):
        if value is not None:
            os.environ[PREFIX + name.upper()] = str(value)
    os.environ[PREFIX + "WATCH_NAMESPACES"] = ",".join(namespaces)
    OperatorConfig.from_env()  # fail here, with the variable's name, not inside Kopf
    logs.configure(logging.DEBUG if verbose else logging.INFO)
    import kopf

    import kubemoe.operator.handlers  # noqa: F401 - registers the handlers

    clusterwide = not namespaces
    if not standalone:
        ensure_peering(peering, None if clusterwide else namespaces)
    kopf.run(clusterwide=clusterwide, namespaces=list(namespaces), standalone=standalone,
             peering_name=None if standalone else peering,
             priority=priority if priority is not None else random.randint(1, 2**31 - 1),
             liveness_endpoint=liveness or None)


def ensure_peering(name: str, namespaces) -> None:
    """Create the peering object(s) Kopf needs (it does not create them itself); existing ones are fine."""
    from kubernetes import config
    from kubernetes.client import ApiClient

    from kubemoe.operator.kube import ApiError, Kube

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    kube = Kube(ApiClient(), OperatorConfig.field_manager)
    objects = ([{"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}}]
               if namespaces is None else
               [{"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": name, "namespace": ns}}
                for ns in namespaces])
    for obj in objects:
        try:
            kube.create(obj)
        except ApiError as e:
            if e.status == 409:
                continue
            if e.status == 404:
                raise click.ClickException(
                    "Kopf's peering CRDs are not installed: install the chart (crds.enabled=true) or "
                    "kubectl apply -f manifests/kopf-peering-crds.yaml, or run with --standalone") from None
            raise click.ClickException(f"cannot create {obj['kind']} {name}: {e.message}") from None


if __name__ == "__main__":
    command()
