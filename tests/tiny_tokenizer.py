"""A tiny Hugging Face tokenizer made with the `tokenizers` library: a byte-level BPE over a few sentences, the special
tokens of a chat model, and a tokenizer_config.json with a ChatML template (what a Qwen or SmolLM2 checkpoint ships)."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ("<s>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEXT = ["the island trains a model", "what is two plus two? four", "hello there, how are you", "an outer step"] * 20


def write_tokenizer(directory: Path, template: str | None = CHATML, vocab: int = 300) -> Path:
    """DIR/tokenizer.json (and DIR/tokenizer_config.json: bos <s>, eos <|im_end|>, pad <s>, the template); its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXT, trainer=trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "<|im_end|>", "special": True}, "pad_token": "<s>"}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory / "tokenizer.json"
