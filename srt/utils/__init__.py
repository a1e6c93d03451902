"""Small helpers shared by the command-line jobs (no import-time work)."""
