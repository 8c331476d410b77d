"""Build the small byte-level BPE tokenizer shipped with scripts/models/llama-1b.

The model runs with dummy weights (``--load-format dummy``), so the tokenizer
only has to let ``vllm serve`` start offline and turn text into ids and back:
a byte-level BPE trained on the short text below (written for this purpose)
does that in a few kilobytes. The model's config says bos = 128000 and
eos = 128001, far above the trained vocabulary, so those two special tokens
are put into the model vocabulary at exactly those ids (a BPE vocabulary may
have gaps); every id in between decodes to nothing.

Deterministic: the same tokenizers version writes the same files. Run::

    python scripts/build_tokenizer.py [--out scripts/models/llama-1b]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # single-threaded training: stable merge order
os.environ.setdefault("RAYON_NUM_THREADS", "1")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
BOS_ID, EOS_ID = 128000, 128001
VOCAB_SIZE = 1024
MODEL_DIR = Path(__file__).resolve().parent / "models" / "llama-1b"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)

CORPUS = """\
A cache keeps what was computed so that it need not be computed again. When a language model
reads a prompt, every layer turns each token into a key and a value, and those vectors are what
later tokens attend to. Keeping them is cheap in time and costly in memory: the longer the
conversation and the more people served at once, the more of the graphics card they fill.
A serving engine usually claims a fixed part of the card for this cache when it starts, and
keeps that part for as long as it runs, even at night when nobody asks it anything.
Elastic memory changes the bargain. The addresses are reserved up front, but the physical pages
behind them are attached only while a request needs them, and handed back when it is done.
Two or three models can then take turns on one card: the busy one grows, the idle one shrinks,
and neither has to be restarted to change its share.
Sharing needs rules. Each process has a name, a floor it may always reach and a ceiling it may
never pass. The floor of one is never lent to another; the space between floors and ceilings
goes to whoever asks first, and a process that keeps old prefixes it is not using is asked to
let go of them when another one is waiting.
Numbers and words mix in ordinary text: 1, 2, 3, 10, 42, 100, 512, 1024, 2048, 4096, 8192.
Dates like 2026-11-26, times like 12:30, sizes like 8 MiB, 2 GiB and 80 GB, ports like 8001.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
Questions and answers: What is the capital of France? Paris. How many legs has a spider? Eight.
Which planet is closest to the sun? Mercury. What colour is the sky on a clear day? Blue.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))

{"model": "llama-1b", "prompt": "Hello, world", "max_tokens": 16, "temperature": 0}
User: Tell me a short story about a lighthouse.
Assistant: Once upon a time a keeper lit the lamp every evening, and every ship came home safe.
"""


def train() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def place_special_tokens(tokenizer: Tokenizer) -> dict:
    """The tokenizer as JSON, with bos/eos in the model vocabulary at the config's ids."""
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    assert max(vocab.values()) < BOS_ID and BOS not in vocab and EOS not in vocab
    vocab[BOS], vocab[EOS] = BOS_ID, EOS_ID
    data["added_tokens"] = [
        {"id": token_id, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for token_id, text in ((BOS_ID, BOS), (EOS_ID, EOS))
    ]
    data["post_processor"] = json.loads(processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]).__getstate__())
    return data


def write(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "tokenizer.json": place_special_tokens(train()),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
            "model_max_length": 131072, "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
        "special_tokens_map.json": {"bos_token": BOS, "eos_token": EOS},
    }
    written = []
    for name, content in files.items():
        path = out / name
        path.write_text(json.dumps(content, indent=1, ensure_ascii=False, sort_keys=False) + "\n",
                        encoding="utf-8")
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=MODEL_DIR, help="model directory (default: %(default)s)")
    args = parser.parse_args()
    for path in write(args.out):
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
