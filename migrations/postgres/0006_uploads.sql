-- Open multipart uploads to the object store (aborted at the next start
-- when a crash left them behind).

CREATE TABLE uploads (
    upload_id         TEXT PRIMARY KEY NOT NULL,
    object_key        TEXT NOT NULL,
    snapshot          TEXT NOT NULL,
    started_at_ms     BIGINT NOT NULL
);
