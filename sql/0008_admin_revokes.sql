-- Admin revokes (issue 5): an optional reason kept with each revoked token, and Idempotency-Key
-- records for revokes. A create's record keeps the SHA-256 of the token it derived (a replay
-- re-derives it); a revoke's record keeps the JSON it answered instead (a replay answers it
-- again, byte for byte, without revoking twice). `json`, not `jsonb`: the text is kept as sent.

ALTER TABLE api_keys ADD COLUMN revocation_reason text
    CHECK (length(revocation_reason) BETWEEN 1 AND 512);
ALTER TABLE manual_registration_tokens ADD COLUMN revocation_reason text
    CHECK (length(revocation_reason) BETWEEN 1 AND 512);
ALTER TABLE provisioner_tokens ADD COLUMN revocation_reason text
    CHECK (length(revocation_reason) BETWEEN 1 AND 512);

ALTER TABLE admin_commands ALTER COLUMN token_sha256 DROP NOT NULL;
ALTER TABLE admin_commands ADD COLUMN answer json;
ALTER TABLE admin_commands ADD CONSTRAINT admin_commands_one_result_ck
    CHECK ((token_sha256 IS NULL) <> (answer IS NULL));
