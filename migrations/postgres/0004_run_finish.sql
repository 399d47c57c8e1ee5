-- A run can be finished: its final snapshot taken, later pushes refused.

ALTER TABLE runs ADD COLUMN finished_at_ms BIGINT;
ALTER TABLE runs ADD COLUMN finished_step BIGINT;
ALTER TABLE runs ADD COLUMN finished_snapshot TEXT;
