"""A character-level tokenizer built offline, for tiny models on the arithmetic and GSM8K tasks.

Real runs use the tokenizer that ships with the checkpoint (``AutoTokenizer.from_pretrained``). For
tests, tutorials and the CPU quickstart no tokenizer can be downloaded, so this module builds one in
memory with ``tokenizers``: a ``WordLevel`` model over single characters, a pre-tokenizer that splits
text into characters and a ``Fuse`` decoder that joins them back without spaces. The result is a
plain :class:`transformers.PreTrainedTokenizerFast`, so ``save_pretrained`` / ``from_pretrained`` and
everything else downstream treat it like any other Hugging Face tokenizer.

Ids: ``<pad>`` = 0, ``<eos>`` = 1 (also the bos token), ``<unk>`` = 2, then the characters of
:data:`CHARACTERS`. No special tokens are added on encode (like Qwen tokenizers), so
``decode(encode(text)) == text`` for any text over :data:`CHARACTERS`; other characters map to
``<unk>``.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)

#: Digits, ASCII letters, all ASCII punctuation (``+ - * / = ( ) . , : ; ? #`` and the rest), space,
#: newline and tab: every character of the arithmetic task and of GSM8K's ``<<48/2=24>>`` solutions.
CHARACTERS: str = string.digits + string.ascii_letters + string.punctuation + " \n\t"


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer (vocabulary size ``3 + len(CHARACTERS)`` = 100).

    Returns:
        A ``PreTrainedTokenizerFast`` with ``pad_token_id == 0`` and ``eos_token_id ==
        bos_token_id == 1``; one token per character, no special tokens added on encode.
    """
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Oniguruma has no (?s) flag, so "any character including newline" is spelled [\s\S].
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
    )
