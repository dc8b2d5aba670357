"""The tokenizer and chat template a llamacpp export carries (`GGUFVocab`): a GGUF source's own
`tokenizer.*` keys copied as they are; a Hugging Face directory's tokenizer files read with the `gguf`
package's vocab classes (llama.cpp's own converter code); none (`tokenizer.ggml.model = none`, the
vocabulary size only) for a checkpoint without one."""

import json
from dataclasses import dataclass, field
from pathlib import Path

import gguf

from convert.io.gguf_header import is_gguf

#: llama.cpp's pre-tokenizer names (`tokenizer.ggml.pre`) by the first split regex of tokenizer.json
#: (llama.cpp's converter hashes the tokenization of a test text instead; these are the families
#: convert exports); another regex gets "default" and a note.
_PRE = {
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": (
        "llama-bpe"
    ),
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": (
        "qwen2"
    ),
}


@dataclass
class GGUFVocab:
    """What `add_to` writes: copied key-values (name -> (value, type, subtype)), or a directory's
    tokenizer files, or nothing; `note` says what was guessed."""

    copied: dict = field(default_factory=dict)
    directory: Path | None = None
    note: str | None = None

    def add_to(self, writer: gguf.GGUFWriter, vocab_size: int) -> None:
        if self.copied:
            for name, (value, vtype, sub) in self.copied.items():
                writer.add_key_value(name, value, vtype, sub)
        elif self.directory is not None:
            self._add_directory(writer, vocab_size)
        else:
            writer.add_tokenizer_model("none")

    def _add_directory(self, writer: gguf.GGUFWriter, vocab_size: int) -> None:
        assert self.directory is not None  # `add_to` calls this with one
        vocab = gguf.vocab.BpeVocab(self.directory)
        tokens, types = [], []
        for text, _score, kind in vocab.all_tokens():
            tokens.append(text)
            types.append(kind)
        for i in range(len(tokens), vocab_size):  # padded embedding rows
            tokens.append(f"[PAD{i}]".encode())
            types.append(gguf.TokenType.UNUSED)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(self._pre())
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        gguf.SpecialVocab(self.directory, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer)

    def _pre(self) -> str:
        assert self.directory is not None  # called by `_add_directory`
        spec = json.loads((self.directory / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
        for step in spec.get("pretokenizers", [spec]):
            regex = (step.get("pattern") or {}).get("Regex")
            if regex in _PRE:
                return _PRE[regex]
            if step.get("type") == "Digits" and step.get("individual_digits"):
                return "smollm"  # GPT-2's byte-level split after single digits (SmolLM2)
        self.note = "tokenizer.json's pre-tokenizer is not one llama.cpp names here: written as 'default'"
        return "default"


def source_vocab(root: Path) -> GGUFVocab:
    """The tokenizer of the source at `root` (a GGUF file or a model directory)."""
    root = Path(root)
    if is_gguf(root):
        reader = gguf.GGUFReader(str(root))
        copied = {
            f.name: (f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
            for f in reader.fields.values()
            if f.name.startswith("tokenizer.")
        }
        return GGUFVocab(copied=copied)
    if root.is_dir() and (root / "tokenizer.json").is_file():
        model = json.loads((root / "tokenizer.json").read_text()).get("model", {}).get("type")
        if model == "BPE":
            return GGUFVocab(directory=root)
        return GGUFVocab(note=f"tokenizer.json's model {model!r} is not carried (BPE only): the file has no tokenizer")
    return GGUFVocab(note="the source has no tokenizer.json: the file has no tokenizer (ids only)")
