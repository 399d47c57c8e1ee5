-- Scalar series: trainer metrics posted by clients (loss, lr, ...), and
-- series the server records itself (EMA drift per profile, ingest rate).
-- `rank` is NULL for run-level points. Retention is bounded per series.

CREATE TABLE metrics (
    id                INTEGER PRIMARY KEY,
    run               TEXT NOT NULL REFERENCES runs(name) ON DELETE CASCADE,
    name              TEXT NOT NULL,
    step              INTEGER NOT NULL,
    rank              INTEGER,
    value             REAL NOT NULL,
    at_ms             INTEGER NOT NULL
) STRICT;

CREATE INDEX metrics_by_series ON metrics(run, name, step);
