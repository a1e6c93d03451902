"""SamplingParams: per-request decoding options (SGLang's names), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from srt.sampling.logit_bias import LogitBias, parse_logit_bias

# Accepted as the old name of sampling_seed.
SEED_ALIAS = "seed"
PENALTIES = ("frequency_penalty", "presence_penalty", "repetition_penalty")
# SGLang's _SAMPLING_EPS: 0 <= temperature below it is greedy (logits / T would overflow).
SAMPLING_EPS = 1e-6
MAX_N = 128  # outputs per prompt (OpenAI's cap on n)
MAX_TOP_K = 2**31 - 1  # top_k travels as an int32-sized count
SEED_RANGE = (-(2**63), 2**63 - 1)  # SGLang's sampling_seed range (a torch generator's seed)
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal float32


def _number(name: str, value: Any) -> float:
    """`value` as a finite float; bools, strings and NaN/inf raise (naming `name`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _float32(name: str, value: float) -> None:
    """Raise unless `value` is 0 or a normal float32: the sampler computes in float32, where a
    larger value is inf and a smaller nonzero one is 0 or subnormal (a division by it is inf)."""
    if abs(value) > FLOAT32_MAX:
        raise ValueError(f"{name}={value:g} overflows float32 (largest {FLOAT32_MAX:.4g})")
    if 0.0 < abs(value) < FLOAT32_TINY:
        raise ValueError(
            f"{name}={value:g} underflows float32 (smallest normal {FLOAT32_TINY:.4g}); use 0"
            " or a larger value"
        )


def _integer(name: str, value: Any) -> int:
    """`value` as an int; an integral float (3.0) is accepted, 2.5, "0.5", True and NaN raise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name} must be an integer, got {value}")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded (SGLang's `sampling_params` names and semantics).

    Attributes
    ----------
    max_new_tokens : tokens to generate at most (>= 0).
    min_new_tokens : stop tokens, EOS and stop strings are ignored before this many tokens.
    temperature : 0 means greedy (argmax), and so does anything below SAMPLING_EPS (1e-6, as in
        SGLang); otherwise it divides the logits before sampling. At most float32's max.
    top_k : keep the k most likely tokens (-1: all; at most 2**31 - 1).
    top_p : keep the smallest set of tokens whose probability reaches top_p (1.0: all).
    min_p : drop tokens whose probability is below min_p * max probability (0.0: none).
    frequency_penalty : in [-2, 2]; subtracted from a token's logit once per time it was
        generated.
    presence_penalty : in [-2, 2]; subtracted once from the logit of every generated token.
    repetition_penalty : in (0, 2]; tokens of the prompt or the output get their logit divided
        by it (positive logits) or multiplied by it (negative ones). 1.0 is off.
    stop : stop strings; generation stops once the output text contains one, and the text is
        cut before it (unless no_stop_trim). output_ids keep every generated token.
    stop_token_ids : generation stops after emitting any of these (output_ids keep the token,
        the text drops it unless no_stop_trim).
    ignore_eos : do not stop at the model's EOS token.
    skip_special_tokens : drop special tokens when decoding the text.
    no_stop_trim : keep the matched stop string / stop token in the text.
    n : outputs per prompt, 1 to MAX_N (128); each one a separate request; seeded ones get
        seeds s, s+1, ....
    sampling_seed : seeds this request's sampling generator (same seed, same tokens, whatever
        the batch), in [-2**63, 2**63 - 1] (SGLang's range; with n, s + n - 1 too). `seed` is
        accepted as an alias by `from_dict`.
    logit_bias : {token id: bias in [-100, 100]} (OpenAI's; keys ints or digit strings), added
        to the logits after the penalties, greedy rows too; stored as sorted (id, bias) pairs.

    Every float is 0 or a normal float32 (the sampler's dtype): 1e-300 or 1e39 raise, naming
    the field, instead of turning into inf or NaN inside a forward step.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None
    logit_bias: LogitBias | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_bias", parse_logit_bias(self.logit_bias))
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            _integer(name, getattr(self, name))
        for name in ("temperature", "top_p", "min_p") + PENALTIES:
            _number(name, getattr(self, name))
        t = self.temperature
        _float32("temperature", t if t >= SAMPLING_EPS else 0.0)  # tiny ones are greedy
        for name in ("top_p", "min_p") + PENALTIES:
            _float32(name, getattr(self, name))
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k == 0 or self.top_k < -1 or self.top_k > MAX_TOP_K:
            raise ValueError(
                f"top_k must be -1 (disabled) or in [1, {MAX_TOP_K}], got {self.top_k}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        for name in ("stop", "stop_token_ids"):
            if not isinstance(getattr(self, name), tuple):
                got = type(getattr(self, name)).__name__
                raise TypeError(f"{name} must be a tuple (from_dict takes lists), got {got}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise TypeError(f"stop must be a string or a list of non-empty strings: {self.stop!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"stop_token_ids must be ints, got {t!r}")
            if t < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t}")
        if self.sampling_seed is not None:
            self._check_seed()
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _check_seed(self) -> None:
        seed = self.sampling_seed
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"sampling_seed must be an int or None, got {seed!r}")
        lo, hi = SEED_RANGE
        if not lo <= seed <= hi:
            raise ValueError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}")
        if seed + self.n - 1 > hi:
            raise ValueError(
                f"sampling_seed + n - 1 must be <= 2**63 - 1 (the n outputs take seeds s, s+1,"
                f" ...), got {seed} + {self.n} - 1"
            )

    @property
    def seed(self) -> int | None:
        """Alias of sampling_seed (the name this package used before)."""
        return self.sampling_seed

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding (temperature below SAMPLING_EPS, or top_k 1)."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty (or min_new_tokens) changes the logits before sampling."""
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.min_new_tokens > 0
        )

    @classmethod
    def from_dict(cls, params: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        """Build from the `sampling_params` dict of `Engine.generate` (unknown keys raise).

        `stop` may be a string or a list of strings, `stop_token_ids` an int or a list of ints,
        `seed` stands for `sampling_seed`; None values mean the default.
        """
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, dict):
            raise TypeError(f"sampling_params must be a dict, got {type(params).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known - {SEED_ALIAS})
        if unknown:
            raise ValueError(f"sampling_params has unknown keys {unknown}; known: {sorted(known)}")
        kw = {k: v for k, v in params.items() if v is not None}
        if SEED_ALIAS in kw:
            seed = kw.pop(SEED_ALIAS)
            if kw.setdefault("sampling_seed", seed) != seed:
                raise ValueError(f"seed={seed!r} and sampling_seed={kw['sampling_seed']!r} differ")
        stop = kw.get("stop")
        if stop is not None:
            if not isinstance(stop, (str, list, tuple)):  # a dict must not become its keys
                raise TypeError(
                    f"stop must be a string or a list of strings, got {type(stop).__name__}"
                    f" ({stop!r})"
                )
            kw["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        stop_ids = kw.get("stop_token_ids")
        if stop_ids is not None:
            if isinstance(stop_ids, bool) or not isinstance(stop_ids, (int, list, tuple)):
                raise TypeError(
                    f"stop_token_ids must be an int or a list of ints, got"
                    f" {type(stop_ids).__name__} ({stop_ids!r})"
                )
            kw["stop_token_ids"] = (stop_ids,) if isinstance(stop_ids, int) else tuple(stop_ids)
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            if name in kw:
                kw[name] = _integer(name, kw[name])
        return cls(**kw)
