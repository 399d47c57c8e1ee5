-- The nodes of one service (servers sharing this catalog): each registers
-- at start and renews its lease; a lease not renewed within `lease_ms` of
-- `renewed_at_ms` (the catalog's clock) has expired.

CREATE TABLE nodes (
    node_id           TEXT PRIMARY KEY NOT NULL,
    url               TEXT NOT NULL,
    -- JSON list of the node's engines (`cpu#0`, `cuda:1`, ...)
    engines           TEXT NOT NULL,
    memory_budget     BIGINT NOT NULL,
    started_at_ms     BIGINT NOT NULL,
    renewed_at_ms     BIGINT NOT NULL,
    lease_ms          BIGINT NOT NULL,
    ranks             BIGINT NOT NULL,
    resident_bytes    BIGINT NOT NULL,
    -- 'live' while it runs, 'left' after a graceful stop
    state             TEXT NOT NULL
);
