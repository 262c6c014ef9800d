-- Fair share without ranking the whole workspace (issue 14, item 5): a claim in a `fair`
-- workspace finds the projects with pending rows by a skip scan of this index (one probe per
-- project), walks each project's first claimable rows on it in plain order, and counts the
-- project's leases on running_jobs_workspace_project_idx (sql/0012): its cost grows with the
-- projects, not with the pending rows (store/ordering.py).
CREATE INDEX pending_jobs_workspace_project_priority_idx
    ON pending_jobs (workspace_id, project_id, priority DESC, created_at, id);
