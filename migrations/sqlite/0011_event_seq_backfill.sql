-- Events stored before `seq` existed take places before every later event,
-- in the order of their ids (negative places: -N for the oldest .. -1), so
-- the catalog's order covers every event and a stream can follow it alone.

UPDATE events SET seq = -n.place
FROM (SELECT id, ROW_NUMBER() OVER (ORDER BY id DESC) AS place
      FROM events WHERE seq IS NULL) AS n
WHERE events.id = n.id;

CREATE INDEX events_by_run_seq ON events(run, seq);
