-- A heartbeat rewrites its lease in place (a HOT update), instead of adding an entry to each of
-- running_jobs' indexes.
--
-- The heartbeat is the most frequent write of a running system: every runner, every
-- `runners.heartbeat_interval_seconds` (10 s), 2,000 a second at 20,000 runners. PostgreSQL can
-- keep the new row version on the old one's page and skip every index only when no indexed
-- column changes and the page has room. The heartbeat sets first_heartbeat_at and
-- last_heartbeat_at, which two indexes here existed only to serve: the reaper's search for stale
-- leases. So each heartbeat wrote a new entry into all ten of running_jobs' indexes, and each
-- lease's first heartbeat did so in the SQL lifecycle of bench/compare.py: the lifecycle's WAL
-- fell from about 4,040 to 3,460 bytes a job without them (bench/notes.md, 2026-12-03).
--
-- The reaper (store/leases.py `reap`, the leader, every `maintenance.reaper_interval_seconds`,
-- 5 s) now reads running_jobs whole: one row per running job, so at most one per runner. At
-- 20,000 running rows that read took 2.9 ms (EXPLAIN ANALYZE, best of 5) against 0.015 ms by
-- the two indexes: under a thousandth of a core at one read every 5 s, against the ten index
-- entries (and their WAL, and their vacuum) each heartbeat no longer writes.
--
-- New pages keep 30% free so that a lease's next version fits beside it; a page's dead versions
-- are pruned as it fills, so a heartbeat finds room on its page unless the page is full of live
-- rows (then that one update is not HOT, and the next may be again).
DROP INDEX running_jobs_no_first_heartbeat_started_idx;
DROP INDEX running_jobs_last_heartbeat_at_idx;
ALTER TABLE running_jobs SET (fillfactor = 70);
