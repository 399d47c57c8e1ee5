-- Snapshots: consistent cuts of a run's EMA, durable in the object store.
-- A snapshot is `pending` until every rank's parts are written; only then
-- `complete`. `failed` keeps its reason.

CREATE TABLE snapshots (
    id                TEXT PRIMARY KEY NOT NULL,
    run               TEXT NOT NULL REFERENCES runs(name) ON DELETE CASCADE,
    step              BIGINT NOT NULL,
    kind              TEXT NOT NULL,          -- manual | periodic | state | posthoc
    label             TEXT,
    profiles          TEXT NOT NULL,          -- JSON list of profile names
    status            TEXT NOT NULL,          -- pending | complete | failed
    reason            TEXT,
    created_at_ms     BIGINT NOT NULL,
    completed_at_ms   BIGINT,
    deadline_ms       BIGINT,
    bytes             BIGINT NOT NULL DEFAULT 0,
    detail            TEXT NOT NULL DEFAULT '{}'   -- JSON (post-hoc sources, ...)
);

CREATE INDEX snapshots_by_run ON snapshots(run, step);

-- One row per part of a complete snapshot (see migrations/sqlite).
CREATE TABLE snapshot_files (
    snapshot          TEXT NOT NULL REFERENCES snapshots(id) ON DELETE CASCADE,
    rank              BIGINT NOT NULL,
    part              TEXT NOT NULL,          -- profile name or __mirror__
    path              TEXT NOT NULL,          -- the object's key under the store's root
    sha256            TEXT NOT NULL,
    bytes             BIGINT NOT NULL,
    step              BIGINT NOT NULL,        -- the rank's step in this part
    state             TEXT NOT NULL,          -- JSON
    PRIMARY KEY (snapshot, rank, part)
);
