-- Events in the order the catalog stored them, across the nodes sharing
-- it: `seq` is taken from `event_seq` in the writer's transaction, and
-- `node` names the node that emitted the event (see the PostgreSQL
-- migration; one node on SQLite).

ALTER TABLE events ADD COLUMN seq INTEGER;
ALTER TABLE events ADD COLUMN node TEXT;
CREATE INDEX events_by_seq ON events(seq);

CREATE TABLE event_seq (
    next_seq          INTEGER NOT NULL
) STRICT;
INSERT INTO event_seq (next_seq) VALUES (1);
