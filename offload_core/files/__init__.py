"""A file's bytes and their identity: positional and direct reads and writes, and which version of a
file bytes were read from (checked against digests of what was read). May import: alignment."""
