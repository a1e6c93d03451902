"""Files shipped inside the package: the embedded tiny tokenizer.

``TINY_TOKENIZER_DIR`` is a folder that ``transformers.AutoTokenizer.from_pretrained`` loads
offline: a byte-level BPE with exactly 1024 tokens (the embedded tiny model's vocab_size),
rebuilt by ``python -m srt.assets.build_tiny_tokenizer``. Special-token ids are fixed:
pad = 0, bos = 1, eos = 2 (then ``<|system|>`` = 3, ``<|user|>`` = 4, ``<|assistant|>`` = 5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_TOKENIZER_DIR: Path = Path(__file__).resolve().parent / "tiny_tokenizer"
TINY_VOCAB_SIZE: int = 1024
TINY_PAD_ID, TINY_BOS_ID, TINY_EOS_ID = 0, 1, 2


def load_tiny_tokenizer() -> Any:
    """Load the embedded tiny tokenizer with ``transformers`` (no network access).

    Returns
    -------
    transformers.PreTrainedTokenizerBase
        ``len(tok) == 1024``; it adds no BOS by itself, its chat template does.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR), local_files_only=True)
