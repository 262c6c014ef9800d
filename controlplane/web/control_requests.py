"""The requests of a provisioner control session, after hello: one function per message type.

Every request that writes runs in one transaction whose first lock is the session's fencing row
(`provisioner_sessions.hold_fence`, FOR SHARE): a session superseded or revoked meanwhile gets
`Fenced` (the session closes with its code) and writes nothing. The store functions called here
take their own locks after it, in the global order of store/reservations.py.

A request refused for its content raises a ControlPlaneError; the session answers `error` with
its code and stays open. Nothing was written: the transaction rolled back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

from controlplane import metrics
from controlplane.actors.control import LocalSession
from controlplane.actors.provisioning import Advertisement, Fenced, ProvisionerActor
from controlplane.domain.demand import Template, reservation_ttl
from controlplane.domain.labels import canonicalise, strip_reserved
from controlplane.domain.provisioners import Fence, Provisioner
from controlplane.domain.reports import ReconcileOutcome, RunnerEvent
from controlplane.domain.runner_instances import RunnerState
from controlplane.errors import InvalidInput, RunnerNotAssignable
from controlplane.store import (
    control_sessions,
    demand_inputs,
    reconcile,
    runner_instances,
    runner_reports,
)
from controlplane.store.pool import Conn
from controlplane.store.provisioner_sessions import hold_fence
from controlplane.web import ephemeral
from controlplane.web.services import Services
from controlplane.wire import control as wire


@asynccontextmanager
async def fenced(svc: Services, session: LocalSession) -> AsyncIterator[Conn]:
    async with svc.pool.acquire() as conn, conn.transaction():
        verdict = await hold_fence(conn, session.provisioner_id, session.generation)
        if verdict is not Fence.CURRENT:
            raise Fenced(verdict)
        yield conn


def templates_of(
    svc: Services, provisioner: Provisioner, ads: list[wire.TemplateAd]
) -> tuple[Template, ...]:
    """Canonical templates. A workspace provisioner's reserved labels are stripped (spec 3.1);
    a template left with no label is dropped. Template keys must be unique."""
    keys = [ad.template_key for ad in ads]
    if len(set(keys)) != len(keys):
        raise InvalidInput("template_key must be unique within an advertisement")
    templates = []
    for ad in ads:
        labels = canonicalise(ad.labels)
        if provisioner.scope == "workspace":
            labels = strip_reserved(labels, svc.reserved_labels)
        if not labels:
            continue
        templates.append(
            Template(
                key=ad.template_key,
                labels=labels,
                available_slots=ad.available_slots,
                starting=ad.starting,
                running=ad.running,
                idle_target=ad.idle_target,
            )
        )
    return tuple(templates)


async def handle(
    svc: Services,
    provisioner: Provisioner,
    session: LocalSession,
    actor: ProvisionerActor,
    message: wire.ClientMessage,
) -> wire.ServerMessage:
    knobs = svc.settings.provisioners
    match message:
        case wire.Advertise():
            templates = templates_of(svc, provisioner, message.templates)
            async with fenced(svc, session) as conn:
                await demand_inputs.replace_templates(
                    conn, provisioner.id, provisioner.workspace_id, templates
                )
            ttl = reservation_ttl(
                message.reservation_ttl_seconds,
                default_seconds=knobs.reservation_ttl_seconds,
                ceiling_seconds=knobs.reservation_ttl_max_seconds,
            )
            actor.advertise(Advertisement(templates, message.max_reservations, ttl))
            return wire.Advertised(request_id=message.request_id, templates=len(templates))
        case wire.CreateInstances():
            entries = [(i.template_key, i.reservation_id) for i in message.instances]
            async with fenced(svc, session) as conn:
                batch = await runner_instances.create_batch(
                    conn,
                    provisioner.id,
                    provider_kind=message.provider_kind,
                    entries=entries,
                    bootstrap_ttl=timedelta(seconds=knobs.bootstrap_token_ttl_seconds),
                )
            for reason, units in batch.capacity_failures.items():
                metrics.capacity_failures.labels(reason).inc(units)
            actor.warm_created(
                entries[c.request_index][0]
                for c in batch.instances
                if entries[c.request_index][1] is None
            )
            return wire.InstancesCreated(
                request_id=message.request_id,
                runner_instances=[
                    wire.CreatedInstance(
                        runner_instance_id=c.runner_instance_id,
                        bootstrap_token=c.bootstrap_token,
                        request_index=c.request_index,
                    )
                    for c in batch.instances
                ],
                reservation_unavailable=batch.reservation_unavailable,
            )
        case wire.AttachProvider():
            async with fenced(svc, session) as conn:
                attached = await runner_instances.attach_provider_runner(
                    conn, provisioner.id, message.runner_instance_id, message.provider_runner_id
                )
            return wire.Attached(request_id=message.request_id, attached=attached)
        case wire.Assign():
            if len(set(message.runner_instance_ids)) != len(message.runner_instance_ids):
                raise InvalidInput("runner_instance_ids must be unique")
            try:
                async with fenced(svc, session) as conn:
                    assigned = await runner_instances.assign(
                        conn, provisioner.id, message.reservation_id, message.runner_instance_ids
                    )
            except control_sessions.PROMOTION_FAILURES as error:
                reason = error.code
                if isinstance(error, RunnerNotAssignable):
                    reason = error.reason
                metrics.assignments_rejected.labels(reason, "provisioner").inc()
                raise
            return wire.Assigned(request_id=message.request_id, runner_instance_ids=assigned)
        case wire.Report():
            received_at = svc.clock()
            async with fenced(svc, session) as conn:
                outcome = await runner_reports.report(
                    conn,
                    provisioner,
                    [_event(e) for e in message.events],
                    received_at=received_at,
                    reserved_labels=svc.reserved_labels,
                    activation_timeout=timedelta(seconds=knobs.demand_activation_timeout_seconds),
                )
            for event in message.events:
                metrics.runner_reports.labels(event.state).inc()
            metrics.units_released.labels("report").inc(outcome.reservations_released)
            for honored in outcome.terminate_intents_honored:
                metrics.terminate_intents_honored.labels(honored.reason).inc()
            actor.wake()  # released units are demand again
            return wire.Reported(
                request_id=message.request_id,
                accepted=outcome.accepted,
                reservations_released=outcome.reservations_released,
            )
        case wire.Reconcile():
            observed = message.observed_provider_runner_ids
            if len(set(observed)) != len(observed):
                raise InvalidInput("observed_provider_runner_ids must be unique")
            async with fenced(svc, session) as conn:
                result = await reconcile.reconcile(
                    conn,
                    provisioner,
                    observed,
                    grace=timedelta(seconds=knobs.reconcile_terminate_grace_seconds),
                    include_intended=True,
                )
            metrics.reconciles.inc()
            metrics.absent_terminated.inc(len(result.terminated_absent_provider_runner_ids))
            metrics.units_released.labels("reconcile").inc(result.reservations_released)
            for runner in result.runners:
                if runner.desired_intent == "terminate":
                    reason = runner.intent_reason or "unknown"
                    metrics.terminate_intents_issued.labels("reconcile", reason).inc()
            actor.wake()
            return _reconciled(message.request_id, result)
        case wire.MintEphemeral():
            async with fenced(svc, session) as conn:
                return await ephemeral.mint_ephemeral(conn, svc, provisioner, message)
    raise InvalidInput(f"unexpected message {type(message).__name__}")


def _event(event: wire.ReportEvent) -> RunnerEvent:
    return RunnerEvent(
        provider_runner_id=event.provider_runner_id,
        state=RunnerState(event.state),
        reported_at=event.reported_at,
        reservation_id=event.reservation_id,
        template_key=event.template_key,
        labels=canonicalise(event.labels or ()),
        reason=event.reason,
        runner_session_id=event.runner_session_id,
        provider_kind=event.provider_kind,
    )


def _reconciled(request_id: str, result: ReconcileOutcome) -> wire.Reconciled:
    return wire.Reconciled(
        request_id=request_id,
        runners=[
            wire.ReconciledRunner(
                provider_runner_id=r.provider_runner_id,
                state=None if r.state is None else r.state.value,
                intended_reservation_id=r.intended_reservation_id,
                reservation_id=r.reservation_id,
                runner_session_id=r.runner_session_id,
                bound_job=None
                if r.bound_job is None
                else wire.BoundJob(
                    job_id=r.bound_job.job_id,
                    workflow_run_attempt_id=r.bound_job.workflow_run_attempt_id,
                    last_heartbeat_at=r.bound_job.last_heartbeat_at,
                    cancellation_requested_at=r.bound_job.cancellation_requested_at,
                ),
                desired_intent="terminate" if r.desired_intent == "terminate" else "keep",
            )
            for r in result.runners
        ],
        terminated_absent_provider_runner_ids=list(result.terminated_absent_provider_runner_ids),
    )
