"""Character-level tokenizer for the tiny demo models.

One token per character of a fixed alphabet, plus four special tokens. Built with the
`tokenizers` library and wrapped as a `transformers.PreTrainedTokenizerFast`, so it saves
to a plain `tokenizer.json` + `tokenizer_config.json` pair that `AutoTokenizer` and vLLM
load without custom code.

Ids: `<pad>`=0, `<bos>`=1, `<eos>`=2, `<unk>`=3, then the alphabet in order. Encoding
prepends `<bos>` (the Llama convention); no `<eos>` is appended, because a prompt is
continued by the model. Round trip:
`tok.decode(tok(s).input_ids, skip_special_tokens=True) == s` for every string over the
alphabet (spaces and digits included, nothing stripped or merged), except that the
literal texts "<pad>", "<bos>", "<eos>", "<unk>" encode to their special ids, as in
every HF tokenizer.
"""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from models.training.critic_init import save_tokenizer  # noqa: F401 - the demos' models save theirs with it

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

DEFAULT_ALPHABET = string.digits + string.ascii_letters + string.punctuation + " "
"""Printable ASCII without tabs/newlines: 95 characters, so the vocabulary has 99 ids."""


def _check_alphabet(alphabet: str) -> None:
    if not alphabet:
        raise ValueError("alphabet must not be empty")
    if len(set(alphabet)) != len(alphabet):
        dup = sorted({c for c in alphabet if alphabet.count(c) > 1})
        raise ValueError(f"alphabet has repeated characters: {dup!r}")
    bad = [c for c in alphabet if not c.isprintable()]
    if bad:
        raise ValueError(f"alphabet characters must be printable, got {bad!r}")


def build_char_tokenizer(
    alphabet: str = DEFAULT_ALPHABET, model_max_length: int = 1024
) -> PreTrainedTokenizerFast:
    """Build the character tokenizer over `alphabet` (order fixes the ids).

    Characters outside the alphabet encode to `<unk>`. The special-token strings
    themselves (e.g. the text "<eos>") encode to the special ids, as in any HF tokenizer.
    """
    _check_alphabet(alphabet)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})

    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # "[\s\S]" isolates every single character (newlines too, which then map to <unk>).
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()  # join tokens with no separator
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    core.add_special_tokens(list(SPECIAL_TOKENS))

    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved by `save_tokenizer` (or any HF tokenizer directory)."""
    return AutoTokenizer.from_pretrained(str(path))
