"""Kopf handlers of MoEDeployment: thin wrappers around `Reconciler` (see reconcile.py).

    kubemoe operator --all-namespaces     # peering set up as the chart does (operator/cli.py)

Create, update and resume reconcile the spec; the timer pulls the frontends' /loads and re-plans;
delete only reports (owner references let the garbage collector remove the children, so no
finalizer is needed). Settings come from the environment once (`OperatorConfig.from_env`).
"""

from __future__ import annotations

import logging

import kopf

from kubemoe.operator.config import OperatorConfig
from kubemoe.operator.events import events
from kubemoe.operator.kube import Kube
from kubemoe.operator.loads import FrontendLoads
from kubemoe.operator.reconcile import Outcome, Reconciler
from kubemoe.operator.spec import GROUP, PLURAL, VERSION

CONFIG = OperatorConfig.from_env()
RESOURCE = (GROUP, VERSION, PLURAL)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger, **_) -> None:
    from kubernetes import config as kube_config
    from kubernetes.client import ApiClient

    # Progress and the last handled spec live in annotations: the status schema is structural and
    # would prune Kopf's status fields.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    # Log lines become Events only from WARNING up (not "Timer succeeded" every tick); report() posts
    # its Events with kopf.event, which this level does not filter.
    settings.posting.level = logging.WARNING
    try:
        kube_config.load_incluster_config()
    except kube_config.ConfigException:
        kube_config.load_kube_config()
    kube = Kube(ApiClient(), CONFIG.field_manager)
    memo.reconciler = Reconciler(kube, CONFIG)
    memo.load_source = FrontendLoads(kube, CONFIG.loads_port, CONFIG.loads_timeout_s)
    logger.info("kubemoe operator: peering %r (priority %d), loads every %.0fs", settings.peering.name,
                settings.peering.priority, CONFIG.loads_interval_s)


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
def reconcile(body, memo: kopf.Memo, **_) -> None:
    # A spec change re-plans with the loads last seen (kept per object in memo by the timer).
    report(body, memo.reconciler.reconcile(body, memo.get("loads")))


@kopf.timer(*RESOURCE, interval=CONFIG.loads_interval_s, initial_delay=CONFIG.loads_interval_s, idle=None)
def replan(body, memo: kopf.Memo, **_) -> None:
    # Asks the frontends for fresh loads (or keeps the last ones when none answers) and re-plans with them.
    outcome = memo.reconciler.reconcile(body, memo.get("loads"), source=memo.load_source)
    memo.loads = outcome.loads
    if outcome.loads_error:
        kopf.event(body, type="Warning", reason="LoadsUnavailable", message=outcome.loads_error)
    report(body, outcome, retry_later=False)


@kopf.on.delete(*RESOURCE, optional=True)
def deleted(name, **_) -> None:
    # Nothing to clean up by hand: every child has an owner reference to this object.
    logging.getLogger(__name__).info("MoEDeployment %s deleted; the garbage collector removes its children", name)


def report(body, outcome: Outcome, retry_later: bool = True) -> None:
    """Events for what changed and was decided; Kopf errors for what did not work (status says why)."""
    for event in events(outcome, body.get("status")):
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    if outcome.error is None or not retry_later:  # the timer tries again on its own
        return
    if outcome.retry:
        raise kopf.TemporaryError(outcome.error.message, delay=max(10.0, CONFIG.loads_interval_s))
    raise kopf.PermanentError(outcome.error.message)

