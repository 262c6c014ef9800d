-- Ordering (issue 14, items 3-5): priority, concurrency keys and fair share.
--
-- Priority: higher first, then the FIFO key (created_at, id), per workspace. The claim's index
-- becomes (workspace_id, priority DESC, created_at, id); with every priority 0 (the default) it
-- is walked exactly as the old (workspace_id, created_at, id) one was, which it replaces.
ALTER TABLE pending_jobs
    ADD COLUMN priority integer NOT NULL DEFAULT 0,
    ADD COLUMN concurrency_key text,
    ADD COLUMN concurrency_limit integer,
    ADD CONSTRAINT pending_jobs_concurrency_ck CHECK (
        (concurrency_key IS NULL) = (concurrency_limit IS NULL)
        AND (concurrency_limit IS NULL OR concurrency_limit >= 1)
    );
CREATE INDEX pending_jobs_workspace_priority_created_idx
    ON pending_jobs (workspace_id, priority DESC, created_at, id);
DROP INDEX pending_jobs_workspace_created_idx;

-- A lease keeps its job's ordering fields, so a put-back restores them and the key's count can
-- be kept from the leases alone.
ALTER TABLE running_jobs
    ADD COLUMN priority integer NOT NULL DEFAULT 0,
    ADD COLUMN concurrency_key text,
    ADD COLUMN concurrency_limit integer;
CREATE INDEX running_jobs_workspace_project_idx ON running_jobs (workspace_id, project_id);

-- One row per (workspace, key) ever enqueued: `running` is the number of leases holding the key,
-- kept by the triggers below whatever ends a lease (complete, cancel, reaper, put-back, release).
-- A claim of a keyed job locks this row (FOR UPDATE) and admits the job only while `running` is
-- below the job's limit; two replicas admitting the last slot at once queue on the row, and the
-- second re-reads it and finds it full. Claims of unkeyed jobs never touch it.
CREATE TABLE concurrency_keys (
    workspace_id uuid NOT NULL,
    concurrency_key text NOT NULL,
    running integer NOT NULL DEFAULT 0 CHECK (running >= 0),
    PRIMARY KEY (workspace_id, concurrency_key)
);

CREATE FUNCTION cp_concurrency_key_leased() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE concurrency_keys SET running = running + 1
    WHERE workspace_id = NEW.workspace_id AND concurrency_key = NEW.concurrency_key;
    RETURN NULL;
END
$$;

-- A lease of a keyed job ended: one slot is free. Wake the parked runners that could take a job
-- waiting on the key, through the enqueue channel (`<workspace>|<labels>`, as store/queue.py
-- writes it), once per distinct label set of the key's waiting jobs (at most 16 of them).
CREATE FUNCTION cp_concurrency_key_released() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE concurrency_keys SET running = running - 1
    WHERE workspace_id = OLD.workspace_id AND concurrency_key = OLD.concurrency_key
      AND running > 0;
    PERFORM pg_notify('cp_enqueued', OLD.workspace_id::text || '|' || array_to_string(l.labels, ','))
    FROM (SELECT DISTINCT required_labels AS labels FROM pending_jobs
          WHERE workspace_id = OLD.workspace_id AND concurrency_key = OLD.concurrency_key
          LIMIT 16) AS l;
    RETURN NULL;
END
$$;

CREATE TRIGGER running_jobs_key_leased AFTER INSERT ON running_jobs
    FOR EACH ROW WHEN (NEW.concurrency_key IS NOT NULL)
    EXECUTE FUNCTION cp_concurrency_key_leased();
CREATE TRIGGER running_jobs_key_released AFTER DELETE ON running_jobs
    FOR EACH ROW WHEN (OLD.concurrency_key IS NOT NULL)
    EXECUTE FUNCTION cp_concurrency_key_released();

-- Jobs waiting on a key, for the release trigger's wake-up and the key's admission filter.
CREATE INDEX pending_jobs_concurrency_key_idx ON pending_jobs (workspace_id, concurrency_key)
    WHERE concurrency_key IS NOT NULL;

-- Per-workspace settings; a workspace without a row has the defaults (ordering 'fifo').
CREATE TABLE workspace_settings (
    workspace_id uuid PRIMARY KEY,
    ordering text NOT NULL DEFAULT 'fifo' CHECK (ordering IN ('fifo', 'fair')),
    updated_at timestamptz NOT NULL DEFAULT now()
);
