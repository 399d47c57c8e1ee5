-- Failover: the last time a rank changed hands because its node was gone,
-- as JSON (the epoch, the node it came from, the snapshot and step it was
-- restored from, and once the trainer pushed again, the steps lost), so
-- every node shows it.

ALTER TABLE ranks ADD COLUMN failover TEXT;
