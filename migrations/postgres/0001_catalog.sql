-- The catalog on PostgreSQL: the same tables as migrations/sqlite, with
-- BIGINT for every integer (ids, steps and byte counts pass 2^31).
-- Runs (their full configuration), ranks (layout, last step, counters)
-- and events (pushes, rejections, registrations, snapshots).
-- Times are Unix milliseconds.

CREATE TABLE runs (
    name              TEXT PRIMARY KEY NOT NULL,
    config            TEXT NOT NULL,          -- RunConfig as JSON
    created_at_ms     BIGINT NOT NULL,
    write_token_hash  TEXT,                   -- sha256 hex, when auth is on
    read_token_hash   TEXT
);

CREATE TABLE ranks (
    run               TEXT NOT NULL REFERENCES runs(name) ON DELETE CASCADE,
    rank              BIGINT NOT NULL,
    layout            TEXT,                   -- RankLayout as JSON, set by the first push
    last_step         BIGINT,
    pushes            BIGINT NOT NULL DEFAULT 0,
    bytes_received    BIGINT NOT NULL DEFAULT 0,
    rejections        BIGINT NOT NULL DEFAULT 0,
    resident_bytes    BIGINT NOT NULL DEFAULT 0,
    last_push_at_ms   BIGINT,
    PRIMARY KEY (run, rank)
);

CREATE TABLE events (
    id                BIGINT PRIMARY KEY,     -- assigned by the server
    run               TEXT NOT NULL REFERENCES runs(name) ON DELETE CASCADE,
    at_ms             BIGINT NOT NULL,
    kind              TEXT NOT NULL,
    rank              BIGINT,
    step              BIGINT,
    detail            TEXT NOT NULL           -- JSON
);

CREATE INDEX events_by_run ON events(run, id);
