"""Rebuild the embedded tiny tokenizer (``srt/assets/tiny_tokenizer/``) from scratch.

A byte-level BPE with exactly 1024 tokens (the embedded tiny model's ``vocab_size``), trained
with the ``tokenizers`` library on a small synthetic English corpus generated here from a fixed
seed. Nothing is downloaded. Run::

    python -m srt.assets.build_tiny_tokenizer            # rewrite the committed files
    python -m srt.assets.build_tiny_tokenizer --check    # exit 1 if a rebuild would differ

Special tokens and their ids are fixed by their order in ``SPECIAL_TOKENS``:
``<|pad|>`` = 0, ``<|bos|>`` = 1, ``<|eos|>`` = 2, then the chat-role markers. The tokenizer does
not add BOS by itself; the chat template starts with it and ends every turn with EOS.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

VOCAB_SIZE = 1024
SEED = 1234
NUM_SENTENCES = 6000
OUT_DIR = Path(__file__).resolve().parent / "tiny_tokenizer"
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>"]

# One user/assistant (and optional system) turn per message; EOS closes every turn so that a
# model generating an assistant turn stops on EOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_WORDS = {
    "det": "the a an this that each every some no one".split(),
    "adj": (
        "small large hot cold fast slow bright dark stable unstable heavy light simple complex "
        "linear quantum thermal organic acidic basic electric magnetic chiral polar neutral "
        "positive negative total constant random ideal rigid elastic dense"
    ).split(),
    "noun": (
        "atom molecule electron proton neutron photon nucleus ion bond orbital energy mass "
        "charge field wave particle reaction solution acid base salt gas liquid solid crystal "
        "cell gene protein enzyme membrane virus bacteria tissue organism species star planet "
        "galaxy orbit spin state system temperature pressure volume entropy momentum force "
        "velocity frequency spectrum sample student question answer model result experiment "
        "theory equation value number ratio rate time distance angle"
    ).split(),
    "verb": (
        "absorbs emits contains forms breaks moves changes increases decreases measures "
        "explains predicts produces binds releases rotates collides decays reacts depends "
        "follows becomes remains shows gives"
    ).split(),
    "adv": "quickly slowly rarely always never often strongly weakly mostly nearly".split(),
    "prep": "in on with from into under over between near through without".split(),
    "unit": "m s kg K mol J eV nm Hz Pa V A W mL g".split(),
    "name": "Alice Bob Carol Dave Eve Frank Grace Heidi Ivan Judy".split(),
}
_FORMULAS = "H2O CO2 NaCl CH4 NH3 O2 N2 H2SO4 C6H12O6 Fe2O3 HCl KOH".split()
_MC_PROMPT = (
    "Answer the following multiple choice question. The last line of your response should be "
    "of the following format: 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. "
    "Think step by step before answering."
)


def _number(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return str(rng.randrange(1000))
    if kind == 1:
        return f"{rng.uniform(0, 100):.{rng.randrange(1, 4)}f}"
    if kind == 2:
        return f"{rng.uniform(1, 10):.2f} x 10^{rng.randrange(-12, 13)}"
    return f"{rng.randrange(1, 20)}/{rng.randrange(2, 30)}"


def _sentence(rng: random.Random) -> str:
    w = {k: rng.choice(v) for k, v in _WORDS.items()}
    kind = rng.randrange(8)
    if kind == 0:
        s = f"{w['det']} {w['adj']} {w['noun']} {w['verb']} {w['det']} {w['noun']} {w['adv']}."
    elif kind == 1:
        s = f"{w['name']} {w['verb']} the {w['noun']} {w['prep']} a {w['adj']} {w['noun']}."
    elif kind == 2:
        s = f"What is the {w['noun']} of the {w['adj']} {w['noun']} {w['prep']} {_number(rng)} "
        s += f"{w['unit']}?"
    elif kind == 3:
        s = f"The {w['noun']} is {_number(rng)} {w['unit']}, so the {w['noun']} "
        s += f"{w['verb']} by {_number(rng)}%."
    elif kind == 4:
        s = f"{rng.choice(_FORMULAS)} + {rng.choice(_FORMULAS)} -> {rng.choice(_FORMULAS)} "
        s += f"(dH = {_number(rng)} kJ/mol)"
    elif kind == 5:
        letters = "ABCD"
        adj, noun = _WORDS["adj"], _WORDS["noun"]
        s = "\n".join(f"{c}) {rng.choice(adj)} {rng.choice(noun)}" for c in letters)
        s += f"\nAnswer: {rng.choice(letters)}"
    elif kind == 6:
        s = f"Step {rng.randrange(1, 10)}: if {w['noun']} = {_number(rng)}, then "
        s += f"{w['noun']} = {_number(rng)} ({w['adv']} {w['adj']})."
    else:
        s = f'"{w["det"].capitalize()} {w["noun"]} {w["verb"]} {w["adv"]}," said {w["name"]}.'
    return s[0].upper() + s[1:]


def build_corpus(seed: int = SEED, num_sentences: int = NUM_SENTENCES) -> list[str]:
    """The synthetic training corpus: ``num_sentences`` short lines from a seeded RNG."""
    rng = random.Random(seed)
    corpus = [_MC_PROMPT] * 20
    corpus += [_sentence(rng) for _ in range(num_sentences)]
    return corpus


def train_tokenizer(corpus: list[str], vocab_size: int = VOCAB_SIZE):
    """Train the byte-level BPE (``tokenizers.Tokenizer``) with exactly ``vocab_size`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(
            f"trained vocab has {tok.get_vocab_size()} tokens, want {vocab_size}: "
            "enlarge the corpus"
        )
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"special token {name} got id {tok.token_to_id(name)}, want {i}")
    return tok


def _tokenizer_config() -> dict:
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "additional_special_tokens": SPECIAL_TOKENS[3:],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(out_dir: Path, seed: int = SEED) -> None:
    """Train and write tokenizer.json, tokenizer_config.json, special_tokens_map.json."""
    tok = train_tokenizer(build_corpus(seed))
    out_dir.mkdir(parents=True, exist_ok=True)
    # Compact JSON keeps the committed asset small.
    raw = json.loads(tok.to_str())
    (out_dir / "tokenizer.json").write_text(json.dumps(raw, ensure_ascii=False) + "\n")
    config = _tokenizer_config()
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": SPECIAL_TOKENS[3:],
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def check(out_dir: Path = OUT_DIR) -> list[str]:
    """Rebuild into a temporary folder; return the names of files that differ from ``out_dir``."""
    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer(Path(tmp))
        return [
            name
            for name in _FILES
            if not (out_dir / name).is_file()
            or (out_dir / name).read_bytes() != (Path(tmp) / name).read_bytes()
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output folder")
    parser.add_argument("--check", action="store_true", help="only compare a rebuild with --out")
    args = parser.parse_args(argv)
    if args.check:
        diff = check(args.out)
        print("up to date" if not diff else f"differs: {', '.join(diff)}")
        return 1 if diff else 0
    write_tokenizer(args.out)
    print(f"wrote {', '.join(_FILES)} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
