"""The messages of a provisioner control session after hello, between the wire and the actor.

Each request is decoded into domain values, asked of the session's `ProvisionerActor`
(actors/provisioning/), and its answer encoded: one small function per message type. The actor
runs every write in a transaction whose first lock is the session's fencing row, so a session
superseded or revoked meanwhile raises `errors.Fenced` and writes nothing (the session then
closes with its code). Every mapping of a domain value to a wire type lives here, once, including
the grants of `welcome` and the `demand` push.

A request refused for its content raises a ControlPlaneError; the session answers `error` with
its code and stays open. Nothing was written: the transaction rolled back.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from controlplane.actors.provisioning import DemandPush, ProvisionerActor
from controlplane.domain.demand import Template
from controlplane.domain.fields import by_name
from controlplane.domain.labels import canonicalise
from controlplane.domain.reports import ReconcileOutcome, RunnerEvent
from controlplane.domain.rounds import Grant
from controlplane.domain.runner_instances import RunnerState
from controlplane.errors import InvalidInput
from controlplane.wire import control as wire


async def handle(actor: ProvisionerActor, message: wire.ClientMessage) -> wire.ServerMessage:
    """Answer one request (anything but hello)."""
    answer = _ANSWERS.get(type(message))
    if answer is None:
        raise InvalidInput(f"unexpected message {type(message).__name__}")
    return await answer(actor, message)


async def _ping(actor: ProvisionerActor, message: wire.Ping) -> wire.Pong:
    """Answered at once: the session was marked seen, and the replica stamps and fences its
    pinged sessions in batches (actors/control.py, `LastSeen`)."""
    del actor
    return wire.Pong(request_id=message.request_id)


async def _advertise(actor: ProvisionerActor, message: wire.Advertise) -> wire.Advertised:
    ads = [
        by_name(Template, ad, key=ad.template_key, labels=tuple(ad.labels))
        for ad in message.templates
    ]
    kept = await actor.advertise(ads, message.max_reservations, message.reservation_ttl_seconds)
    return wire.Advertised(request_id=message.request_id, templates=kept)


async def _create(actor: ProvisionerActor, message: wire.CreateInstances) -> wire.InstancesCreated:
    entries = [(i.template_key, i.reservation_id) for i in message.instances]
    batch = await actor.create_instances(message.provider_kind, entries)
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


async def _attach(actor: ProvisionerActor, message: wire.AttachProvider) -> wire.Attached:
    attached = await actor.attach_provider(message.runner_instance_id, message.provider_runner_id)
    return wire.Attached(request_id=message.request_id, attached=attached)


async def _assign(actor: ProvisionerActor, message: wire.Assign) -> wire.Assigned:
    assigned = await actor.assign(message.reservation_id, message.runner_instance_ids)
    return wire.Assigned(request_id=message.request_id, runner_instance_ids=assigned)


async def _report(actor: ProvisionerActor, message: wire.Report) -> wire.Reported:
    outcome = await actor.report([_event(e) for e in message.events])
    return wire.Reported(
        request_id=message.request_id,
        accepted=outcome.accepted,
        reservations_released=outcome.reservations_released,
    )


async def _reconcile(actor: ProvisionerActor, message: wire.Reconcile) -> wire.Reconciled:
    result = await actor.reconcile(message.observed_provider_runner_ids)
    return _reconciled(message.request_id, result)


async def _mint(actor: ProvisionerActor, message: wire.MintEphemeral) -> wire.EphemeralMinted:
    minted = await actor.mint(message.provider_runner_ids, message.reservation_id)
    return wire.EphemeralMinted(
        request_id=message.request_id,
        tokens=[
            wire.MintedToken(
                provider_runner_id=t.provider_runner_id, token=t.token, expires_at=t.expires_at
            )
            for t in minted
        ],
    )


_ANSWERS: dict[type, Callable[[ProvisionerActor, Any], Awaitable[wire.ServerMessage]]] = {
    wire.Ping: _ping,
    wire.Advertise: _advertise,
    wire.CreateInstances: _create,
    wire.AttachProvider: _attach,
    wire.Assign: _assign,
    wire.Report: _report,
    wire.Reconcile: _reconcile,
    wire.MintEphemeral: _mint,
}


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


# --- pushed by the server -------------------------------------------------------------------------


def grant(found: Grant) -> wire.Grant:
    return by_name(wire.Grant, found)


def demand(push: DemandPush) -> wire.Demand:
    return wire.Demand(
        seq=push.seq,
        stats=[by_name(wire.DemandStat, s) for s in push.stats],
        grants=[grant(g) for g in push.grants],
        warm=[by_name(wire.WarmLaunch, w) for w in push.warm],
        newly_reserved=push.newly_reserved,
        terminate_provider_runner_ids=push.terminate,
    )
