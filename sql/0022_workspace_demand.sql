-- Demand kept incrementally (issue 16): which workspaces have pending jobs, without a GROUP BY
-- over the whole of pending_jobs. store/demand.py (`demand_workspaces`, `prune_demand`) reads
-- and prunes it; docs/concurrency.md has its locks.
--
-- A row exists for every workspace that has a pending row, and possibly for a while for one
-- that no longer has any (a claim, cancel or expiry never touches this table, so the lifecycle's
-- hot path pays nothing for it on the way out). Every insert into pending_jobs (enqueue,
-- put-back, retry) adds the row if it is missing; an installation walk prunes the rows of
-- workspaces left without pending jobs. How old a workspace's demand is, and whether all of it
-- is past its queue deadline, is read per listed workspace from the index below, so the walk's
-- list costs per workspace with a row, not per pending job.
CREATE TABLE workspace_demand (
    workspace_id uuid PRIMARY KEY,
    since timestamptz NOT NULL DEFAULT now()
);

-- The oldest pending job of one workspace that is not past its queue deadline: the first entry
-- of this index that passes the deadline test (the claim's index leads with priority, so it
-- cannot answer "oldest").
CREATE INDEX pending_jobs_workspace_oldest_idx
    ON pending_jobs (workspace_id, created_at) INCLUDE (expires_at);

-- Rows arrive in the order of the workspaces' ids within a statement. The shared advisory lock
-- (namespace cp_workspace_demand, store/locks.py) is held to commit: the prune takes the same
-- key exclusively with a try-lock, so it never deletes the row of a workspace whose new pending
-- row is not committed yet, and never waits. ON CONFLICT DO NOTHING takes no row lock when the
-- row is there, so concurrent enqueues of one workspace do not queue on it.
CREATE FUNCTION cp_workspace_demand_added() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- One statement: each workspace's key is taken (lateral, row by row) before its row is
    -- inserted. Measured against the same enqueues without the trigger, a PERFORM of the keys
    -- and an INSERT as two statements cost about a fifth more per enqueue; this one did not
    -- measurably differ.
    INSERT INTO workspace_demand (workspace_id)
    SELECT w.workspace_id
      FROM (SELECT DISTINCT workspace_id FROM added ORDER BY 1) AS w,
           LATERAL pg_advisory_xact_lock_shared(
               ('x' || left(md5('cp_workspace_demand:' || w.workspace_id::text), 16))
                   ::bit(64)::bigint) AS held
    ON CONFLICT (workspace_id) DO NOTHING;
    RETURN NULL;
END
$$;

CREATE TRIGGER pending_jobs_demand_added AFTER INSERT ON pending_jobs
    REFERENCING NEW TABLE AS added
    FOR EACH STATEMENT EXECUTE FUNCTION cp_workspace_demand_added();

-- Jobs pending before this migration.
INSERT INTO workspace_demand (workspace_id)
SELECT DISTINCT workspace_id FROM pending_jobs ON CONFLICT DO NOTHING;
