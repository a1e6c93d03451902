"""SGLang's environment switches that its model files read (`sglang.srt.environ.envs`).

Each is read from the environment when asked (`envs.NAME.get()`). The ones srt cannot serve
(ROCm's aiter kernels, SGLang's second weight-loader) read False when unset, and raise
naming themselves when set: a model file never takes a path srt lacks without saying so.
"""

from __future__ import annotations

from dataclasses import dataclass

from srt.settings import sglang_switch


@dataclass(frozen=True)
class EnvBool:
    """A boolean switch; `served=False`: srt has no implementation of the path it turns on."""

    name: str
    default: bool = False
    served: bool = True

    def get(self) -> bool:
        raw = sglang_switch(self.name)
        value = self.default if raw is None else raw.strip().lower() in ("1", "true")
        if value and not self.served:
            raise NotImplementedError(f"{self.name}=1 asks for a path srt does not have")
        return value


class Envs:
    """The switches by name (`envs.SGLANG_USE_AITER.get()`); an unknown name raises."""

    SGLANG_ENABLE_WEIGHT_LOADER_V2 = EnvBool("SGLANG_ENABLE_WEIGHT_LOADER_V2", served=False)
    SGLANG_USE_AITER = EnvBool("SGLANG_USE_AITER", served=False)
    SGLANG_AITER_FUSE_RMSNORM_PAD = EnvBool("SGLANG_AITER_FUSE_RMSNORM_PAD", served=False)
    SGLANG_ENABLE_DETERMINISTIC_INFERENCE = EnvBool(
        "SGLANG_ENABLE_DETERMINISTIC_INFERENCE", served=False
    )

    def __getattr__(self, name: str) -> EnvBool:
        raise AttributeError(f"srt does not know SGLang's environment switch {name!r}")


envs = Envs()
