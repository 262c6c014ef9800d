-- The claim's plan must not depend on how many pending rows the planner guesses a workspace has.
--
-- A claim runs as a prepared statement, and after five runs PostgreSQL keeps a generic plan, one
-- made without knowing the workspace: it guesses a workspace's pending rows as the table's rows
-- over its distinct workspaces. With many small workspaces that guess is one or two rows, and then
-- reading all of the workspace's rows (a bitmap scan of any index that leads with workspace_id,
-- or of pending_jobs_workspace_oldest_idx) and sorting them costs the planner no more than walking
-- pending_jobs_workspace_priority_created_idx in order and stopping at the first claimable row;
-- the two estimates differed by a few percent and an ANALYZE could flip them. The sort plan reads
-- the whole workspace at every claim: a workspace with 3,000 pending read 1,300 to 1,450 rows per
-- job, and one with 100,000 would read them all (docs/benchmarks.md, "The SQL lifecycle's slow
-- runs"). So the planner is told a workspace holds 1% of the pending rows (ANALYZE keeps this in
-- place of its own count of workspaces; a hot workspace in the most-common list still caps it):
-- the walk that stops early then costs a small fraction of the sort at any size. The claim's label
-- test is estimated alike (store/ordering.py, "Plans").
ALTER TABLE pending_jobs ALTER COLUMN workspace_id SET (n_distinct = -0.01);
ANALYZE pending_jobs;
