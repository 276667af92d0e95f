"""A small Hugging Face tokenizer built offline (nothing downloaded), for the tests of Megatron's
``HuggingFaceTokenizer`` and ``SFTTokenizer``: byte-level BPE trained on this repository's own
text, with the special tokens Megatron's SFT prompt formats use (``<SPECIAL_10>`` system,
``<SPECIAL_11>`` user/assistant, ``<SPECIAL_12>``, ``<SPECIAL_233>`` nemotron-h-aligned's pad)
and a chat template, saved as a tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``)."""

from pathlib import Path

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<SPECIAL_233>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<SPECIAL_11>' + message['role'] + '\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
)


def build_tokenizer_dir(folder: Path, texts, vocab_size: int = 320) -> Path:
    """Train a byte-level BPE of ``vocab_size`` ids on ``texts`` and save it to ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
    )
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return folder
