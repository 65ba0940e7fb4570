"""omniloop-kit's tiny-checkpoint builders (the families' tiny checkpoints are built with them;
their parity tests load them on both sides)."""

from __future__ import annotations

import json
from pathlib import Path

from omniloop_kit.tiny import T5_CONFIG, t5_unigram_tokenizer, write_omniloop_json


def test_the_t5_tokenizer_ends_with_eos_and_knows_its_words(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    n = t5_unigram_tokenizer(tmp_path / "tok", ["red", "fox"], pair=True)
    tok = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    assert tok.get_vocab_size() == n
    ids = tok.encode("a red fox").ids
    assert ids[-1] == 1 and tok.token_to_id("\u2581fox") in ids
    assert len(tok.encode("red", "fox").ids) == 4  # the pair template: A </s> B </s>
    assert json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text()) == T5_CONFIG


def test_omniloop_json(tmp_path: Path) -> None:
    write_omniloop_json(tmp_path, "tiny-x", {"steps": 2})
    assert json.loads((tmp_path / "omniloop.json").read_text()) == {"variant": "tiny-x", "defaults": {"steps": 2}}
