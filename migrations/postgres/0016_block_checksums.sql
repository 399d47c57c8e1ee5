-- Block checksums of each stored part: `crc32:<block bytes>:<8 hex digits
-- per block>`, written by the part's writer in the same pass as its bytes.
-- Readers check every block before handing its bytes on. NULL on parts
-- written before this column existed: their whole sha256 is checked.

ALTER TABLE snapshot_files ADD COLUMN blocks TEXT;
