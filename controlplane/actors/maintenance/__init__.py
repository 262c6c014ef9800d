"""Maintenance, in the shape of River's: one replica leads, and the leader runs the jobs.

`leadership.Leadership` tries for the leader lock (store/locks.py) every interval; when it wins,
it starts every job in a task group of its own, and when it loses the lock (its connection ended,
a probe failed or hung) it stops them all and goes back to trying. Each job owns one module and
reaches the database through a small store protocol, so its logic is tested on a mock clock with
a fake store (tests/actors/test_maintenance_*.py):

* `reaper`: expires stale leases and gives back the units of runners that ended with them;
* `sessions`: deletes old runner sessions no lease refers to;
* `retention`: deletes events and tombstones past their retention;
* `provisioning`: expired reservations, stale runner instances, spent runner credentials and
  ephemeral tokens, and the runner-phase gauges.

Every maintenance statement is safe when every replica runs it at once (the reaper try-locks each
execution, the collectors skip locked rows), so leadership only avoids waste: a brief double
leadership, while a lost connection is noticed, does no harm.
"""
