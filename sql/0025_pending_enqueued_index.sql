-- Operator pages (issue 15): the jobs list (store/job_views.py `list_jobs`, the admin API's
-- /v1/admin/jobs and the /ui/jobs page) shows the newest pending executions first. Without an
-- index in that order it sorted every pending row to show 100 of them (about 10 ms at 10,000
-- pending); with this one it reads the page backwards from the newest entry. The cost is one
-- more index entry written by every enqueue and put-back (the claim's delete only marks it dead):
-- docs/benchmarks.md ("Notes on the page render") has the throughput measured with and without.

CREATE INDEX pending_jobs_enqueued_idx ON pending_jobs (enqueued_at, job_execution_id);
