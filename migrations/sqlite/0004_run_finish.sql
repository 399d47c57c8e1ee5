-- A run can be finished: its final snapshot taken, later pushes refused.
-- `finished_at_ms` is NULL while the run is open; `finished_step` is the
-- furthest rank's last step then (NULL: finished before any push), and
-- `finished_snapshot` the final snapshot's id (NULL when nothing was pushed).

ALTER TABLE runs ADD COLUMN finished_at_ms INTEGER;
ALTER TABLE runs ADD COLUMN finished_step INTEGER;
ALTER TABLE runs ADD COLUMN finished_snapshot TEXT;
