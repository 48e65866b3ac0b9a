"""A tokenizer built in the process (nothing downloaded), for tests of options that need one
(``stop_strings``): a word-level vocabulary of strings of one to three letters, decoded side by
side."""

from __future__ import annotations

import itertools


def word_tokenizer(vocab_size: int):
    """ids 0..``vocab_size``-1 as strings of one to three of the letters a-j (id 1 is
    "abcdef", which StopStringCriteria tokenizes to clean a vocabulary)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "abcdef"]
    for n in (1, 2, 3):
        words += ["".join(w) for w in itertools.product("abcdefghij", repeat=n)]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words[:vocab_size]))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
