-- Events in the order the catalog stored them, across the nodes sharing
-- it: `seq` is taken from `event_seq` in the writer's transaction (whose
-- row lock orders the transactions of every node, so `seq` grows in
-- commit order), and `node` names the node that emitted the event. Nodes
-- follow `seq` (LISTEN `polyak_events`) to stream each other's events.

ALTER TABLE events ADD COLUMN seq BIGINT;
ALTER TABLE events ADD COLUMN node TEXT;
CREATE INDEX events_by_seq ON events(seq);

CREATE TABLE event_seq (
    next_seq          BIGINT NOT NULL
);
INSERT INTO event_seq (next_seq) VALUES (1);
