-- Placement: the node that holds each rank of a run, and since which
-- epoch. A rank changes hands only by raising its epoch (a failover, or a
-- node claiming a run placed before placement existed), in one statement
-- that checks the epoch it read, so each epoch has exactly one owner;
-- `placement_log` keeps every (rank, epoch) owner ever recorded.

CREATE TABLE placements (
    run               TEXT NOT NULL REFERENCES runs(name) ON DELETE CASCADE,
    rank              INTEGER NOT NULL,
    node_id           TEXT NOT NULL,
    epoch             INTEGER NOT NULL,
    -- the owner's engine for the rank (`cpu#1`, `cuda:0`), once installed
    engine            TEXT,
    PRIMARY KEY (run, rank)
) STRICT;

CREATE TABLE placement_log (
    run               TEXT NOT NULL REFERENCES runs(name) ON DELETE CASCADE,
    rank              INTEGER NOT NULL,
    epoch             INTEGER NOT NULL,
    node_id           TEXT NOT NULL,
    at_ms             INTEGER NOT NULL,
    PRIMARY KEY (run, rank, epoch)
) STRICT;

-- Event ids are handed out in blocks (`next_id` is the first id no node
-- holds yet), so nodes sharing the catalog never number two events alike.
CREATE TABLE event_ids (
    next_id           INTEGER NOT NULL
) STRICT;
INSERT INTO event_ids (next_id) SELECT COALESCE(MAX(id), 0) + 1 FROM events;
