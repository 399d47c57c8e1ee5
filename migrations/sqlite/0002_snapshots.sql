-- Snapshots: consistent cuts of a run's EMA, durable on disk.
-- A snapshot is `pending` until every rank's files are written, fsynced and
-- renamed; only then `complete`. `failed` keeps its reason.

CREATE TABLE snapshots (
    id                TEXT PRIMARY KEY NOT NULL,
    run               TEXT NOT NULL REFERENCES runs(name) ON DELETE CASCADE,
    step              INTEGER NOT NULL,
    kind              TEXT NOT NULL,          -- manual | periodic | state | posthoc
    label             TEXT,
    profiles          TEXT NOT NULL,          -- JSON list of profile names
    status            TEXT NOT NULL,          -- pending | complete | failed
    reason            TEXT,
    created_at_ms     INTEGER NOT NULL,
    completed_at_ms   INTEGER,
    deadline_ms       INTEGER,
    bytes             INTEGER NOT NULL DEFAULT 0,
    detail            TEXT NOT NULL DEFAULT '{}'   -- JSON (post-hoc sources, ...)
) STRICT;

CREATE INDEX snapshots_by_run ON snapshots(run, step);

-- One row per file of a complete snapshot: per rank, one file per profile
-- (and `__mirror__` when the run keeps a mirror). `state` holds the rank's
-- step bookkeeping and layout (JSON) needed to restore it.
CREATE TABLE snapshot_files (
    snapshot          TEXT NOT NULL REFERENCES snapshots(id) ON DELETE CASCADE,
    rank              INTEGER NOT NULL,
    part              TEXT NOT NULL,          -- profile name or __mirror__
    path              TEXT NOT NULL,          -- relative to the data dir
    sha256            TEXT NOT NULL,
    bytes             INTEGER NOT NULL,
    step              INTEGER NOT NULL,       -- the rank's step in this file
    state             TEXT NOT NULL,          -- JSON
    PRIMARY KEY (snapshot, rank, part)
) STRICT;
