"""The residual stream between stages: `batch` (start, final norm), `stream`, `add_norm`."""
