-- A rank's wire figures (bytes on the wire against the bytes they stand
-- for, codec seconds, the last push's kind), as JSON, so a restart shows
-- them as the rank left them instead of zeros until the next push.
ALTER TABLE ranks ADD COLUMN wire TEXT;

-- The trained model's configuration as its client knows it (a
-- transformers model's `config.to_dict()`), as JSON: written as
-- `config.json` into every `hf` download.
ALTER TABLE run_meta ADD COLUMN model_config TEXT;
