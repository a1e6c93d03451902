"""SGLang's per-forward global context (`get_token_to_kv_pool`): srt has none.

srt passes everything a forward needs in the ForwardBatch (`forward_batch.token_to_kv_pool`);
there is no global batch state. SGLang's model files call this only on ROCm (aiter) paths.
"""

from __future__ import annotations

from typing import NoReturn


def get_token_to_kv_pool() -> NoReturn:
    raise RuntimeError(
        "srt has no global forward context: the KV pool is forward_batch.token_to_kv_pool"
    )
