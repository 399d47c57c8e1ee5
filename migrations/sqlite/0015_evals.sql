-- Evaluations: named numbers (held-out loss, accuracy, FID, ...) for one
-- candidate, the weights of one profile (or `online`, the mirror) of one
-- complete snapshot, as one evaluator measured them. One row per snapshot,
-- profile and evaluator; deleting the snapshot deletes its evaluations.

CREATE TABLE evals (
    id                INTEGER PRIMARY KEY,
    run               TEXT NOT NULL REFERENCES runs(name) ON DELETE CASCADE,
    snapshot          TEXT NOT NULL REFERENCES snapshots(id) ON DELETE CASCADE,
    profile           TEXT NOT NULL,          -- a profile of the snapshot, or `online`
    evaluator         TEXT NOT NULL,          -- '' when none was named
    metrics           TEXT NOT NULL,          -- JSON object: name -> finite number
    at_ms             INTEGER NOT NULL,
    UNIQUE (snapshot, profile, evaluator)
) STRICT;

CREATE INDEX evals_by_run ON evals(run, id);
