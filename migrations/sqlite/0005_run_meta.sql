-- What researchers add to a run after the fact: tags and a note (searched
-- on the runs list), and the run's alert rules (with an optional webhook).
-- Per-tensor EMA drift samples, one row per rank, profile and sampled step:
-- the sums of squares of every averaged tensor, in the rank's layout order.

CREATE TABLE run_meta (
    run               TEXT PRIMARY KEY NOT NULL REFERENCES runs(name) ON DELETE CASCADE,
    tags              TEXT NOT NULL DEFAULT '[]',   -- JSON list of strings
    note              TEXT NOT NULL DEFAULT '',
    alert_rules       TEXT NOT NULL DEFAULT '{}',   -- AlertRules as JSON
    updated_at_ms     INTEGER NOT NULL
) STRICT;

CREATE TABLE tensor_drift (
    id                INTEGER PRIMARY KEY,
    run               TEXT NOT NULL REFERENCES runs(name) ON DELETE CASCADE,
    profile           TEXT NOT NULL,
    rank              INTEGER NOT NULL,
    step              INTEGER NOT NULL,
    sums              TEXT NOT NULL                 -- JSON {"names": [..], "diff_sq": [..], "online_sq": [..]}
) STRICT;

CREATE INDEX tensor_drift_by_run ON tensor_drift(run, profile, step);
