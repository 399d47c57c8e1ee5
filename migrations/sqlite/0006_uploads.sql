-- Multipart uploads to the object store that are open: recorded when an
-- upload starts and removed when it is completed or aborted, so the next
-- start aborts the ones a crash left behind.

CREATE TABLE uploads (
    upload_id         TEXT PRIMARY KEY NOT NULL,
    object_key        TEXT NOT NULL,
    snapshot          TEXT NOT NULL,
    started_at_ms     INTEGER NOT NULL
) STRICT;
