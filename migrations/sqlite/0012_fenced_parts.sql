-- Fencing tokens: the node that wrote a rank's part and the placement
-- epoch it held the rank in when the part was captured. The transaction
-- that records a part refuses an epoch (or node) that is no longer the
-- rank's placement, so a node paused past its lease cannot complete state
-- for a rank another node holds now. `captured_at_ms` orders one owner's
-- captures of a rank (restore takes the newest epoch, then the newest
-- capture). NULL on parts recorded before these columns existed.

ALTER TABLE snapshot_files ADD COLUMN node_id TEXT;
ALTER TABLE snapshot_files ADD COLUMN epoch INTEGER;
ALTER TABLE snapshot_files ADD COLUMN captured_at_ms INTEGER;
