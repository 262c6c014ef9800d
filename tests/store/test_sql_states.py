"""State lists in SQL come from the domain's enums, and the one SQL function that spells them
out (sql/0011) agrees with them."""

from __future__ import annotations

from controlplane.domain.runner_instances import ACTIVE_STATES, LaunchKind, RunnerState
from controlplane.store.pool import Conn
from controlplane.store.reservations import ACTIVE_SQL, TERMINAL_SQL, sql_states


def test_state_lists_are_rendered_in_rank_order_from_the_enum() -> None:
    assert ACTIVE_SQL == "('starting', 'running', 'stopping')"
    assert TERMINAL_SQL == "('stopped', 'failed', 'terminated')"
    assert sql_states(set(RunnerState)) == (
        "(" + ", ".join(f"'{s.value}'" for s in RunnerState) + ")"
    )


async def test_the_terminate_candidates_function_uses_the_domain_states(conn: Conn) -> None:
    body = await conn.fetchval(
        "SELECT prosrc FROM pg_proc WHERE proname = 'cp_terminate_candidates'"
    )
    assert f"ri.state IN {sql_states(ACTIVE_STATES)}" in body
    assert f"ri.launch_kind = '{LaunchKind.DEMAND.value}'" in body
