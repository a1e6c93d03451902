"""User-facing entry points (the offline Engine)."""
