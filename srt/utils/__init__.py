"""Small helpers shared by the command-line jobs and the layers (no import-time work)."""
