-- The catalog: runs (their full configuration), ranks (layout, last step,
-- counters) and events (pushes, rejections, registrations, snapshots).
-- Times are Unix milliseconds.

CREATE TABLE runs (
    name              TEXT PRIMARY KEY NOT NULL,
    config            TEXT NOT NULL,          -- RunConfig as JSON
    created_at_ms     INTEGER NOT NULL,
    write_token_hash  TEXT,                   -- sha256 hex, when auth is on
    read_token_hash   TEXT
) STRICT;

CREATE TABLE ranks (
    run               TEXT NOT NULL REFERENCES runs(name) ON DELETE CASCADE,
    rank              INTEGER NOT NULL,
    layout            TEXT,                   -- RankLayout as JSON, set by the first push
    last_step         INTEGER,
    pushes            INTEGER NOT NULL DEFAULT 0,
    bytes_received    INTEGER NOT NULL DEFAULT 0,
    rejections        INTEGER NOT NULL DEFAULT 0,
    resident_bytes    INTEGER NOT NULL DEFAULT 0,
    last_push_at_ms   INTEGER,
    PRIMARY KEY (run, rank)
) STRICT;

CREATE TABLE events (
    id                INTEGER PRIMARY KEY,
    run               TEXT NOT NULL REFERENCES runs(name) ON DELETE CASCADE,
    at_ms             INTEGER NOT NULL,
    kind              TEXT NOT NULL,
    rank              INTEGER,
    step              INTEGER,
    detail            TEXT NOT NULL           -- JSON
) STRICT;

CREATE INDEX events_by_run ON events(run, id);
