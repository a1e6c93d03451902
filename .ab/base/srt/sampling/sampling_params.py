"""SamplingParams: per-request decoding options (SGLang's names), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    Attributes
    ----------
    max_new_tokens : tokens to generate at most (>= 0).
    temperature : 0 means greedy (argmax); > 0 divides the logits before sampling.
    top_k : keep the k most likely tokens (-1: all).
    top_p : keep the smallest set of tokens whose probability reaches top_p (1.0: all).
    min_p : drop tokens whose probability is below min_p * max probability (0.0: none).
    stop_token_ids : generation stops after emitting any of these (the token is kept).
    ignore_eos : do not stop at the model's EOS token.
    seed : seeds this request's sampling generator (same seed, same tokens, whatever the batch).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__}")

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def from_dict(cls, params: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        """Build from the `sampling_params` dict of `Engine.generate` (unknown keys raise)."""
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, dict):
            raise TypeError(f"sampling_params must be a dict, got {type(params).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"sampling_params has unknown keys {unknown}; known: {sorted(known)}")
        kw = dict(params)
        stop = kw.get("stop_token_ids")
        if stop is not None:
            kw["stop_token_ids"] = (stop,) if isinstance(stop, int) else tuple(int(t) for t in stop)
        else:
            kw.pop("stop_token_ids", None)
        for name in ("temperature", "top_p", "min_p"):
            if name in kw:
                kw[name] = float(kw[name])
        return cls(**kw)
