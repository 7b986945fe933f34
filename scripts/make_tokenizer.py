"""Train the project's tiny byte-level BPE tokenizer (run once; its output is committed).

There is no model hub here, so tests and examples need a tokenizer the project provides.
It is a real byte-level BPE (GPT-2/Qwen style pre-tokenizer, merges learnt from Python
source and English prose), so tokenization has the merge effects that make
decode-then-re-encode drift across turns: the tests need that to be realistic.

    python scripts/make_tokenizer.py   # writes agentrl/models/assets/tokenizer.json
"""

import pathlib
import sysconfig

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from agentrl.models.tokenizer import MARKUP_TOKENS, SPECIAL_TOKENS

VOCAB_SIZE = 2048
OUT = pathlib.Path(__file__).resolve().parents[1] / "agentrl/models/assets/tokenizer.json"


def corpus() -> list[str]:
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    names = [
        "textwrap.py",
        "json/encoder.py",
        "json/decoder.py",
        "functools.py",
        "heapq.py",
        "bisect.py",
        "fractions.py",
        "statistics.py",
        "string.py",
        "difflib.py",
        "this.py",
    ]
    texts = [(stdlib / n).read_text() for n in names]
    root = OUT.parents[3]
    texts += [p.read_text() for p in sorted(root.glob("*.md"))]
    return texts


def main() -> None:
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(OUT))
    print(f"wrote {OUT} ({tok.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
