"""Clients of the HTTP API: the reference runner (`controlplane runner`) and the operator
commands (`controlplane enqueue`, `controlplane status`). They talk to a daemon only over HTTP,
never to its database."""
