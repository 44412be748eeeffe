"""Live state: per-rank engines and lives, restored at start-up, read as rows."""
