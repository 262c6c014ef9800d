-- The walk's list as an index range (issue 16): each `workspace_demand` row keeps a lower bound
-- of its workspace's oldest pending job, indexed, so an installation walk reads the summary in
-- the order of the bounds and probes pending_jobs only for the rows it needs (about the 1,000 it
-- lists) instead of once per row (10,000 probes, 20 ms, at 10,000 workspaces with demand).
-- store/demand_list.py reads and corrects it; docs/concurrency.md has its locks.
--
-- The invariant: `oldest` <= the created_at of every pending row of the workspace. Removing a
-- pending row (claim, cancel, expiry) can only raise the true oldest, so the lifecycle's hot path
-- still never touches this table; the bound just goes stale (low). Every insert into
-- pending_jobs lowers it when the new row is older (a put-back or a retry keeps the job's
-- created_at). The walk's prune raises a stale bound to the true oldest under the exclusive
-- key, so no insert that could be older is in flight then.
ALTER TABLE workspace_demand ADD COLUMN oldest timestamptz;

-- A row without a pending job keeps the time it was added: a walk that reads it prunes it.
UPDATE workspace_demand d
   SET oldest = coalesce(
       (SELECT min(p.created_at) FROM pending_jobs p WHERE p.workspace_id = d.workspace_id),
       d.since);

ALTER TABLE workspace_demand ALTER COLUMN oldest SET NOT NULL;

CREATE INDEX workspace_demand_oldest_idx ON workspace_demand (oldest, workspace_id);

-- The same trigger as sql/0022, which now also keeps the bound. The keys are taken shared by
-- the first statement (as before; held to commit); the second lowers the bounds an older new
-- row breaks, row-locking those summary rows in workspace order (FOR UPDATE under ORDER BY), so
-- two inserts that lower several rows cannot lock them in opposite orders. An UPDATE whose
-- condition fails on the row it sees takes no lock: an enqueue of a newer job (the usual case)
-- locks no summary row, so enqueues of one workspace still never queue on it. A fresh statement
-- (plpgsql, read committed) sees a row another insert added and committed meanwhile, so a row
-- this statement's INSERT found there already is lowered too.
CREATE OR REPLACE FUNCTION cp_workspace_demand_added() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO workspace_demand (workspace_id, oldest)
    SELECT w.workspace_id, w.oldest
      FROM (SELECT workspace_id, min(created_at) AS oldest FROM added
             GROUP BY workspace_id ORDER BY workspace_id) AS w,
           LATERAL pg_advisory_xact_lock_shared(
               ('x' || left(md5('cp_workspace_demand:' || w.workspace_id::text), 16))
                   ::bit(64)::bigint) AS held
    ON CONFLICT (workspace_id) DO NOTHING;
    UPDATE workspace_demand d SET oldest = o.oldest
      FROM (SELECT s.workspace_id, a.oldest
              FROM workspace_demand s
              JOIN (SELECT workspace_id, min(created_at) AS oldest FROM added
                     GROUP BY workspace_id) AS a ON a.workspace_id = s.workspace_id
             WHERE s.oldest > a.oldest
             ORDER BY s.workspace_id
               FOR UPDATE OF s) AS o
     WHERE d.workspace_id = o.workspace_id;
    RETURN NULL;
END
$$;
